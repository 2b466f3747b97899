"""SparseLoCo across two islands (configs/diloco.py's mesh): each island trains
alone for 10 steps, then sends of its pseudo-gradient plus a decaying residual
(beta 0.95) the 64 largest entries of every 4096-entry chunk, on 2 bits each
(four levels) with their positions in an Elias-Fano code; the anchor steps to
the islands' mean (outer lr 1, no momentum: the residual stands in for it).
jcomp/collectives/outer/sparseloco.py; `:coder=index` gives the earlier three-level,
uint16-position payload.

    python train.py --config=configs/sparseloco.py --config.train.steps=40
"""
from configs import diloco


def get_config():
    c = diloco.get_config()
    c.outer.update(every=10, codec="sparseloco:k=64:chunk=4096:beta=0.95", error_feedback="on",
                   lr=1.0, momentum=0.0, fragments=1)
    return c
