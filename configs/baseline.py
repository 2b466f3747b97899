"""No compression: every collective is the plain jax.lax one."""
from configs import base


def get_config():
    c = base.get_config()
    c.compression.policy = "baseline"
    return c
