"""One aggressive codec (int4) on every collective of every axis."""
from configs import base


def get_config():
    c = base.get_config()
    c.compression.policy = "naive"
    return c
