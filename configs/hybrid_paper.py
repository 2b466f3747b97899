"""The CCGrid 2024 hybrid scheme: int4 with error feedback on data-parallel
gradients, int8 on tensor/pipeline activations, their gradients and the ZeRO
parameter gather."""
from configs import base


def get_config():
    c = base.get_config()
    c.compression.policy = "hybrid_paper"
    return c
