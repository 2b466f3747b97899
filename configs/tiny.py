"""Seconds on CPU: for tests and smoke runs."""
from configs import base


def get_config():
    c = base.get_config()
    c.model.update(d_model=32, n_heads=4, n_layers=2, d_ff=64, max_seq_len=32)
    c.data.update(seq_len=32, eval_batches=2)
    c.train.update(steps=12, batch_size=8, microbatches=2, log_every=2, eval_every=6)
    c.optim.update(lr=1e-2, warmup_steps=2)
    c.checkpoint.update(every=4, keep=2)
    return c
