"""A train step in JAX's explicit sharding mode, written from JAX's docs
("Explicit sharding", the training cookbook), shrunk to test size.

- A ('data', 'tensor') mesh of `AxisType.Explicit` axes, set with
  `jax.set_mesh`; every array carries its sharding in its type.
- Parameters in an attribute dict (`params.blocks[i].w_in`), a dict whose
  `__getattr__` reads its keys, registered as a pytree, as the cookbook keeps
  them.
- Megatron tensor parallelism written in the global view: the MLP's first
  kernel split over "tensor" on its output, the second on its input; the
  activations typed with `out_sharding=` on each einsum and `jax.reshard` back
  to the batch layout, naming the batch axis "data".
- The step: `jax.value_and_grad(loss_fn)(params, batch)`, optax AdamW.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

VOCAB, D, F, LAYERS, L, BATCH = 64, 32, 128, 2, 8, 16


@jax.tree_util.register_pytree_with_keys_class
class dot_dict(dict):
    """A dict read as attributes, as the training cookbook keeps its parameters:
    `hasattr(d, "unbox")` raises KeyError, not AttributeError."""
    __getattr__ = dict.__getitem__
    __setattr__ = dict.__setitem__

    def tree_flatten_with_keys(self):
        keys = sorted(self)
        return [(jax.tree_util.DictKey(k), self[k]) for k in keys], keys

    @classmethod
    def tree_unflatten(cls, keys, values):
        return cls(zip(keys, values))


def make_mesh():
    return jax.make_mesh((4, 2), ("data", "tensor"), axis_types=(AxisType.Explicit,) * 2)


def init(seed=0):
    """Parameters laid out on the mesh set with jax.set_mesh."""
    rng = np.random.default_rng(seed)
    put = lambda shape, spec, scale: jax.device_put(
        (rng.standard_normal(shape) * scale).astype(np.float32), spec)
    blocks = [dot_dict(w_in=put((D, F), P(None, "tensor"), D ** -0.5),
                       b_in=put((F,), P("tensor"), 0.0),
                       w_out=put((F, D), P("tensor", None), F ** -0.5),
                       scale=put((D,), P(), 0.0) + 1.0)
              for _ in range(LAYERS)]
    return dot_dict(embed=put((VOCAB, D), P(None, None), 1.0), blocks=blocks,
                    head=put((D, VOCAB), P(None, "tensor"), D ** -0.5))


def _norm(x_BxLxD, scale_D):
    return x_BxLxD * jax.lax.rsqrt(jnp.mean(x_BxLxD ** 2, -1, keepdims=True) + 1e-6) * scale_D


def loss_fn(params, batch):
    """Mean cross entropy of each token's target over the batch."""
    x_BxL, y_BxL = batch["inputs"], batch["targets"]
    x_BxLxD = params.embed.at[x_BxL].get(out_sharding=P("data", None, None))
    for blk in params.blocks:
        h_BxLxD = _norm(x_BxLxD, blk.scale)
        h_BxLxF = jnp.einsum("bld,df->blf", h_BxLxD, blk.w_in,
                             out_sharding=P("data", None, "tensor"))
        h_BxLxF = jax.nn.gelu(h_BxLxF + blk.b_in)
        out_BxLxD = jnp.einsum("blf,fd->bld", h_BxLxF, blk.w_out,
                               out_sharding=P("data", None, None))
        x_BxLxD = x_BxLxD + jax.reshard(out_BxLxD, P("data", None, None))
    logits_BxLxV = jnp.einsum("bld,dv->blv", x_BxLxD, params.head,
                              out_sharding=P("data", None, "tensor"))
    logp_BxLxV = jax.nn.log_softmax(jax.reshard(logits_BxLxV, P("data", None, None)))
    picked_BxL = jnp.take_along_axis(logp_BxLxV, y_BxL[..., None], -1)[..., 0]
    return -jnp.mean(picked_BxL)


def batches(n, seed=0):
    """Each target a fixed function of its input token, so the model (no attention)
    can learn it."""
    rng = np.random.default_rng(seed + 1)
    for _ in range(n):
        x = rng.integers(0, VOCAB, (BATCH, L)).astype(np.int32)
        y = (3 * x + 1) % VOCAB
        yield {"inputs": jax.device_put(x, P("data", None)),
               "targets": jax.device_put(y, P("data", None))}


def plain_grads_of(params, batch):
    return jax.value_and_grad(loss_fn)(params, batch)


def make_step(grads_of, tx):
    """The step; `grads_of` is its one gradient line."""
    @jax.jit
    def step(params, opt_state, batch):
        loss, grads = grads_of(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss
    return step


def optimizer():
    return optax.adamw(3e-3, weight_decay=0.01)
