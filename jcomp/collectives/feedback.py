"""Error feedback: a collective that sends codec(x + residual) and returns what
that left unsent, for the caller to add to the next step's x."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jcomp.collectives import arguments, kernels
from jcomp.collectives.buckets import DEFAULT_BUCKET_BYTES, RowView, bucketed


def psum_ef(x, residual, axis_name, *, codec, key=None, rows="independent",
            bucket_bytes=DEFAULT_BUCKET_BYTES):
    """Error-feedback all-reduce for gradients: sends codec(x + residual).

    -> (sum over the axis, new residual) where new residual = (x + residual) minus
    what this device's contribution was sent as. Carry the residual from step to
    step (same shape as x); start from zeros. Not differentiable (use on gradients).
    `rows` as for `jcomp.collectives.psum`.
    """
    def send(buf, axes, c, k, row):
        return kernels.allreduce(buf, axes, c, k, op="psum_ef", row=row)

    view = RowView(lambda leaf: leaf.reshape(1, -1),
                   lambda got, leaf: tuple(g.reshape(leaf.shape) for g in got))
    return _ef("psum_ef", x, residual, axis_name, codec, key, rows, bucket_bytes, view, send,
               exact=lambda leaf: lax.psum(leaf, axis_name))


def psum_scatter_ef(x, residual, axis_name, *, scatter_dimension=0, tiled=False, codec,
                    key=None, rows="independent", bucket_bytes=DEFAULT_BUCKET_BYTES):
    """Error-feedback reduce-scatter (ZeRO gradients). -> (shard of the sum, new residual)."""
    arguments.dims_of(x, scatter_dimension, "scatter_dimension", "psum_scatter_ef")
    n = lax.axis_size(arguments.axes_of(axis_name))

    def pieces(leaf):
        return arguments.rows_along(leaf, n, scatter_dimension % leaf.ndim, tiled, "psum_scatter_ef")

    def send(buf, axes, c, k, row):
        return kernels.reduce_scatter(buf, axes, c, k, op="psum_scatter_ef", row=row)

    def done(got, leaf):
        total, sent = got
        pieces_N = pieces(leaf)
        sent_N = sent.reshape(pieces_N.shape)
        return (total.reshape(pieces_N.shape[1:]).astype(leaf.dtype),
                arguments.stack_along(sent_N, scatter_dimension % leaf.ndim, tiled))

    view = RowView(lambda leaf: pieces(leaf).reshape(n, -1), done,
                   lambda leaf: arguments.split_row(leaf, scatter_dimension % leaf.ndim, n, tiled))
    return _ef("psum_scatter_ef", x, residual, axis_name, codec, key, rows, bucket_bytes, view,
               send, exact=lambda leaf: lax.psum_scatter(
                   leaf, axis_name, scatter_dimension=scatter_dimension % leaf.ndim, tiled=tiled))


def _check_residual(op, x, residual):
    """The residual must have x's structure and each leaf x's leaf's shape."""
    named, treedef = jax.tree_util.tree_flatten_with_path(x)
    try:
        res_leaves = treedef.flatten_up_to(residual)
    except (TypeError, ValueError):
        raise ValueError(f"{op}: residual must have the operand's tree structure "
                         f"{treedef}; got {jax.tree.structure(residual)}") from None
    for (path, leaf), res in zip(named, res_leaves):
        if jnp.shape(res) != leaf.shape:
            raise ValueError(f"{op}: residual{jax.tree_util.keystr(path)} has shape "
                             f"{jnp.shape(res)}; expected the operand's {leaf.shape}")


def _ef(op, x, residual, axis_name, codec, key, rows, bucket_bytes, view, send, *, exact):
    """x + residual sent in buckets: send(buf, axes, codec, key, row) -> (the
    op's result rows, what this device's rows were sent as); `view` lays leaves
    out and reads back (result, sent) per leaf. A lossless codec or a size-1
    axis runs `exact` (the lax op) on x + residual and returns zero residuals."""
    arguments.check_rows(rows)
    c = arguments.parse(codec)
    axes = arguments.axes_of(axis_name)
    _check_residual(op, x, residual)
    if c.kind != "identity":
        arguments.check_floating(x, str(c))
    if c.kind == "identity" or lax.axis_size(axes) == 1:
        total = jax.tree.map(lambda a, r: exact(a + r), x, residual)
        return total, jax.tree.map(jnp.zeros_like, residual)
    arguments.check_key(key, c)
    leaves, treedef = jax.tree.flatten(x)
    res_leaves = treedef.flatten_up_to(residual)
    corrected = [lax.stop_gradient(arguments.vary(leaf + res.astype(leaf.dtype), axes))
                 for leaf, res in zip(leaves, res_leaves)]
    def group(leaf):
        return leaf, (axes,) + arguments.row_key(rows, leaf, view, (c,))

    def send_bucket(buf, group, k):
        live, row = group
        return send(buf, live, c, arguments.device_key(k, live, c), row)

    got = bucketed(corrected, group, view, send_bucket, key, bucket_bytes)
    outs = [t for t, _ in got]
    news = [(cor.astype(jnp.float32) - sent).astype(res.dtype)
            for cor, (_, sent), res in zip(corrected, got, res_leaves)]
    return jax.tree.unflatten(treedef, outs), jax.tree.unflatten(treedef, news)
