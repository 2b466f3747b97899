"""Two hops: the data axis split into 2 slow-hop groups (nodes, or processes on one
machine), raw inside a group and coded between groups; tensor and pipeline
messages as in the hybrid preset (jcomp/gpt/policy.py, HYBRID).

On 8 devices: mesh (dcn 2, data 2, tensor 2, pipeline 1), each group 4 devices
(2 data x 2 tensor). In one process the groups are halves of the device order,
an emulation: nothing about the link differs. With 2 processes of 4 devices
each group is one process (jcomp/gpt/mesh.py).

    python train.py --config=configs/multinode.py --config.train.steps=20
"""
from configs import base


def get_config():
    c = base.get_config()
    c.mesh.update(data=4, tensor=2, pipeline=1, dcn_data=2)
    c.compression.data.update(grad="none", param="none")  # the fast hop: raw
    c.compression.dcn.update(grad="int4:rot", param="int8")  # the slow hop
    # The hybrid preset's tensor and pipeline entries (policy.HYBRID).
    c.compression.tensor.update(act="int4:rot", act_grad="int4:rot")
    c.compression.pipeline.update(act="int8", act_grad="int8")
    c.optim.warmup_steps = 10  # base's 20 would not fit the 20-step run above
    return c
