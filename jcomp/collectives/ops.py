"""The public ops of `jcomp.collectives` (the package's docstring says what
they promise): each a `jax.lax` twin that codes what it sends, from one
custom_vjp factory (`_coded`)."""
from __future__ import annotations

import functools
import warnings
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from jcomp.collectives import arguments, kernels
from jcomp.collectives.buckets import DEFAULT_BUCKET_BYTES, RowView, bucketed
from jcomp.collectives.arguments import RawSendWarning, vary as _vary
from jcomp.collectives.feedback import psum_ef, psum_scatter_ef
from jcomp.meter.scope import RAW_SCOPE
from jcomp.meter.compare import ExtraBytesWarning

__all__ = [
    "psum", "pmean", "psum_scatter", "all_gather", "ppermute", "all_to_all",
    "copy_to_parallel", "reduce_from_parallel", "psum_ef", "psum_scatter_ef", "vary",
    "REMAT_NAMES", "DEFAULT_BUCKET_BYTES", "RAW_SCOPE", "RawSendWarning", "ROWS",
]

REMAT_NAMES = {op: f"jcomp_{op}" for op in
               ("psum", "psum_scatter", "all_gather", "ppermute", "all_to_all")}


_axes = arguments.axes_of
parse, check_key, device_key = arguments.parse, arguments.check_key, arguments.device_key
ROWS, last_row, split_row = arguments.ROWS, arguments.last_row, arguments.split_row


def vary(x, axes):
    """Marks `x` varying over those of `axes` (a name or a tuple of names) it is
    not yet varying over (`lax.pcast` refuses axes the value already varies over).
    `x` may be a pytree: `cc.vary(params, "data")` before `jax.grad` gives the local
    gradients of replicated parameters, with no automatic float32 psum."""
    return jax.tree.map(lambda leaf: _vary(leaf, _axes(axes)), x)


def _varying(x) -> frozenset:
    return jax.typeof(x).mat.varying


def _checked(axes) -> bool:
    """True under shard_map(check_vma=True): there an axis index varies over its axis."""
    return axes[0] in _varying(lax.axis_index(axes[0]))


class _Ready(NamedTuple):
    axes: tuple
    fwd: Any
    bwd: Any
    rows: str


def _prepare(x, axis_name, codec, bwd_codec, key, rows, axis_index_groups=None):
    """-> _Ready, or None where the jax.lax op runs on `x` as it is: both codecs
    "none" (the lax call itself, bit for bit, on any pytree and dtype; leaves
    are never bucketed there, since a sum over a concatenated buffer need not
    round as the lax op does), or an axis of size 1."""
    arguments.check_rows(rows)
    fwd = parse(codec)
    bwd = fwd if bwd_codec is None else parse(bwd_codec)
    axes = _axes(axis_name)
    if fwd.kind == "identity" and bwd.kind == "identity":
        return None
    arguments.check_floating(x, str(fwd if fwd.kind != "identity" else bwd))
    if axis_index_groups is not None:
        raise ValueError(
            f"axis_index_groups is not supported with codec {str(fwd)!r}; "
            "use codec='none' or a mesh axis that spans the groups")
    if lax.axis_size(axes) == 1:
        return None  # nothing crosses the wire over a size-1 axis
    check_key(key, fwd, bwd)
    warn_automatic_axes(axes, fwd if fwd.kind != "identity" else bwd)
    return _Ready(axes, fwd, bwd, rows)


def warn_automatic_axes(axes, codec):
    """An ExtraBytesWarning where a coded op runs in a map that leaves other mesh
    axes (of size > 1) automatic: its buffers (rows, buckets, chunks) carry no
    layout over those axes, so XLA gathers an operand split over them before
    coding it whole on every device (a hand-made cc.pmean of tensor-parallel
    gradients in a map manual over "data" only: 29-49x the plain step's bytes
    over the tensor axis, measured). Which operands are split, the op cannot
    see; cc.value_and_grad can (it is given the parameters' specs)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return
    auto = [a for a, t in zip(mesh.axis_names, mesh.axis_types)
            if t != jax.sharding.AxisType.Manual and a not in axes and mesh.shape[a] > 1]
    if auto:
        warnings.warn(ExtraBytesWarning(
            f"a coded collective over {axes} with {codec} runs in a map that leaves "
            f"{auto} automatic: XLA gathers operands split over {auto} before they are "
            f"coded, which sends more over {auto} than the plain program; make the map "
            f"manual over {auto} too, or use cc.value_and_grad with param_specs "
            "(jcomp.meter.compare measures the difference)"), stacklevel=4)


class Sent(NamedTuple):
    """What one coded collective needs besides its operand (static under jit)."""
    axes: tuple
    fwd: Any  # the forward's codec
    bwd: Any  # the backward's codec
    row: int | None = None  # coded row length; None: the buffer row is flat
    checked: bool = False  # psum: under shard_map(check_vma=True)
    to: str = "varying"  # all_gather: the result's variance over the axes
    perm: tuple = ()  # ppermute: the (source, destination) pairs


def _coded(fwd, bwd):
    """A custom_vjp op(sent: Sent, x_RxC, key): fwd(x, sent, codec, key) forward and
    bwd(ct, sent, codec, key) backward, each with its own codec and the key folded
    with the device's index; the backward draws its own randomness."""

    @functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
    def op(sent, x, key):
        return fwd(x, sent, sent.fwd, device_key(key, sent.axes, sent.fwd))

    def backward(sent, key, ct):
        key = None if key is None else jax.random.fold_in(key, 1)
        return bwd(ct, sent, sent.bwd, device_key(key, sent.axes, sent.bwd)), None

    op.defvjp(lambda sent, x, key: (op(sent, x, key), key), backward)
    return op


def _allreduce(x, s, codec, key):
    return kernels.allreduce(x, s.axes, codec, key, row=s.row)[0]


def _allreduce_bwd(ct, s, codec, key):
    if s.checked:  # under check_vma, the transpose of an all-reduce into an invariant value
        return _vary(ct, s.axes)
    return _allreduce(ct, s, codec, key)


def _reduce_scatter(x, s, codec, key):
    return kernels.reduce_scatter(x, s.axes, codec, key, row=s.row)[0].astype(x.dtype)


def _mark_varying(x, s, codec, key):
    return lax.pcast(x, s.axes, to="varying")


def _gather(x, s, codec, key):
    return kernels.gather(x, s.axes, codec, key, s.to, row=s.row)


def _scatter_bwd(ct, s, codec, key):
    return kernels.gather(ct, s.axes, codec, key, "varying", row=s.row)


def _gather_bwd(ct, s, codec, key):
    if s.to == "invarying":  # every device holds the gathered value: its row is local
        own = lax.dynamic_index_in_dim(ct, lax.axis_index(s.axes), 0, keepdims=True)
        return _vary(own, s.axes)
    return _reduce_scatter(ct, s, codec, key)


def _permute(x, s, codec, key):
    return kernels.permute(x, s.axes, codec, key, s.perm, row=s.row)


def _permute_bwd(ct, s, codec, key):
    inverse = tuple((dst, src) for src, dst in s.perm)
    return kernels.permute(ct, s.axes, codec, key, inverse, row=s.row)


def _exchange(x, s, codec, key):
    return kernels.exchange(x, s.axes, codec, key, row=s.row)


_PSUM = _coded(_allreduce, _allreduce_bwd)
_COPY = _coded(_mark_varying, _allreduce_bwd)
_SCATTER = _coded(_reduce_scatter, _scatter_bwd)
_GATHER = _coded(_gather, _gather_bwd)
_PERMUTE = _coded(_permute, _permute_bwd)
_EXCHANGE = _coded(_exchange, _exchange)


# ------------------------------------------------------------ public API

def _lax_per_leaf(x, per_leaf, whole, as_given: bool):
    """The lax op itself where its arguments are as lax takes them (`whole()`),
    else leaf by leaf with negative dimensions resolved (lax refuses those)."""
    return whole() if as_given else jax.tree.map(per_leaf, x)


def _flat(leaf):
    return leaf.reshape(1, -1)


def _same(out, leaf):
    return out.reshape(leaf.shape)


def _tree(op, x, ready, view, coded, key, bucket_bytes, *, prepare=None, **sent):
    """The leaves of `x` laid out as rows by `view` (a buckets.RowView) and sent in
    buckets, each by the custom_vjp op `coded` with Sent(live axes, ready's
    codecs, row, **sent). `row` is view.row_of(leaf) with rows="independent"
    (leaves share a bucket only with leaves of their row length) and with
    rows="flat" what `arguments.flat_group` gives (one block, so that leaves share
    no block; the leaf's length; or None for a cast). prepare(leaf) -> (leaf,
    the axes it still has to travel over); by default the leaf marked varying
    over all of them. The results are named for remat."""
    axes = ready.axes
    prepare = prepare or (lambda leaf: (_vary(leaf, axes), axes))

    def grouped(leaf):
        leaf, live = prepare(leaf)
        if not live:
            return leaf, None
        return leaf, (live,) + arguments.row_key(ready.rows, leaf, view, (ready.fwd, ready.bwd))

    def send(buf, group, k):
        live, row = group
        return coded(Sent(live, ready.fwd, ready.bwd, row, **sent), buf, k)

    out = bucketed(x, grouped, view, send, key, bucket_bytes)
    return jax.tree.map(lambda v: checkpoint_name(v, REMAT_NAMES[op]), out)


def psum(x, axis_name, *, axis_index_groups=None, codec="none", bwd_codec=None, key=None,
         rows="independent", bucket_bytes=DEFAULT_BUCKET_BYTES):
    """`jax.lax.psum` that sends `codec`-coded chunks. Result: x's shapes and dtypes,
    invariant over `axis_name`. Its backward pass moves nothing (as for lax.psum)."""
    ready = _prepare(x, axis_name, codec, bwd_codec, key, rows, axis_index_groups)
    if ready is None:
        return lax.psum(x, axis_name, axis_index_groups=axis_index_groups)
    axes = ready.axes
    checked = _checked(axes)

    def prepare(leaf):
        if leaf.dtype == jnp.bool_:
            leaf = leaf.astype(jnp.int32)  # as lax.psum
        if not checked:
            return leaf, axes
        invariant = tuple(a for a in axes if a not in _varying(leaf))
        if invariant:  # n identical copies sum to n * x: no traffic
            leaf = leaf * lax.axis_size(invariant)
        return leaf, tuple(a for a in axes if a not in invariant)

    return _tree("psum", x, ready, RowView(_flat, _same), _PSUM, key, bucket_bytes,
                 prepare=prepare, checked=checked)


def pmean(x, axis_name, *, axis_index_groups=None, codec="none", bwd_codec=None, key=None,
          rows="independent", bucket_bytes=DEFAULT_BUCKET_BYTES):
    """`jax.lax.pmean`: `psum` divided by the number of devices over `axis_name`."""
    arguments.check_rows(rows)
    if parse(codec).kind == "identity" and parse(
            codec if bwd_codec is None else bwd_codec).kind == "identity":
        return lax.pmean(x, axis_name, axis_index_groups=axis_index_groups)
    total = psum(x, axis_name, axis_index_groups=axis_index_groups, codec=codec,
                 bwd_codec=bwd_codec, key=key, rows=rows, bucket_bytes=bucket_bytes)
    n = (len(axis_index_groups[0]) if axis_index_groups is not None  # as lax: each group's mean
         else lax.axis_size(_axes(axis_name)))
    return jax.tree.map(lambda v: v / n, total)


def reduce_from_parallel(x, axis_name, *, codec="none", key=None, rows="independent"):
    """Megatron's `g`: compressed all-reduce forward, identity backward (= `psum`)."""
    return psum(x, axis_name, codec=codec, key=key, rows=rows)


def copy_to_parallel(x, axis_name, *, bwd_codec="none", key=None, rows="independent"):
    """Megatron's `f`: identity forward, compressed all-reduce backward.

    `x` is invariant over `axis_name` (replicated); the result is varying, so the
    following matmul against a sharded weight needs no implicit conversion. The
    gradient of a replicated input is a sum over the axis; this sends it with
    `bwd_codec` instead of the full-precision psum JAX would otherwise insert.
    """
    arguments.check_rows(rows)
    bwd = parse(bwd_codec)
    axes = _axes(axis_name)

    def one(leaf, k):
        missing = tuple(a for a in axes if a not in _varying(leaf))
        if not missing:
            return leaf
        if bwd.kind == "identity" or lax.axis_size(missing) == 1:
            return lax.pcast(leaf, missing, to="varying")
        check_key(k, bwd)
        row = last_row(leaf) if rows == "independent" else None
        return _same(_COPY(Sent(missing, bwd, bwd, row), _flat(leaf), k), leaf)

    leaves, treedef = jax.tree.flatten(x)
    keys = [None if key is None else jax.random.fold_in(key, i) for i in range(len(leaves))]
    return jax.tree.unflatten(treedef, [one(leaf, k) for leaf, k in zip(leaves, keys)])


def psum_scatter(x, axis_name, *, scatter_dimension=0, axis_index_groups=None, tiled=False,
                 codec="none", bwd_codec=None, key=None, rows="independent",
                 bucket_bytes=DEFAULT_BUCKET_BYTES):
    """`jax.lax.psum_scatter` as all_to_all of coded chunks + float32 sum.
    Backward: compressed all_gather with `bwd_codec`. A negative
    `scatter_dimension` counts from the end."""
    arguments.dims_of(x, scatter_dimension, "scatter_dimension", "psum_scatter")
    ready = _prepare(x, axis_name, codec, bwd_codec, key, rows, axis_index_groups)
    if ready is None:
        return _lax_per_leaf(
            x, lambda leaf: lax.psum_scatter(
                leaf, axis_name, scatter_dimension=scatter_dimension % leaf.ndim,
                axis_index_groups=axis_index_groups, tiled=tiled),
            lambda: lax.psum_scatter(x, axis_name, scatter_dimension=scatter_dimension,
                                     axis_index_groups=axis_index_groups, tiled=tiled),
            scatter_dimension >= 0)
    n = lax.axis_size(ready.axes)

    def to_rows(leaf):
        dim = scatter_dimension % leaf.ndim
        return arguments.rows_along(leaf, n, dim, tiled, "psum_scatter").reshape(n, -1)

    def from_rows(out_1xC, leaf):
        dim = scatter_dimension % leaf.ndim
        shape = list(leaf.shape)
        shape[dim:dim + 1] = [shape[dim] // n] if tiled else []
        return out_1xC.reshape(shape)

    def row_of(leaf):
        return split_row(leaf, scatter_dimension % leaf.ndim, n, tiled)

    return _tree("psum_scatter", x, ready, RowView(to_rows, from_rows, row_of), _SCATTER, key,
                 bucket_bytes)


def all_gather(x, axis_name, *, axis_index_groups=None, axis=0, tiled=False, to="varying",
               codec="none", bwd_codec=None, key=None, rows="independent",
               bucket_bytes=DEFAULT_BUCKET_BYTES):
    """`jax.lax.all_gather` that sends the codec's payload. Backward: a compressed
    reduce-scatter with `bwd_codec` (to="varying") or a local slice (to="invarying")."""
    arguments.dims_of(x, axis, "axis", "all_gather", 0 if tiled else 1)
    ready = _prepare(x, axis_name, codec, bwd_codec, key, rows, axis_index_groups)
    if ready is None:
        return lax.all_gather(x, axis_name, axis_index_groups=axis_index_groups, axis=axis,
                              tiled=tiled, to=to)
    if to not in ("varying", "invarying"):
        raise ValueError(f"all_gather: to={to!r} is not supported with compression; "
                         "allowed: 'varying', 'invarying'")
    n = lax.axis_size(ready.axes)

    def from_rows(out_GxC, leaf):
        dim = axis % (leaf.ndim + (0 if tiled else 1))
        return arguments.stack_along(out_GxC.reshape((n,) + leaf.shape), dim, tiled)

    return _tree("all_gather", x, ready, RowView(_flat, from_rows), _GATHER, key, bucket_bytes,
                 to=to)


def ppermute(x, axis_name, perm, *, codec="none", bwd_codec=None, key=None,
             rows="independent", bucket_bytes=DEFAULT_BUCKET_BYTES):
    """`jax.lax.ppermute` of the payload. Backward: the inverse permutation, `bwd_codec`."""
    ready = _prepare(x, axis_name, codec, bwd_codec, key, rows)
    if ready is None:
        return lax.ppermute(x, axis_name, perm)
    perm = tuple((int(s), int(d)) for s, d in perm)
    return _tree("ppermute", x, ready, RowView(_flat, _same), _PERMUTE, key, bucket_bytes,
                 perm=perm)


def all_to_all(x, axis_name, split_axis, concat_axis, *, axis_index_groups=None, tiled=False,
               codec="none", bwd_codec=None, key=None, rows="independent",
               bucket_bytes=DEFAULT_BUCKET_BYTES):
    """`jax.lax.all_to_all` of the payload. Backward: the reverse all_to_all, `bwd_codec`.
    Negative axes count from the end."""
    arguments.dims_of(x, split_axis, "split_axis", "all_to_all")
    arguments.dims_of(x, concat_axis, "concat_axis", "all_to_all")
    ready = _prepare(x, axis_name, codec, bwd_codec, key, rows, axis_index_groups)
    if ready is None:
        return _lax_per_leaf(
            x, lambda leaf: lax.all_to_all(leaf, axis_name, split_axis % leaf.ndim,
                                           concat_axis % leaf.ndim,
                                           axis_index_groups=axis_index_groups, tiled=tiled),
            lambda: lax.all_to_all(x, axis_name, split_axis, concat_axis,
                                   axis_index_groups=axis_index_groups, tiled=tiled),
            split_axis >= 0 and concat_axis >= 0)
    n = lax.axis_size(ready.axes)

    def chunks(leaf):
        return arguments.rows_along(leaf, n, split_axis % leaf.ndim, tiled, "all_to_all")

    def from_rows(out_GxC, leaf):
        rows_N = out_GxC.reshape(chunks(leaf).shape)
        return arguments.stack_along(rows_N, concat_axis % leaf.ndim, tiled)

    def row_of(leaf):
        return split_row(leaf, split_axis % leaf.ndim, n, tiled)

    view = RowView(lambda leaf: chunks(leaf).reshape(n, -1), from_rows, row_of)
    return _tree("all_to_all", x, ready, view, _EXCHANGE, key, bucket_bytes)

