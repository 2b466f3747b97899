"""The reduce-scatter and the all-gather hop by hop, and the collectives with a
codec per mesh axis: raw over the fast hops, coded over the slow one.

    cc.psum_scatter(x, ("dcn", "ici"), tiled=True, codec={"dcn": "int8"})

codes only what crosses "dcn" (the slow link between nodes or slices; axes the
dict does not name travel raw): lax's reduce-scatter over "ici" first, then the
coded one over "dcn" on the 1/|ici| piece left, each device ending with lax's
block; `all_gather` runs the other way. The all-reduce with a codec per axis
(`psum`, `pmean`, `psum_ef`, `per_axis`) is jcomp.collectives.hopsum's,
re-exported here.

The reduce-scatter and the all-gather hop by hop are one function each,
`reduce_scatter_hops` and `all_gather_hops`: a list of leaves and the hops
(`Hop`: axes, codec, backward codec, key, message, dimension) in the order
they run, each hop under its own message (the meter keys bytes by it) with
its own codec, also where two hops share one, a raw hop as lax's op on the
leaves in a few buckets, and error feedback on one hop (`ef_hop`).
`psum_scatter` and `all_gather` with a codec per axis run them leaf by leaf
(the raw axes as one hop, then one per run of axes that share a codec; they
keep lax's blocks and lay out no rows); the ZeRO optimizer (jcomp.gpt.zero)
runs its gradient reduce-scatter and parameter gather over ('dcn', 'data')
through them, on all its flat buffers at once.
"""
from __future__ import annotations

import contextlib
from typing import Any, NamedTuple

import jax
import numpy as np
import jax.numpy as jnp
from jax import lax

from jcomp.collectives import arguments, cpu, feedback, ops
from jcomp.collectives.buckets import DEFAULT_BUCKET_BYTES, RowView, bucketed
from jcomp.collectives.hopsum import _split
from jcomp.collectives.hopsum import per_axis, pmean, psum, psum_ef  # noqa: F401
from jcomp.meter.scope import message_scope

__all__ = ["psum", "pmean", "psum_scatter", "all_gather", "psum_ef", "per_axis", "Hop",
           "reduce_scatter_hops", "all_gather_hops"]


def _factors(x, dim, axes):
    """x with `dim` split into one factor per axis (in the axes' order) and the
    block: -> (x_F1x..xFkxB.., the first factor's position)."""
    sizes = [lax.axis_size(a) for a in axes]
    shape = list(x.shape)
    block = shape[dim] // int(np.prod(sizes))  # 1 untiled: that dimension goes
    return x.reshape(shape[:dim] + sizes + [block] + shape[dim + 1:]), dim


class Hop(NamedTuple):
    """One hop of `reduce_scatter_hops` and `all_gather_hops`: the mesh axis (or
    axes) it runs over, its codec and the backward's (None: the same; both
    "none": lax's op on the leaves in a few buckets), its key, the message the
    meter files its bytes under (`jcomp.meter.scope.message_scope`; None: the
    caller's scope), and the dimension it scatters or gathers, tiled."""

    axes: Any
    codec: Any = arguments.NONE
    bwd_codec: Any = None
    key: Any = None
    message: str | None = None
    dim: int = 0

    def raw(self) -> bool:
        bwd = self.codec if self.bwd_codec is None else self.bwd_codec
        return all(arguments.parse(c).kind == "identity" for c in (self.codec, bwd))


def _lax_buckets(leaves, hop, send, view, bucket_bytes, vary=False):
    """lax's op, send(buffer), on the leaves in a few flat buckets (as DDP's are)
    rather than one message per leaf; a caller that wants lax's op leaf by leaf
    passes one leaf. A raw sum is element by element, whatever the buffer."""
    axes = arguments.axes_of(hop.axes)
    prepare = lambda f: (arguments.vary(f, axes) if vary else f, axes)
    return bucketed(leaves, prepare, view, lambda buf, group, key: send(buf), None, bucket_bytes)


def reduce_scatter_hops(leaves, hops, *, residual=None, ef_hop=None, rows="independent",
                        bucket_bytes=DEFAULT_BUCKET_BYTES):
    """The reduce-scatter hop by hop of the list `leaves`: hop j sums what the hops
    before it left over its axes and hands each device its 1/n_j of dimension
    `hop.dim` (tiled), so the next hop carries 1/n_j of what it did. -> (the
    leaves' pieces, the new residuals or None). Each hop sends under its own
    message with its own codec, also where two hops share one; a raw hop is
    lax's op on the leaves in buckets. Hop `ef_hop` sends with error feedback
    (`psum_scatter_ef`): `residual` has a leaf for each of its input's."""
    out, new_res = list(leaves), None
    for j, hop in enumerate(hops):
        n, dim = lax.axis_size(hop.axes), hop.dim
        kw = dict(scatter_dimension=dim, tiled=True, codec=hop.codec, key=hop.key, rows=rows,
                  bucket_bytes=bucket_bytes)
        with contextlib.nullcontext() if hop.message is None else message_scope(hop.message):
            if j == ef_hop:
                out, new_res = feedback.psum_scatter_ef(out, residual, hop.axes, **kw)
            elif not hop.raw():
                out = ops.psum_scatter(out, hop.axes, bwd_codec=hop.bwd_codec, **kw)
            else:  # a leaf's n pieces along `dim` as its rows, one per device
                out = _lax_buckets(
                    out, hop, lambda buf: lax.psum_scatter(buf, hop.axes, scatter_dimension=0,
                                                           tiled=True),
                    RowView(lambda f: jnp.moveaxis(f, dim, 0).reshape(n, -1),
                            lambda o, f: jnp.moveaxis(o.reshape(
                                (f.shape[dim] // n,) + f.shape[:dim] + f.shape[dim + 1:]), 0, dim)),
                    bucket_bytes, vary=True)
    return out, new_res


def all_gather_hops(leaves, hops, *, to="varying", rows="independent",
                    bucket_bytes=DEFAULT_BUCKET_BYTES):
    """The all-gather hop by hop of the list `leaves`: hop j gathers what the hops
    before it gathered over its axes, n_j pieces along dimension `hop.dim`
    (tiled), the inverse of `reduce_scatter_hops` over the hops reversed.
    Codecs, messages and buckets as there."""
    out = list(leaves)
    for hop in hops:
        n, dim = lax.axis_size(hop.axes), hop.dim
        with contextlib.nullcontext() if hop.message is None else message_scope(hop.message):
            if hop.raw():
                out = _lax_buckets(
                    out, hop, lambda buf: lax.all_gather(buf, hop.axes, axis=0, tiled=True, to=to),
                    RowView(lambda f: f.reshape(-1)[None], lambda o, f: arguments.stack_along(
                        o.reshape((n,) + f.shape), dim, True)), bucket_bytes)
            else:
                out = ops.all_gather(out, hop.axes, axis=dim, tiled=True, to=to, codec=hop.codec,
                                     bwd_codec=hop.bwd_codec, key=hop.key, rows=rows,
                                     bucket_bytes=bucket_bytes)
    return out


def _run_hops(raw, runs, key):
    """The hops of a codec per axis: the raw axes' (one hop), then each run's, the
    j-th run's key folded with j."""
    return ([Hop(raw)] if raw else []) + [
        Hop(g if len(g) > 1 else g[0], fc, bc, None if key is None else jax.random.fold_in(key, j))
        for j, (fc, bc, g) in enumerate(runs)]


def psum_scatter(x, axis_name, *, scatter_dimension=0, axis_index_groups=None, tiled=False,
                 codec="none", bwd_codec=None, key=None, rows="independent",
                 bucket_bytes=DEFAULT_BUCKET_BYTES):
    """`jax.lax.psum_scatter` with a codec per axis (a dict): lax's reduce-scatter
    over the raw axes first, then the coded reduce-scatter over the coded axes on
    what is left (`reduce_scatter_hops`, leaf by leaf), each device ending with
    lax's block. A single codec is `ops.psum_scatter`."""
    axes = arguments.axes_of(axis_name)
    plan = _split(codec, bwd_codec, axes)
    if plan is None:
        return ops.psum_scatter(x, axis_name, scatter_dimension=scatter_dimension,
                                axis_index_groups=axis_index_groups, tiled=tiled, codec=codec,
                                bwd_codec=bwd_codec, key=key, rows=rows,
                                bucket_bytes=bucket_bytes)
    raw, runs = plan
    if not runs:
        return ops.psum_scatter(x, axis_name, scatter_dimension=scatter_dimension,
                                axis_index_groups=axis_index_groups, tiled=tiled)
    if axis_index_groups is not None:
        raise ValueError("axis_index_groups is not supported with a codec per axis")
    arguments.dims_of(x, scatter_dimension, "scatter_dimension", "psum_scatter")
    cpu.check_scheduler(f"psum_scatter over {axes} hop by hop")
    order = list(raw) + [a for _, _, g in runs for a in g]

    def one(leaf, k):
        dim = scatter_dimension % leaf.ndim
        n = lax.axis_size(axes)
        if (leaf.shape[dim] % n) if tiled else leaf.shape[dim] != n:
            raise ValueError(f"psum_scatter: dimension {dim} of size {leaf.shape[dim]} must be "
                             f"{'divisible by' if tiled else 'equal to'} the {n} devices over "
                             f"{axes}")
        f, at = _factors(leaf, dim, axes)
        # raw axes' factors first, then the coded ones', each group in the axes' order,
        # one factor per hop
        perm = [at + axes.index(a) for a in order]
        f = jnp.moveaxis(f, perm, list(range(at, at + len(axes))))
        hops = [h._replace(dim=at + i) for i, h in enumerate(_run_hops(raw, runs, k))]
        sizes = tuple(lax.axis_size(h.axes) for h in hops)
        f = f.reshape(f.shape[:at] + sizes + f.shape[at + len(axes):])
        (f,), _ = reduce_scatter_hops([f], hops, rows=rows, bucket_bytes=bucket_bytes)
        f = f.reshape(f.shape[:at] + f.shape[at + len(hops):])  # the hops' factors, now 1
        return f if tiled else jnp.squeeze(f, at)

    leaves, treedef = jax.tree.flatten(x)
    keys = [None if key is None else jax.random.fold_in(key, i) for i in range(len(leaves))]
    return jax.tree.unflatten(treedef, [one(leaf, k) for leaf, k in zip(leaves, keys)])


def all_gather(x, axis_name, *, axis_index_groups=None, axis=0, tiled=False, to="varying",
               codec="none", bwd_codec=None, key=None, rows="independent",
               bucket_bytes=DEFAULT_BUCKET_BYTES):
    """`jax.lax.all_gather` with a codec per axis (a dict): the coded gathers first,
    on the small piece, then lax's gather over the raw axes (`all_gather_hops`,
    leaf by leaf), the blocks laid out as lax's. Its backward is the per-hop
    reduce-scatter (bwd_codec). A single codec is `ops.all_gather`."""
    axes = arguments.axes_of(axis_name)
    plan = _split(codec, bwd_codec, axes)
    if plan is None:
        return ops.all_gather(x, axis_name, axis_index_groups=axis_index_groups, axis=axis,
                              tiled=tiled, to=to, codec=codec, bwd_codec=bwd_codec, key=key,
                              rows=rows, bucket_bytes=bucket_bytes)
    raw, runs = plan
    if not runs:
        return lax.all_gather(x, axis_name, axis_index_groups=axis_index_groups, axis=axis,
                              tiled=tiled, to=to)
    if axis_index_groups is not None:
        raise ValueError("axis_index_groups is not supported with a codec per axis")
    if to not in ("varying", "invarying"):
        raise ValueError(f"all_gather: to={to!r} is not supported with compression; "
                         "allowed: 'varying', 'invarying'")
    arguments.dims_of(x, axis, "axis", "all_gather", 0 if tiled else 1)
    cpu.check_scheduler(f"all_gather over {axes} hop by hop")

    def one(leaf, k):
        dim = axis % (leaf.ndim + (0 if tiled else 1))
        hops = _run_hops(raw, runs, k)
        hops = hops[1:] + hops[:1] if raw else hops  # the coded gathers first
        (g,) = all_gather_hops([leaf[None]], hops, to=to, rows=rows, bucket_bytes=bucket_bytes)
        # g: [n_hop x ... x n_1, *leaf], the last hop's factor leading; lay the
        # factors out in the axes' order, then as lax puts them along `dim`
        names = [a for h in hops[::-1] for a in arguments.axes_of(h.axes)]
        sizes = [lax.axis_size(a) for a in names]
        g = g.reshape(tuple(sizes) + leaf.shape)
        g = jnp.moveaxis(g, [names.index(a) for a in axes], list(range(len(axes))))
        g = g.reshape((int(np.prod(sizes)),) + leaf.shape)
        return arguments.stack_along(g, dim, tiled)

    leaves, treedef = jax.tree.flatten(x)
    keys = [None if key is None else jax.random.fold_in(key, i) for i in range(len(leaves))]
    return jax.tree.unflatten(treedef, [one(leaf, k) for leaf, k in zip(leaves, keys)])
