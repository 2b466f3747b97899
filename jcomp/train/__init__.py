"""The training run: the checked config (runspec), the loop, resume, data,
checkpoints, metrics, hooks, and the process-level fault handling."""
