"""Maintenance tools: the regression check, network namespaces (python -m tools.NAME)."""
