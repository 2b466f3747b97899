"""A Flax NNX train step written from Flax's guide "Scale up on multiple devices"
(docs_nnx/guides/flax_gspmd.md, flax 0.12), shrunk to test size, with dropout.

- A ('data', 'tensor') mesh of Auto axes (4 x 2 here), the model built under
  `jax.set_mesh(mesh)`: flax 0.12 shards Variables as it creates them
  ("eager sharding"), so an annotated model needs the mesh context.
- Kernels annotated with `nnx.with_partitioning` (Megatron-style: the up
  projection split over "tensor" on its output, the down projection on its
  input), the MLP's activation constrained to P('data', 'tensor') as the
  guide's DotReluDot does, `nnx.Dropout` after each block.
- `nnx.Optimizer(model, optax.adamw(...), wrt=nnx.Param)` and a `jax.jit` step
  that takes the model and the optimizer as arguments and returns them, as the
  guide's `train_step` does.
- The gradient is taken over the parameters split off the model
  (`nnx.split(model, nnx.Param, ...)`): the loss merges them back and calls the
  model with this step's dropout key, `rngs=nnx.Rngs(dropout=rank_key(key))`.
  `rank_key` is the key itself in the plain step and the key with the data
  rank folded in inside `cc.value_and_grad`, so each rank draws its own masks.

The plain step's gradient line is `jax.value_and_grad(loss_fn)(params, batch)`;
jcomp's is `cc.value_and_grad(loss_fn, mesh=mesh, mean_over="examples",
codec=codec)(params, batch)`, parameter specs read from the Params' metadata.
"""
from __future__ import annotations

import jax
import numpy as np
import optax
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jcomp import collectives as cc
from jcomp.collectives.jit.rank import rank_key

VOCAB, D, F, LAYERS, L, BATCH = 64, 32, 64, 2, 8, 32

_kernel = nnx.initializers.lecun_normal()


class Block(nnx.Module):
    """Pre-norm MLP block: the guide's DotReluDot with a residual and dropout."""

    def __init__(self, dropout: float, rngs: nnx.Rngs):
        self.norm = nnx.LayerNorm(D, rngs=rngs)
        self.up = nnx.Linear(
            D, F, kernel_init=nnx.with_partitioning(_kernel, (None, "tensor")),
            bias_init=nnx.with_partitioning(nnx.initializers.zeros_init(), ("tensor",)),
            rngs=rngs)
        self.down = nnx.Linear(F, D, kernel_init=nnx.with_partitioning(_kernel, ("tensor", None)),
                               rngs=rngs)
        self.drop = nnx.Dropout(dropout, rngs=rngs)

    def __call__(self, x, rngs=None):
        h = nnx.gelu(self.up(self.norm(x)))
        h = jax.lax.with_sharding_constraint(h, P("data", None, "tensor"))
        return x + self.drop(self.down(h), rngs=rngs)


class Model(nnx.Module):
    """Token embedding, LAYERS blocks, a vocabulary head split over "tensor"."""

    def __init__(self, dropout: float, rngs: nnx.Rngs):
        self.embed = nnx.Embed(VOCAB, D, embedding_init=nnx.with_partitioning(
            nnx.initializers.normal(0.02), (None, "tensor")), rngs=rngs)
        self.blocks = nnx.List([Block(dropout, rngs) for _ in range(LAYERS)])
        self.head = nnx.Linear(D, VOCAB, kernel_init=nnx.with_partitioning(
            _kernel, (None, "tensor")), rngs=rngs)

    def __call__(self, x, rngs=None):
        h = self.embed(x)
        for block in self.blocks:
            h = block(h, rngs=rngs)
        return self.head(h)


def make_mesh():
    return jax.make_mesh((4, 2), ("data", "tensor"), axis_types=(AxisType.Auto,) * 2)


def init(mesh, dropout=0.1, seed=0, lr=1e-2):
    """-> (model, optimizer), created under the mesh (eager sharding)."""
    with jax.set_mesh(mesh):
        model = Model(dropout, nnx.Rngs(params=seed, dropout=seed + 1))
        optimizer = nnx.Optimizer(model, optax.adamw(lr, weight_decay=0.01), wrt=nnx.Param)
    return model, optimizer


def batches(mesh, steps, seed=0):
    """Token rows whose targets are a fixed permutation of the inputs (learnable
    in a few steps), split over "data"."""
    perm = np.random.default_rng(1234).permutation(VOCAB).astype(np.int32)
    rng = np.random.default_rng(seed)
    where = NamedSharding(mesh, P("data"))
    for _ in range(steps):
        x = rng.integers(0, VOCAB, (BATCH, L)).astype(np.int32)
        yield {"x": jax.device_put(x, where), "y": jax.device_put(perm[x], where)}


def loss_of(graphdef, rest, key):
    """The loss over the parameters split off the model; `key` this step's dropout
    key (per data rank inside cc.value_and_grad, by rank_key)."""
    def loss_fn(params, batch):
        model = nnx.merge(graphdef, params, rest)
        logits = model(batch["x"], rngs=nnx.Rngs(dropout=rank_key(key)))
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
    return loss_fn


def plain_line(loss_fn):
    return jax.value_and_grad(loss_fn)


def jcomp_line(mesh, codec):
    return lambda loss_fn: cc.value_and_grad(loss_fn, mesh=mesh, mean_over="examples",
                                             codec=codec)


def make_train_step(grads_of):
    """The guide's train_step; grads_of(loss_fn) is its one gradient line
    (plain_line or jcomp_line(mesh, codec)). -> jitted step(model, optimizer,
    batch, key) -> (model, optimizer, loss, grads)."""
    def train_step(model, optimizer, batch, key):
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        loss, grads = grads_of(loss_of(graphdef, rest, key))(params, batch)
        optimizer.update(model, grads)
        return model, optimizer, loss, grads
    return jax.jit(train_step)
