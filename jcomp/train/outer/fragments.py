"""Streaming DiLoCo's fragments: contiguous blocks of transformer layers.

The model's layer parameters are stacked along a leading layer dimension
(`jcomp.gpt.model`), so a fragment is a slice [a, b) of that dimension of every
layer leaf, not a set of leaves. The blocks are cut where the bytes are
balanced (`blocks`): every fragment gets at least one layer, each further layer
goes to the lightest fragment, counting the token embedding in the first and
the final norm (and an untied head) in the last. So the fragments' bytes
differ by at most one layer's where the embedding and head are smaller than a
fragment's share. The
embedding goes with the first fragment (the input end), the final norm and
the head with the last (the output end), as their neighbours in depth.

With one fragment every leaf is whole: the sync is DiLoCo's, on the ZeRO
master's layout as it is stored. A slice of a layer leaf is synced in the
parameters' own layout: the master's [d, t', p', c] shards are gathered over
'data' inside each island (raw, fast), sliced, synced, and put back
(`to_param`, `to_zero`): only the slice crosses between islands.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from jcomp.gpt import zero

LAYERS = "layers"   # the params' subtree of stacked layer leaves
LAST = ("final_ln", "head")  # go with the last fragment; everything else with the first


@dataclasses.dataclass(frozen=True)
class Part:
    """What of master leaf `leaf` (tree order) a fragment syncs: the layers
    [a, b) of a stacked layer leaf, or the whole leaf (layers None)."""

    leaf: int
    layers: tuple[int, int] | None = None


def blocks(first: int, layer: int, last: int, n_layers: int, n: int) -> list[tuple[int, int]]:
    """n contiguous blocks [a, b) of n_layers layers of `layer` bytes each, the
    first block also carrying `first` bytes and the last `last`: every block
    starts with one layer and each further layer goes to the lightest block
    (the lower index on a tie), so the blocks' bytes differ by at most one
    layer's wherever `first` and `last` allow. ValueError if n > n_layers."""
    if n > n_layers:
        raise ValueError(f"outer.fragments={n}: the model has only {n_layers} layers and a "
                         f"fragment is a block of whole layers; allowed: 1 to {n_layers}")
    counts = [1] * n
    extra = [first] + [0] * (n - 2) + [last] if n > 1 else [first + last]
    for _ in range(n_layers - n):
        g = min(range(n), key=lambda f: (extra[f] + counts[f] * layer, f))
        counts[g] += 1
    ends = [sum(counts[:f + 1]) for f in range(n)]
    return [(e - c, e) for e, c in zip(ends, counts)]


def _name(path) -> str:
    return str(getattr(path[0], "key", getattr(path[0], "name", path[0])))


def plan(param_shapes, n: int) -> list[list[Part]]:
    """The parts of every fragment, `n` of them (params' shapes: a tree of arrays
    or ShapeDtypeStructs, layer leaves stacked under "layers")."""
    named = jax.tree_util.tree_flatten_with_path(param_shapes)[0]
    if n == 1:
        return [[Part(i) for i in range(len(named))]]
    nbytes = [math.prod(a.shape) * jnp.dtype(a.dtype).itemsize for _, a in named]
    layer_ids = [i for i, (p, _) in enumerate(named) if _name(p) == LAYERS]
    last_ids = [i for i, (p, _) in enumerate(named) if _name(p) in LAST]
    first_ids = [i for i in range(len(named)) if i not in layer_ids and i not in last_ids]
    n_layers = named[layer_ids[0]][1].shape[0]
    cut = blocks(sum(nbytes[i] for i in first_ids), sum(nbytes[i] for i in layer_ids) // n_layers,
                 sum(nbytes[i] for i in last_ids), n_layers, n)
    out = [[Part(i, ab) for i in layer_ids] for ab in cut]
    out[0] = [Part(i) for i in first_ids] + out[0]
    out[-1] = out[-1] + [Part(i) for i in last_ids]
    return out


def part_bytes(param_shapes, parts: list[Part]) -> int:
    """A fragment's bytes in the parameters' dtypes."""
    leaves = jax.tree.leaves(param_shapes)
    total = 0
    for part in parts:
        a = leaves[part.leaf]
        n = math.prod(a.shape)
        if part.layers is not None:
            n = n // a.shape[0] * (part.layers[1] - part.layers[0])
        total += n * jnp.dtype(a.dtype).itemsize
    return total


def slice_spec(spec: P, layers: int, sizes: dict) -> P:
    """A layer leaf's PartitionSpec for a slice of `layers` layers: the layer
    dimension stays split only where its devices divide the slice."""
    entries = list(spec) + [None] * (1 - len(spec))
    first = entries[0]
    axes = () if first is None else first if isinstance(first, tuple) else (first,)
    if layers % math.prod(sizes[a] for a in axes):
        entries[0] = None
    return P(*entries)


def to_param(m, pspec, zspec, shape, mesh, island_axis=None):
    """A master-layout leaf ([I,] d, t', p', c) -> float32 in the parameter's
    layout ([I,] *shape), gathered raw over 'data' inside each island."""
    local = zero._local_shape(shape, pspec, dict(mesh.shape))
    lead = (island_axis,) if island_axis else ()

    def body(x):
        x = x[0] if island_axis else x
        full = lax.all_gather(x.reshape(-1), "data", axis=0, tiled=True, to="invarying")
        out = full[:math.prod(local)].reshape(local)
        return out[None] if island_axis else out
    return jax.shard_map(body, mesh=mesh, in_specs=P(*lead, *zspec),
                         out_specs=P(*lead, *pspec))(m)


def to_zero(x, pspec, zspec, multiple, mesh, island_axis=None):
    """The inverse of `to_param`: each data rank keeps its own float32 slice."""
    lead = (island_axis,) if island_axis else ()

    def body(v):
        v = v[0] if island_axis else v
        own = zero._own_slice(v, multiple, ("data",))
        return own[None] if island_axis else own
    return jax.shard_map(body, mesh=mesh, in_specs=P(*lead, *pspec),
                         out_specs=P(*lead, *zspec))(x)


def due(done: int, outer) -> list[int]:
    """The fragments whose sync runs (with outer.delay > 0: starts) after inner
    step `done` (1-based)."""
    if outer is None or done < 1:
        return []
    stride = outer.every // outer.fragments
    r = done % outer.every
    return [r // stride] if r % stride == 0 else []


def applied(done: int, outer) -> list[int]:
    """The fragments whose result is merged into the islands after inner step
    `done`: those whose sync started outer.delay steps before (none without a delay)."""
    if outer is None or not outer.delay:
        return []
    return due(done - outer.delay, outer)
