"""The optimizer's data-parallel messages, hop by hop: the ZeRO gradient
reduce-scatter and parameter all-gather of jcomp.gpt.zero over the data axes.

    own, new_res = datahops.reduce_scatter(flats, res, plan, key, bucket_bytes)
    full = datahops.gather(shards, plan, key, bucket_bytes)

`flats` are each device's padded [D*c] buffers, one per parameter leaf; data
rank r = dcn_index * |data| + data_index owns [r*c, (r+1)*c) (`zero`).

One hop (a mesh without 'dcn'): the plan's grad_reduce and param_gather over
'data', as lax's bucketed reduce-scatter / all-gather where the codec is
"none", through jcomp.collectives otherwise.

Two hops (`Plan.data_hops`: ('data', grad_reduce, param_gather) then ('dcn',
grad_reduce_dcn, param_gather_dcn)): the reduce-scatter runs over the fast
'data' factor first, on the buffer reordered [dcn, data, c] -> [data, dcn, c]
so that it scatters the data factor and leaves this device the [|dcn|*c]
piece of its data index; then over 'dcn' on that piece, which so carries
1/|data| of the buffer. The gather runs the other way: over 'dcn' on the [c]
shard, then over 'data', and reorders back. With |data| = 1 (every dcn group
a single data rank) the fast hop sends nothing: it runs as lax's op over the
one device, whatever its codec (it only marks the result invariant there). Each hop runs under its own
message (so the meter keys its bytes by message and axis) with its own codec,
hierarchically also when both hops share one (cc's per-axis codec dict would
merge two equally coded axes into one flat collective). Error feedback keeps
one residual, the lossy hop's: the fast hop's over the whole [D*c] buffer, or
the slow hop's over its [|dcn|*c] piece, kept in the buffer's first entries
(`zero.for_plan` refuses two lossy hops with error feedback).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jcomp import collectives as cc
from jcomp.collectives.buckets import RowView, bucketed
from jcomp.meter.scope import message_scope


def _lax_buckets(flats, send, to_rows, from_rows, bucket_bytes, axis="data"):
    """Uncompressed, the ZeRO buffers travel as a few buckets (as DDP's do) rather
    than a message per leaf: jcomp.collectives sends "none" leaf by leaf, as lax
    does, since the order of a sum over a concatenated buffer is the backend's.
    The optimizer asks for the buckets here, where no gradient flows through them."""
    return bucketed(flats, lambda f: (f, (axis,)), RowView(to_rows, from_rows),
                    lambda buf, axes, key: send(buf), None, bucket_bytes)


def _gather_hop(flats, message, axis, key, bucket_bytes, raw=False):
    """[n] pieces -> [|axis| * n], gathered over one mesh axis with `message`'s
    codec (lax's gather where it is "none" or `raw`), invariant over that axis."""
    codec = message.codec
    with message_scope(message.name):
        if codec.kind == "identity" or raw:
            d = lax.axis_size(axis)
            return _lax_buckets(
                flats, lambda buf: lax.all_gather(buf, axis, axis=0, tiled=True,
                                                  to="invarying"),
                lambda f: f[None], lambda out, f: out.reshape(d * f.shape[0]), bucket_bytes,
                axis)
        return cc.all_gather(flats, axis, tiled=True, to="invarying", codec=codec, key=key,
                             rows="flat", bucket_bytes=bucket_bytes)


def _fold(key, i):
    return None if key is None else jax.random.fold_in(key, i)


def _fast_hop(plan) -> bool:
    """Whether the two-hop plan has a fast hop: none where |data| = 1."""
    return any(axis == "data" for axis, _, _ in plan.data_hops())


def gather(flats, plan, key, bucket_bytes):
    """Each device's [c] master shards -> the [D*c] buffers, gathered over the
    data axes (invariant there): one hop, or the slow one first on the shard,
    then the fast one (see the module doc)."""
    if "dcn" not in plan.data_axes:
        return _gather_hop(flats, plan.param_gather, "data", key, bucket_bytes)
    k, d = lax.axis_size("dcn"), lax.axis_size("data")
    got = _gather_hop(flats, plan.param_gather_dcn, "dcn", _fold(key, 1), bucket_bytes)
    got = _gather_hop(got, plan.param_gather, "data", key, bucket_bytes, raw=not _fast_hop(plan))
    # [data, dcn, c] -> [dcn, data, c]: rank r = dcn_index * |data| + data_index
    return [g.reshape(d, k, -1).swapaxes(0, 1).reshape(-1) for g in got]


def _reduce_hop(flats, res, message, axis, key, bucket_bytes, raw=False):
    """Sums the [|axis| * n] buffers over one mesh axis -> (this device's [n]
    slices, new residuals or None), with `message`'s codec (lax's reduce-scatter
    where it is "none" or `raw`, and there is no residual).

    A reduce-scatter at either ZeRO stage: each rank keeps only its slice of the sum,
    so an all-reduce would send twice the bytes for the same update."""
    kw = dict(scatter_dimension=0, tiled=True, codec=message.codec, key=key, rows="flat",
              bucket_bytes=bucket_bytes)
    with message_scope(message.name):
        if res is None and (message.codec.kind == "identity" or raw):
            d = lax.axis_size(axis)
            return _lax_buckets(
                flats, lambda buf: lax.psum_scatter(buf, axis, scatter_dimension=0, tiled=True),
                lambda f: f.reshape(d, -1), lambda out, f: out.reshape(-1), bucket_bytes,
                axis), None
        if res is not None:
            return cc.psum_scatter_ef(flats, res, axis, **kw)
        return cc.psum_scatter(flats, axis, **kw), None


def reduce_scatter(flats, res, plan, key, bucket_bytes):
    """Sums the [D*c] buffers over the data axes -> (this rank's [c] slices, new
    residuals or None): one hop over 'data', or two (see the module doc)."""
    if "dcn" not in plan.data_axes:
        return _reduce_hop(flats, res, plan.grad_reduce, "data", key, bucket_bytes)
    k, d = lax.axis_size("dcn"), lax.axis_size("data")
    fast, slow = plan.grad_reduce, plan.grad_reduce_dcn
    # the residual goes with the lossy hop, or where there is no fast hop, the slow one
    on_slow = res is not None and (slow.codec.kind != "identity" or not _fast_hop(plan))
    # [dcn, data, c] -> [data, dcn, c]: the fast hop scatters the data factor
    x = [f.reshape(k, d, -1).swapaxes(0, 1).reshape(-1) for f in flats]
    x, new_fast = _reduce_hop(x, None if on_slow else res, fast, "data", key, bucket_bytes,
                              raw=not _fast_hop(plan))
    slow_res = [r[:p.shape[0]] for r, p in zip(res, x)] if on_slow else None
    own, new_slow = _reduce_hop(x, slow_res, slow, "dcn", _fold(key, 1), bucket_bytes)
    if on_slow:  # the slow hop's residual [|dcn|*c] sits in the buffer's first entries
        return own, [jnp.pad(n, (0, r.shape[0] - n.shape[0])) for n, r in zip(new_slow, res)]
    return own, new_fast
