"""The hybrid preset: the best setting experiments/RESULTS.md found at no more than
1/6 of the baseline's bytes, though it does not meet the 1% rule (README, "Policies
and presets") (int4:rot on data-parallel gradients and on tensor-parallel activations and
their gradients, int8 on pipeline sends and parameter gathers, no error
feedback). See jcomp/gpt/policy.py."""
from configs import base


def get_config():
    c = base.get_config()
    c.compression.policy = "hybrid"
    return c
