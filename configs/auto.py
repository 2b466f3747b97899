"""configs/base.py with the codecs chosen by the trainer from measured links:
the mesh is probed at start (a few seconds), or read from a profile, and the
candidates the model cannot tell apart are timed for 6 steps each
(compression.trial) before training starts.

    python train.py --config=configs/auto.py
    python train.py --config=configs/auto.py \\
        --config.compression.profile=configs/profiles/h100_8x_nvlink_400g.json \\
        --config.compression.budget=grad=int8 --config.compression.overlap=0.3

See docs/trainer.md, "Letting jcomp choose: compression.auto"."""
from configs import base


def get_config():
    c = base.get_config()
    c.compression.auto = "on"
    c.compression.trial = 6
    return c
