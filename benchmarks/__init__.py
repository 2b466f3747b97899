"""Micro-benchmarks of the compressed collectives and train steps (python -m benchmarks.NAME)."""
