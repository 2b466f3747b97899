"""GPT-NeoX-20B's shapes (44 layers, d_model 6144, 64 heads, 50432 vocab, 2048
context) on the CCGrid 2024 paper's layout, for planning and projection only:
it does not fit on one machine. `experiments/projection.py` reads it."""
from configs import base


def get_config():
    c = base.get_config()
    c.model.update(vocab_size=50432, d_model=6144, n_heads=64, n_layers=44, d_ff=24576,
                   max_seq_len=2048, tie_embeddings=False, dtype="bfloat16")
    c.data.update(seq_len=2048)
    c.mesh.update(data=-1, tensor=4, pipeline=4)
    c.train.update(batch_size=1536, microbatches=16, remat=True)
    c.compression.policy = "hybrid"
    return c
