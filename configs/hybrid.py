"""The hybrid preset: the setting benchmarks/RESULTS.md measured best over seeds
(int4:rot on data-parallel gradients and on tensor-parallel activations and
their gradients, int8 on pipeline sends and parameter gathers, no error
feedback). See jcomp/gpt/policy.py."""
from configs import base


def get_config():
    c = base.get_config()
    c.compression.policy = "hybrid"
    return c
