"""A random key per data rank, for dropout and other draws in a loss function
that `cc.value_and_grad` runs once per rank.

`cc.value_and_grad` runs the user's `loss_fn` on each data rank's share of the
batch, in a map manual over the batch axes. A key the loss closes over is the
same on every rank there, so each rank would draw the same dropout mask for its
own examples (the plain step draws one mask over the whole batch). `rank_key`
folds the rank's index into the key, inside that map only, so one loss
function serves both steps:

    def loss_fn(params, batch):
        model = nnx.merge(graphdef, params, rest)
        logits = model(batch["x"], rngs=nnx.Rngs(dropout=rank_key(key)))
        ...

It imports only jax.
"""
from __future__ import annotations

import jax
from jax import lax

__all__ = ["rank_key"]


def rank_key(key, axes="data"):
    """`key` with this data rank's index folded in, inside `cc.value_and_grad`'s
    per-rank map; `key` itself outside any such map (a plain `jax.jit` step).

    key: a PRNG key, typed (`jax.random.key`, shape ()) or raw (`PRNGKey`,
    uint32[2]); the result has its type and shape.
    axes: a mesh axis name or a tuple of them, the batch axes the key varies
    over: those `cc.value_and_grad` was given as `data_axes` (default "data").
    Inside the map the result is `jax.random.fold_in(key, i)` with `i` the rank's
    linear index over `axes`, row-major in the order given (for ("data", "fsdp")
    of sizes 2 and 4, i = 4 * data + fsdp), so it differs between ranks of those
    axes and is the same across the other mesh axes (tensor-parallel devices of
    one rank draw one mask, as the model's layers expect). Outside a map manual
    over `axes` (no map, or a map manual over none of them) it returns `key`
    unchanged, so the plain step draws as it always did (and so does any route
    of `cc.value_and_grad` that runs the loss on the whole batch, with no axis
    manual).

    The ranks' masks are not slices of the plain step's mask, so with dropout on
    the gradients are another draw than the plain step's, of the same
    distribution. Raises ValueError inside a map manual over some of `axes` but
    not all (a key varying over part of the batch axes only)."""
    axes = (axes,) if isinstance(axes, str) else tuple(axes)
    if not axes:
        raise ValueError("rank_key: axes names no axis; give the batch axes (data_axes)")
    manual = set(jax.sharding.get_abstract_mesh().manual_axes)
    hit = [a for a in axes if a in manual]
    if not hit:
        return key
    if len(hit) != len(axes):
        missing = [a for a in axes if a not in manual]
        raise ValueError(f"rank_key: the axes {missing} are not manual in this map (manual "
                         f"axes: {sorted(manual)}); name the axes the batch is split over, "
                         "as in value_and_grad's data_axes")
    return jax.random.fold_in(key, lax.axis_index(axes if len(axes) > 1 else axes[0]))
