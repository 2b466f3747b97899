"""A train step shaped as JAX's training cookbook writes one
(docs/the-training-cookbook.py), with Megatron tensor parallelism and RMSNorm
scales added, shrunk to test size.

- A ('data', 'tensor') mesh of `AxisType.Explicit` axes, set with `jax.set_mesh`.
- Parameters in an attribute dict (`params.layers[i].attention.qkv`), created
  with their shardings; a learned position table added to the embedding.
- `out_sharding=` on every einsum; the embedding read with
  `.at[ids].get(out_sharding=...)`; `jax.nn.dot_product_attention`; RMSNorm
  scales multiplied into the batch's activations; the batch placed with
  `jax.sharding.reshard`.
- The step: `jax.value_and_grad(loss_fn)(params, batch)`, optax AdamW, as
  explicit_step.py's (`make_step`, `optimizer`).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from tests.collectives.explicit_step import make_step, optimizer  # noqa: F401  (the same step)

VOCAB, D, HEADS, HEAD_DIM, F, LAYERS, L, BATCH = 64, 64, 4, 16, 256, 2, 8, 16

# Megatron layout on "tensor": heads and MLP hidden units split; the batch on "data".
QKV = P(None, None, "tensor", None)        # [3, D, H, K]
ATT_OUT = P("tensor", None, None)          # [H, K, D]
MLP_IN = P(None, "tensor")                 # [D, F]
MLP_OUT = P("tensor", None)                # [F, D]
OUT_KERNEL = P(None, "tensor")             # [D, V]
ACT_SEQ = P("data", None, None)            # [B, L, D]
ACT_ATT = P("data", None, None, "tensor", None)   # [B, L, 3, H, K]
ACT_HIDDEN = P("data", None, "tensor")     # [B, L, F]
ACT_LOGITS = P("data", None, "tensor")     # [B, L, V]


@jax.tree_util.register_pytree_with_keys_class
class dot_dict(dict):
    """A dict read as attributes, as the cookbook keeps its parameters."""
    __setattr__ = dict.__setitem__
    __getattr__ = dict.__getitem__

    def tree_flatten_with_keys(self):
        keys = tuple(sorted(self))
        return tuple((jax.tree_util.DictKey(k), self[k]) for k in keys), keys

    @classmethod
    def tree_unflatten(cls, keys, values):
        return cls(zip(keys, values))


def make_mesh():
    return jax.make_mesh((4, 2), ("data", "tensor"), axis_types=(AxisType.Explicit,) * 2)


def init(seed=0):
    """Parameters laid out on the mesh set with jax.set_mesh (18 leaves)."""
    rng = np.random.default_rng(seed)
    put = lambda shape, spec, scale: jax.device_put(
        (rng.standard_normal(shape) * scale).astype(np.float32), spec)
    params = dot_dict(pos_embed=put((L, D), P(None, None), 0.02),
                      embedding=put((VOCAB, D), P(None, None), 1.0),
                      linear_out=dot_dict(kernel=put((D, VOCAB), OUT_KERNEL, D ** -0.5)),
                      final_scale=put((D,), P(None), 0.0) + 1.0,
                      layers=dot_dict())
    for i in range(LAYERS):
        params.layers[i] = dot_dict(
            attention=dot_dict(qkv=put((3, D, HEADS, HEAD_DIM), QKV, D ** -0.5),
                               out=put((HEADS, HEAD_DIM, D), ATT_OUT, D ** -0.5)),
            mlp=dot_dict(in_kernel=put((D, F), MLP_IN, D ** -0.5),
                         out_kernel=put((F, D), MLP_OUT, F ** -0.5)),
            att_scale=put((D,), P(None), 0.0) + 1.0,
            mlp_scale=put((D,), P(None), 0.0) + 1.0)
    return params


def _rms_norm(x_BxLxD, scale_D):
    return x_BxLxD * jax.lax.rsqrt(jnp.mean(x_BxLxD ** 2, -1, keepdims=True) + 1e-6) * scale_D


def model_apply(params, ids_BxL):
    x_BxLxD = params.embedding.at[ids_BxL].get(out_sharding=ACT_SEQ)
    x_BxLxD += params.pos_embed
    for i in range(LAYERS):
        blk = params.layers[i]
        h_BxLxD = _rms_norm(x_BxLxD, blk.att_scale)
        qkv_BxLx3xHxK = jnp.einsum("bld,tdhk->blthk", h_BxLxD, blk.attention.qkv,
                                   out_sharding=ACT_ATT)
        att_BxLxHxK = jax.nn.dot_product_attention(
            qkv_BxLx3xHxK[:, :, 0], qkv_BxLx3xHxK[:, :, 1], qkv_BxLx3xHxK[:, :, 2],
            is_causal=True)
        x_BxLxD += jnp.einsum("blhk,hkd->bld", att_BxLxHxK, blk.attention.out,
                              out_sharding=ACT_SEQ)
        h_BxLxD = _rms_norm(x_BxLxD, blk.mlp_scale)
        h_BxLxF = jax.nn.gelu(jnp.einsum("bld,df->blf", h_BxLxD, blk.mlp.in_kernel,
                                         out_sharding=ACT_HIDDEN))
        x_BxLxD += jnp.einsum("blf,fd->bld", h_BxLxF, blk.mlp.out_kernel, out_sharding=ACT_SEQ)
    x_BxLxD = _rms_norm(x_BxLxD, params.final_scale)
    return jnp.einsum("bld,dv->blv", x_BxLxD, params.linear_out.kernel, out_sharding=ACT_LOGITS)


def loss_fn(params, batch):
    """Mean cross entropy over every token (the cookbook's one-hot form)."""
    logits_BxLxV = model_apply(params, batch["observed_ids"])
    labels_BxLxV = jax.nn.one_hot(batch["target_ids"], VOCAB)
    return -(labels_BxLxV * jax.nn.log_softmax(logits_BxLxV)).sum(-1).mean()


def batches(n, seed=0):
    """Each target a fixed function of the tokens before it, learnable by attention."""
    rng = np.random.default_rng(seed + 1)
    for _ in range(n):
        x = rng.integers(0, VOCAB, (BATCH, L)).astype(np.int32)
        y = (x + np.roll(x, 1, axis=1)) % VOCAB
        batch = {"observed_ids": jnp.asarray(x), "target_ids": jnp.asarray(y)}
        yield jax.sharding.reshard(batch, P("data", None))


def plain_grads_of(params, batch):
    return jax.value_and_grad(loss_fn)(params, batch)


