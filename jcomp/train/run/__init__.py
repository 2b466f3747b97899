"""The run's machinery: checkpoints, data, metrics and what a run prints, faults,
processes.

Imports nothing: the fault handling and the supervisor load no JAX."""
