"""DiLoCo across two islands: the data axis split into 2 slow-hop groups
(mesh.dcn_data=2 on data 4 x tensor 2, as configs/multinode.py), each group an
island that trains alone for 10 steps (its own AdamW, data and tensor
parallelism inside, nothing sent between islands); then the islands average
their pseudo-gradients coded int4:rot and the shared anchor steps to their
mean (outer lr 1, no momentum: on configs/base.py's model DiLoCo's Nesterov
0.7/0.9 ends 600 steps far behind; docs/trainer.md, jcomp/train/outer/islands.py).

    python train.py --config=configs/diloco.py --config.train.steps=40

The streaming form (fragments of the parameters syncing in turn):
    python train.py --config=configs/diloco.py --config.outer.fragments=2
"""
from configs import base


def get_config():
    c = base.get_config()
    c.mesh.update(data=4, tensor=2, pipeline=1, dcn_data=2)
    c.outer.update(every=10, codec="int4:rot", error_feedback="off", lr=1.0, momentum=0.0,
                   fragments=1)
    return c
