"""The gradient reductions and parameter gathers of `cc.value_and_grad` and
`cc.gather_params`, inside a map manual over the batch axes: leaves grouped by
the axes they travel over, so one collective carries many leaves (flat buckets
on block boundaries, `rows="flat"`) and no leaf's scale is set by another's."""
from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp

from jcomp.collectives import arguments, hops, ops
from jcomp.collectives.jit import specs as jitspecs


def groups(plans):
    """Leaf indices grouped by plan, in a fixed order (so leaves of one plan share
    buckets, one collective per dtype and bucket)."""
    out = {}
    for i, plan in enumerate(plans):
        out.setdefault(plan, []).append(i)
    return sorted(out.items(), key=lambda kv: repr(kv[0]))


def _along(leaves, dims, send):
    """send(leaves with `dims` moved first) -> results moved back: leaves split on
    different dimensions share one call (and its buckets)."""
    moved = [jnp.moveaxis(x, d, 0) for x, d in zip(leaves, dims)]
    return [jnp.moveaxis(x, 0, d) for x, d in zip(send(moved), dims)]


def _codec_over(codec, axes):
    """The codec a call over `axes` sends with: `codec` itself, or for a codec per
    axis the one its axes share (a reduce-scatter or gather over axes with
    different codecs is one collective and cannot mix them)."""
    if not isinstance(codec, Mapping):
        return codec
    named = {str(c): c for c in (arguments.parse(codec.get(a, arguments.NONE)) for a in axes)}
    if len(named) > 1:
        raise ValueError(f"codec {dict(codec)}: parameters split over {axes} together are "
                         "gathered and reduce-scattered in one collective over those axes, "
                         "so give them one codec")
    return named.popitem()[1]


def _in_f32(send, codec, pad=False):
    """send(leaves) with narrow float leaves (bf16, fp16) widened to float32 for a
    lossy codec and narrowed back: the codes and scales on the wire are the same,
    the sum is float32 either way, and leaves of both dtypes share buckets (one
    collective, not one per dtype). With `pad` (flat reductions), a leaf that a
    block codec's block does not divide is padded with zeros to whole blocks where
    that still sends no more than the leaf raw, so it joins the others' bucket
    instead of a bucket of its own; its blocks stay its own. "none" sends each
    leaf as it is."""
    if isinstance(codec, Mapping):  # per hop: hops.psum lays the leaves out itself
        return send
    c = arguments.parse(codec)
    if c.kind == "identity":
        return send
    g = c.row_multiple if c.kind == "dense" and pad else 1

    def wide(leaves):
        ready, padded = [], []
        for x in leaves:
            narrow = jnp.issubdtype(x.dtype, jnp.floating) and x.dtype.itemsize < 4
            y = x.astype(jnp.float32) if narrow else x
            n, m = x.size, -(-x.size // g) * g
            pad = m != n and c.wire_bytes((1, m), jnp.float32) <= n * x.dtype.itemsize
            ready.append(jnp.pad(y.reshape(-1), (0, m - n)) if pad else y)
            padded.append(pad)
        return [(y[:x.size].reshape(x.shape) if pad else y).astype(x.dtype)
                for x, y, pad in zip(leaves, send(ready), padded)]

    return wide


def gather(shards, specs, data_axes, codec, key, rows, bucket):
    """Each leaf whole over the batch axes: gathered along the dimensions its spec
    splits over them (FSDP), with `codec`; leaves gathered over the same axes
    share buckets."""
    out = list(shards)
    splits = [jitspecs.split_dims(s, data_axes) for s in specs]
    for g, (plan, idx) in enumerate(groups([tuple(a for _, a in sp) for sp in splits])):
        part = [shards[i] for i in idx]
        for step in reversed(range(len(plan))):
            k = None if key is None else jax.random.fold_in(key, 4 * g + step)
            c = _codec_over(codec, plan[step])
            part = _along(part, [splits[i][step][0] for i in idx], _in_f32(
                lambda ls: ops.all_gather(ls, plan[step], axis=0, tiled=True, to="invarying",
                                          codec=c, key=k, rows=rows, **bucket), c))
        for i, x in zip(idx, part):
            out[i] = x
    return out


def reduce(grads, outs, data_axes, codec, key, rows, bucket):
    """Each gradient summed over the batch axes and laid out as its `outs` spec:
    reduce-scattered along the dimensions the spec splits over batch axes, then
    all-reduced over the batch axes it does not use (on the scattered piece).
    Leaves reduced over the same axes share buckets."""
    out = list(grads)
    splits = [jitspecs.split_dims(o, data_axes) for o in outs]
    plans = []
    for sp in splits:
        used = {a for _, axes in sp for a in axes}
        plans.append((tuple(a for _, a in sp), tuple(a for a in data_axes if a not in used)))
    for g, ((scattered, left), idx) in enumerate(groups(plans)):
        part = [grads[i] for i in idx]
        for step, axes in enumerate(scattered):
            k = None if key is None else jax.random.fold_in(key, 4 * g + step)
            c = _codec_over(codec, axes)
            part = _along(part, [splits[i][step][0] for i in idx], _in_f32(
                lambda ls: ops.psum_scatter(ls, axes, scatter_dimension=0, tiled=True,
                                            codec=c, key=k, rows=rows, **bucket), c))
        if left:
            k = None if key is None else jax.random.fold_in(key, 4 * g + 3)
            c = ({a: v for a, v in codec.items() if a in left} if isinstance(codec, Mapping)
                 else codec)
            psum = hops.psum if isinstance(c, Mapping) else ops.psum  # a codec per hop
            part = _in_f32(lambda ls: psum(ls, left, codec=c, key=k, rows=rows, **bucket),
                           c, pad=rows == "flat")(part)
        for i, x in zip(idx, part):
            out[i] = x
    return out
