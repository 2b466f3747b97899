"""configs/tiny.py's config with dotted overrides, for tests that check or build
a run in process."""
from configs import tiny


def tiny_config(**overrides):
    """tiny.get_config() with {"train.steps": 3, ...} set on it."""
    cfg = tiny.get_config()
    for name, value in overrides.items():
        node = cfg
        *parents, leaf = name.split(".")
        for part in parents:
            node = node[part]
        node[leaf] = value
    return cfg
