"""Studies: convergence, a throttled link, the cost model, RESULTS.md (python -m experiments.X)."""
