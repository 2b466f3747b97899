"""Compressed drop-in replacements for the `jax.lax` collectives.

    from jcomp import collectives as cc
    y = cc.psum(x, "data", codec="int8")           # inside jax.shard_map

Each op takes its `jax.lax` twin's arguments plus `codec=`, `bwd_codec=` (the
backward's; default `codec`), `key=` and `bucket_bytes=`; `codec="none"` on one
array *is* the lax call. What travels is the codec's payload (`kernels`), or the
raw operand, with a warning, where the codec cannot send fewer bytes. Gradients
come from one `custom_vjp` factory (`_coded`): the transpose of the lax op, sent
with `bwd_codec`. Results are named `REMAT_NAMES[op]` for remat policies. The
README ("Using the collectives") tables what each op sends, forward and back,
and how `check_vma` changes psum's backward.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from jcomp.collectives import kernels
from jcomp.collectives.buckets import DEFAULT_BUCKET_BYTES, bucketed
from jcomp.collectives.feedback import psum_ef, psum_scatter_ef
from jcomp.collectives.kernels import RAW_SCOPE, RawSendWarning, vary as _vary

__all__ = [
    "psum", "pmean", "psum_scatter", "all_gather", "ppermute", "all_to_all",
    "copy_to_parallel", "reduce_from_parallel", "psum_ef", "psum_scatter_ef", "vary",
    "REMAT_NAMES", "DEFAULT_BUCKET_BYTES", "RAW_SCOPE", "RawSendWarning",
]

REMAT_NAMES = {op: f"jcomp_{op}" for op in
               ("psum", "psum_scatter", "all_gather", "ppermute", "all_to_all")}


_axes = kernels.axes_of
parse, check_key, device_key = kernels.parse, kernels.check_key, kernels.device_key


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


def _prepare(x, axis_name, codec, bwd_codec, key, axis_index_groups=None):
    """-> (axes, fwd codec, bwd codec, plain) or None where the jax.lax op runs on `x`
    as it is. `plain`: both codecs are "none", and the leaves of the pytree `x`
    travel bucketed through the jax.lax op (the same values, fewer messages)."""
    fwd = parse(codec)
    bwd = fwd if bwd_codec is None else parse(bwd_codec)
    axes = _axes(axis_name)
    plain = fwd.kind == "identity" and bwd.kind == "identity"
    if plain and (axis_index_groups is not None or len(jax.tree.leaves(x)) < 2):
        return None
    if axis_index_groups is not None:
        raise ValueError(
            f"axis_index_groups is not supported with codec {str(fwd)!r}; "
            "use codec='none' or a mesh axis that spans the groups")
    if lax.axis_size(axes) == 1:
        return None  # nothing crosses the wire over a size-1 axis
    check_key(key, fwd, bwd)
    return axes, fwd, bwd, plain


def _coded(fwd, bwd):
    """A custom_vjp op(static, x_RxM, key), static = (axes, fwd codec, bwd codec,
    extra): fwd(x, axes, codec, key, extra) forward and bwd(ct, ...) backward, each
    with its own codec and the key folded with the device's index."""

    def run(f, i, static, x, key):
        axes, codec = static[0], static[i]
        return f(x, axes, codec, device_key(key, axes, codec), static[3])

    @functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
    def op(static, x, key):
        return run(fwd, 1, static, x, key)

    # The backward pass draws its own randomness, distinct from the forward's.
    bwd_key = lambda key: None if key is None else jax.random.fold_in(key, 1)
    op.defvjp(lambda static, x, key: (run(fwd, 1, static, x, key), key),
              lambda static, key, ct: (run(bwd, 2, static, ct, bwd_key(key)), None))
    return op


def _allreduce_bwd(ct, axes, codec, key, checked):
    if checked:  # the transpose of an all-reduce into an invariant value: no traffic
        return _vary(ct, axes)
    return kernels.allreduce(ct, axes, codec, key)[0]


def _reduce_scatter(x, axes, codec, key, _):
    return kernels.reduce_scatter(x, axes, codec, key)[0].astype(x.dtype)


def _gather_bwd(ct, axes, codec, key, to):
    if to == "invarying":  # every device holds the gathered value: its row is local
        own = lax.dynamic_index_in_dim(ct, lax.axis_index(axes), 0, keepdims=True)
        return _vary(own, axes)
    return _reduce_scatter(ct, axes, codec, key, None)


_PSUM = _coded(lambda x, axes, c, k, _: kernels.allreduce(x, axes, c, k)[0], _allreduce_bwd)
_COPY = _coded(lambda x, axes, c, k, _: lax.pcast(x, axes, to="varying"), _allreduce_bwd)
_SCATTER = _coded(_reduce_scatter, lambda ct, axes, c, k, _: kernels.gather(ct, axes, c, k,
                                                                            "varying"))
_GATHER = _coded(kernels.gather, _gather_bwd)
_PERMUTE = _coded(kernels.permute, lambda ct, axes, c, k, perm: kernels.permute(
    ct, axes, c, k, tuple((dst, src) for src, dst in perm)))
_EXCHANGE = _coded(kernels.exchange, kernels.exchange)


# ------------------------------------------------------------ public API

def _flat(leaf):
    return leaf.reshape(1, -1)


def _same(out, leaf):
    return out.reshape(leaf.shape)


def _tree(op, x, ready, to_rows, from_rows, lax_send, coded_send, key, bucket_bytes,
          prepare=None):
    """The leaves of `x` sent bucketed: through `lax_send(buf, axes)` where both
    codecs are "none" (lax's values, fewer messages), else through
    `coded_send(buf, axes, key)`, the results named for remat."""
    axes, _, _, plain = ready
    if plain:
        return bucketed(x, lambda leaf: (leaf, axes), to_rows, from_rows,
                        lambda buf, live, k: lax_send(buf, live), None, bucket_bytes)
    prepare = prepare or (lambda leaf: (_vary(leaf, axes), axes))
    out = bucketed(x, prepare, to_rows, from_rows, coded_send, key, bucket_bytes)
    return jax.tree.map(lambda v: checkpoint_name(v, REMAT_NAMES[op]), out)


def psum(x, axis_name, *, axis_index_groups=None, codec="none", bwd_codec=None, key=None,
         bucket_bytes=DEFAULT_BUCKET_BYTES):
    """`jax.lax.psum` that sends `codec`-coded chunks. Result: x's shapes and dtypes,
    invariant over `axis_name`. Its backward pass moves nothing (as for lax.psum)."""
    ready = _prepare(x, axis_name, codec, bwd_codec, key, axis_index_groups)
    if ready is None:
        return lax.psum(x, axis_name, axis_index_groups=axis_index_groups)
    axes, fwd, bwd, plain = ready
    checked = not plain and _checked(axes)

    def prepare(leaf):
        if leaf.dtype == jnp.bool_:
            leaf = leaf.astype(jnp.int32)  # as lax.psum
        if not checked:
            return leaf, axes
        invariant = tuple(a for a in axes if a not in _varying(leaf))
        if invariant:  # n identical copies sum to n * x: no traffic
            leaf = leaf * lax.axis_size(invariant)
        return leaf, tuple(a for a in axes if a not in invariant)

    return _tree("psum", x, ready, _flat, _same, lax.psum,
                 lambda buf, live, k: _PSUM((live, fwd, bwd, checked), buf, k), key,
                 bucket_bytes, prepare)


def pmean(x, axis_name, *, axis_index_groups=None, codec="none", bwd_codec=None, key=None,
          bucket_bytes=DEFAULT_BUCKET_BYTES):
    """`jax.lax.pmean`: `psum` divided by the number of devices over `axis_name`."""
    total = psum(x, axis_name, axis_index_groups=axis_index_groups, codec=codec,
                 bwd_codec=bwd_codec, key=key, bucket_bytes=bucket_bytes)
    n = (len(axis_index_groups[0]) if axis_index_groups is not None  # as lax: each group's mean
         else lax.axis_size(_axes(axis_name)))
    return jax.tree.map(lambda v: v / n, total)


def reduce_from_parallel(x, axis_name, *, codec="none", key=None):
    """Megatron's `g`: compressed all-reduce forward, identity backward (= `psum`)."""
    return psum(x, axis_name, codec=codec, key=key)


def copy_to_parallel(x, axis_name, *, bwd_codec="none", key=None):
    """Megatron's `f`: identity forward, compressed all-reduce backward.

    `x` is invariant over `axis_name` (replicated); the result is varying, so the
    following matmul against a sharded weight needs no implicit conversion. The
    gradient of a replicated input is a sum over the axis; this sends it with
    `bwd_codec` instead of the full-precision psum JAX would otherwise insert.
    """
    bwd = parse(bwd_codec)
    axes = _axes(axis_name)

    def one(leaf, k):
        missing = tuple(a for a in axes if a not in _varying(leaf))
        if not missing:
            return leaf
        if bwd.kind == "identity" or lax.axis_size(missing) == 1:
            return lax.pcast(leaf, missing, to="varying")
        check_key(k, bwd)
        return _same(_COPY((missing, bwd, bwd, False), _flat(leaf), k), leaf)

    leaves, treedef = jax.tree.flatten(x)
    keys = [None if key is None else jax.random.fold_in(key, i) for i in range(len(leaves))]
    return jax.tree.unflatten(treedef, [one(leaf, k) for leaf, k in zip(leaves, keys)])


def psum_scatter(x, axis_name, *, scatter_dimension=0, axis_index_groups=None, tiled=False,
                 codec="none", bwd_codec=None, key=None, bucket_bytes=DEFAULT_BUCKET_BYTES):
    """`jax.lax.psum_scatter` as all_to_all of coded chunks + float32 sum.
    Backward: compressed all_gather with `bwd_codec`."""
    ready = _prepare(x, axis_name, codec, bwd_codec, key, axis_index_groups)
    if ready is None:
        return lax.psum_scatter(x, axis_name, scatter_dimension=scatter_dimension,
                                axis_index_groups=axis_index_groups, tiled=tiled)
    axes, fwd, bwd, _ = ready
    n = lax.axis_size(axes)

    def to_rows(leaf):
        dim = scatter_dimension % leaf.ndim
        return kernels.rows_along(leaf, n, dim, tiled, "psum_scatter").reshape(n, -1)

    def from_rows(out_1xM, leaf):
        dim = scatter_dimension % leaf.ndim
        shape = list(leaf.shape)
        shape[dim:dim + 1] = [shape[dim] // n] if tiled else []
        return out_1xM.reshape(shape)

    return _tree("psum_scatter", x, ready, to_rows, from_rows,
                 lambda buf, live: lax.psum_scatter(buf, live, tiled=True),
                 lambda buf, live, k: _SCATTER((live, fwd, bwd, None), buf, k), key, bucket_bytes)


def all_gather(x, axis_name, *, axis_index_groups=None, axis=0, tiled=False, to="varying",
               codec="none", bwd_codec=None, key=None, bucket_bytes=DEFAULT_BUCKET_BYTES):
    """`jax.lax.all_gather` that sends the codec's payload. Backward: a compressed
    reduce-scatter with `bwd_codec` (to="varying") or a local slice (to="invarying")."""
    ready = _prepare(x, axis_name, codec, bwd_codec, key, axis_index_groups)
    if ready is None:
        return lax.all_gather(x, axis_name, axis_index_groups=axis_index_groups, axis=axis,
                              tiled=tiled, to=to)
    axes, fwd, bwd, plain = ready
    if to not in ("varying", "invarying") and not plain:
        raise ValueError(f"all_gather: to={to!r} is not supported with compression; "
                         "allowed: 'varying', 'invarying'")
    n = lax.axis_size(axes)

    def from_rows(out_GxM, leaf):
        dim = axis % (leaf.ndim + (0 if tiled else 1))
        return kernels.stack_along(out_GxM.reshape((n,) + leaf.shape), dim, tiled)

    return _tree("all_gather", x, ready, _flat, from_rows,
                 lambda buf, live: lax.all_gather(buf, live, axis=0, tiled=True, to=to),
                 lambda buf, live, k: _GATHER((live, fwd, bwd, to), buf, k), key, bucket_bytes)


def ppermute(x, axis_name, perm, *, codec="none", bwd_codec=None, key=None,
             bucket_bytes=DEFAULT_BUCKET_BYTES):
    """`jax.lax.ppermute` of the payload. Backward: the inverse permutation, `bwd_codec`."""
    ready = _prepare(x, axis_name, codec, bwd_codec, key)
    if ready is None:
        return lax.ppermute(x, axis_name, perm)
    axes, fwd, bwd, _ = ready
    perm = tuple((int(s), int(d)) for s, d in perm)
    return _tree("ppermute", x, ready, _flat, _same,
                 lambda buf, live: lax.ppermute(buf, live, perm),
                 lambda buf, live, k: _PERMUTE((live, fwd, bwd, perm), buf, k), key, bucket_bytes)


def all_to_all(x, axis_name, split_axis, concat_axis, *, axis_index_groups=None, tiled=False,
               codec="none", bwd_codec=None, key=None, bucket_bytes=DEFAULT_BUCKET_BYTES):
    """`jax.lax.all_to_all` of the payload. Backward: the reverse all_to_all, `bwd_codec`."""
    ready = _prepare(x, axis_name, codec, bwd_codec, key, axis_index_groups)
    if ready is None:
        return lax.all_to_all(x, axis_name, split_axis, concat_axis,
                              axis_index_groups=axis_index_groups, tiled=tiled)
    axes, fwd, bwd, _ = ready
    n = lax.axis_size(axes)

    def chunks(leaf):
        return kernels.rows_along(leaf, n, split_axis % leaf.ndim, tiled, "all_to_all")

    def from_rows(out_GxM, leaf):
        rows = out_GxM.reshape(chunks(leaf).shape)
        return kernels.stack_along(rows, concat_axis % leaf.ndim, tiled)

    return _tree("all_to_all", x, ready, lambda leaf: chunks(leaf).reshape(n, -1), from_rows,
                 lambda buf, live: lax.all_to_all(buf, live, 0, 0, tiled=True),
                 lambda buf, live, k: _EXCHANGE((live, fwd, bwd, None), buf, k), key, bucket_bytes)
