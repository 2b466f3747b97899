"""The run's machinery: checkpoints, resume, data, metrics, faults, processes.

Imports nothing: the fault handling and the supervisor load no JAX."""
