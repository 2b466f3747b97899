"""Compressed drop-in replacements for the `jax.lax` collectives.

    from jcomp import collectives as cc
    y = cc.psum(x, "data", codec="int8")           # inside jax.shard_map

Every function takes the positional and keyword arguments of its `jax.lax`
twin plus `codec=` (what the forward collective sends), `bwd_codec=` (what the
backward collective sends; defaults to `codec`), `key=` (randomness for codecs
that draw it: stochastic rounding, rand-k) and, for pytrees, `bucket_bytes=`.
With `codec="none"` a call on one array *is* the `jax.lax` call; on a pytree it
gives lax's results bitwise, its leaves bucketed into a few messages.

What travels is the codec's payload (one uint8 buffer per row: codes, scales
and indices together), never a decoded full-precision array:
  psum / pmean  over 2 devices: all_gather of the coded rows, float32 sum of
                both on each device (one collective, one quantization). Over
                more: all_to_all of coded chunks, float32 sum of the decoded
                chunks on their owner, all_gather of the re-coded sums (fewer
                bytes than gathering every row once the axis passes 2). Sparse
                codecs keep each row's (chunk's) top entries: 2F of the bytes
  psum_scatter  all_to_all of coded chunks, float32 sum
  all_gather    all_gather of the payload
  ppermute      ppermute of the payload
  all_to_all    all_to_all of the payload
Over an axis of size 1 nothing moves, and the `jax.lax` op is used as is.

Never more bytes than `jax.lax`: where a codec cannot send fewer bytes than the
raw operand (a few elements; bf16 of bf16), the call sends it raw, warns
(`RawSendWarning`, once per call site) and `jcomp.wire` names those
collectives in `report.notes`. A quantizer's block shrinks to fit short rows.

Pytrees are bucketed: leaves of one dtype (and one varying type) are
concatenated into flat buffers of at most `bucket_bytes` and sent together, so
a model's hundred gradients cost a few messages, not a hundred.

Gradients come from `jax.custom_vjp`: the backward pass is the transpose of
the `jax.lax` op, sent with `bwd_codec`. Under `shard_map(check_vma=True)` (the
default) a `cc.psum` result is invariant over the summed axes, exactly like
`lax.psum`, so it may be declared replicated, and a psum over axes the
operand is invariant over moves nothing (it is n * x). Under
`check_vma=False`, as with `lax.psum`, every operand counts as varying and
the backward pass of `psum` is itself a (compressed) psum.

Remat: every result of a coded call carries a `jax.ad_checkpoint.checkpoint_name`,
`REMAT_NAMES[op]` ("jcomp_all_gather", ...), which name-based policies see:
`save_only_these_names("jcomp_all_gather")` keeps the decoded gathered weights
instead of gathering again in the backward pass, the offload policies move
them to host memory, and a policy saving only other names recomputes them.
A policy that tests the primitive (`str(prim) != "all_gather"`, as in the
shard_map tutorial) does not see a coded gather: its forward is one
`custom_vjp` call followed by layout ops, whose outputs such a policy saves.
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
parse = kernels.parse
check_key = kernels.check_key
device_key = kernels.device_key


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


def _bwd_key(key):
    """The backward pass draws its own randomness, distinct from the forward's."""
    return None if key is None else jax.random.fold_in(key, 1)


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
    """A custom_vjp op(static, x_RxM, key) running fwd forward and bwd backward."""

    @functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
    def op(static, x, key):
        return fwd(static, x, key)

    op.defvjp(lambda static, x, key: (fwd(static, x, key), key),
              lambda static, key, ct: (bwd(static, ct, _bwd_key(key)), None))
    return op


def _named(op, tree):
    """The results of a coded call, each named for remat policies."""
    return jax.tree.map(lambda v: checkpoint_name(v, REMAT_NAMES[op]), tree)


def _psum_fwd(static, x, key):
    axes, fwd, _, _ = static
    return kernels.allreduce(x, axes, fwd, device_key(key, axes, fwd))[0]


def _psum_bwd(static, ct, key):
    axes, _, bwd, checked = static
    if checked:  # the transpose of an all-reduce into an invariant value: no traffic
        return _vary(ct, axes)
    return kernels.allreduce(ct, axes, bwd, device_key(key, axes, bwd))[0]


def _copy_fwd(static, x, key):
    return lax.pcast(x, static[0], to="varying")


def _scatter_fwd(static, x, key):
    axes, fwd, _, _ = static
    return kernels.reduce_scatter(x, axes, fwd, device_key(key, axes, fwd))[0].astype(x.dtype)


def _scatter_bwd(static, ct, key):
    axes, _, bwd, _ = static
    return kernels.gather(ct, axes, bwd, device_key(key, axes, bwd), "varying")


def _gather_fwd(static, x, key):
    axes, fwd, _, to = static
    return kernels.gather(x, axes, fwd, device_key(key, axes, fwd), to)


def _gather_bwd(static, ct, key):
    axes, _, bwd, to = static
    if to == "invarying":  # every device holds the gathered value: its row is local
        own = lax.dynamic_index_in_dim(ct, lax.axis_index(axes), 0, keepdims=True)
        return _vary(own, axes)
    return kernels.reduce_scatter(ct, axes, bwd, device_key(key, axes, bwd))[0].astype(ct.dtype)


def _permute_fwd(static, x, key):
    axes, fwd, _, perm = static
    return kernels.permute(x, axes, fwd, device_key(key, axes, fwd), perm)


def _permute_bwd(static, ct, key):
    axes, _, bwd, perm = static
    inverse = tuple((dst, src) for src, dst in perm)
    return kernels.permute(ct, axes, bwd, device_key(key, axes, bwd), inverse)


def _exchange(static, x, key, codec):
    axes = static[0]
    return kernels.exchange(x, axes, codec, device_key(key, axes, codec))


_PSUM = _coded(_psum_fwd, _psum_bwd)
_COPY = _coded(_copy_fwd, _psum_bwd)
_SCATTER = _coded(_scatter_fwd, _scatter_bwd)
_GATHER = _coded(_gather_fwd, _gather_bwd)
_PERMUTE = _coded(_permute_fwd, _permute_bwd)
_EXCHANGE = _coded(lambda s, x, k: _exchange(s, x, k, s[1]),
                   lambda s, ct, k: _exchange(s, ct, k, s[2]))


# ------------------------------------------------------------ public API

def psum(x, axis_name, *, axis_index_groups=None, codec="none", bwd_codec=None, key=None,
         bucket_bytes=DEFAULT_BUCKET_BYTES):
    """`jax.lax.psum` that sends `codec`-coded chunks. Result: x's shapes and dtypes,
    invariant over `axis_name`. Its backward pass moves nothing (as for lax.psum)."""
    ready = _prepare(x, axis_name, codec, bwd_codec, key, axis_index_groups)
    if ready is None:
        return lax.psum(x, axis_name, axis_index_groups=axis_index_groups)
    axes, fwd, bwd, plain = ready
    if plain:
        return bucketed(x, lambda leaf: (leaf, axes), lambda leaf: leaf.reshape(1, -1),
                        lambda out, leaf: out.reshape(leaf.shape),
                        lambda buf, live, k: lax.psum(buf, live), None, bucket_bytes)
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

    def send(buf_1xM, live, k):
        return _PSUM((live, fwd, bwd, checked), buf_1xM, k)

    return _named("psum", bucketed(x, prepare, lambda leaf: leaf.reshape(1, -1),
                                   lambda out, leaf: out.reshape(leaf.shape), send, key,
                                   bucket_bytes))


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
        out = _COPY((missing, bwd, bwd, False), leaf.reshape(1, -1), k)
        return out.reshape(leaf.shape)

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
    axes, fwd, bwd, plain = ready
    n = lax.axis_size(axes)

    def to_rows(leaf):
        rows = kernels.rows_along(leaf, n, scatter_dimension % leaf.ndim, tiled, "psum_scatter")
        return rows.reshape(n, -1)

    def from_rows(out_1xM, leaf):
        return out_1xM.reshape(to_piece(leaf))

    def to_piece(leaf):
        dim = scatter_dimension % leaf.ndim
        shape = list(leaf.shape)
        if tiled:
            shape[dim] //= n
        else:
            del shape[dim]
        return tuple(shape)

    if plain:
        return bucketed(x, lambda leaf: (leaf, axes), to_rows, from_rows,
                        lambda buf, live, k: lax.psum_scatter(buf, live, tiled=True), None,
                        bucket_bytes)
    return _named("psum_scatter", bucketed(
        x, lambda leaf: (_vary(leaf, axes), axes), to_rows, from_rows,
        lambda buf, live, k: _SCATTER((live, fwd, bwd, None), buf, k), key, bucket_bytes))


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
        rows = out_GxM.reshape((n,) + leaf.shape)
        return kernels.stack_along(rows, dim, tiled)

    if plain:
        return bucketed(x, lambda leaf: (leaf, axes), lambda leaf: leaf.reshape(1, -1), from_rows,
                        lambda buf, live, k: lax.all_gather(buf, live, axis=0, tiled=True, to=to),
                        None, bucket_bytes)
    return _named("all_gather", bucketed(
        x, lambda leaf: (_vary(leaf, axes), axes), lambda leaf: leaf.reshape(1, -1), from_rows,
        lambda buf, live, k: _GATHER((live, fwd, bwd, to), buf, k), key, bucket_bytes))


def ppermute(x, axis_name, perm, *, codec="none", bwd_codec=None, key=None,
             bucket_bytes=DEFAULT_BUCKET_BYTES):
    """`jax.lax.ppermute` of the payload. Backward: the inverse permutation, `bwd_codec`."""
    ready = _prepare(x, axis_name, codec, bwd_codec, key)
    if ready is None:
        return lax.ppermute(x, axis_name, perm)
    axes, fwd, bwd, plain = ready
    perm = tuple((int(s), int(d)) for s, d in perm)
    if plain:
        return bucketed(x, lambda leaf: (leaf, axes), lambda leaf: leaf.reshape(1, -1),
                        lambda out, leaf: out.reshape(leaf.shape),
                        lambda buf, live, k: lax.ppermute(buf, live, perm), None, bucket_bytes)
    return _named("ppermute", bucketed(
        x, lambda leaf: (_vary(leaf, axes), axes), lambda leaf: leaf.reshape(1, -1),
        lambda out, leaf: out.reshape(leaf.shape),
        lambda buf, live, k: _PERMUTE((live, fwd, bwd, perm), buf, k), key, bucket_bytes))


def all_to_all(x, axis_name, split_axis, concat_axis, *, axis_index_groups=None, tiled=False,
               codec="none", bwd_codec=None, key=None, bucket_bytes=DEFAULT_BUCKET_BYTES):
    """`jax.lax.all_to_all` of the payload. Backward: the reverse all_to_all, `bwd_codec`."""
    ready = _prepare(x, axis_name, codec, bwd_codec, key, axis_index_groups)
    if ready is None:
        return lax.all_to_all(x, axis_name, split_axis, concat_axis,
                              axis_index_groups=axis_index_groups, tiled=tiled)
    axes, fwd, bwd, plain = ready
    n = lax.axis_size(axes)

    def chunks(leaf):
        return kernels.rows_along(leaf, n, split_axis % leaf.ndim, tiled, "all_to_all")

    def from_rows(out_GxM, leaf):
        rows = out_GxM.reshape(chunks(leaf).shape)
        return kernels.stack_along(rows, concat_axis % leaf.ndim, tiled)

    if plain:
        return bucketed(x, lambda leaf: (leaf, axes), lambda leaf: chunks(leaf).reshape(n, -1),
                        from_rows, lambda buf, live, k: lax.all_to_all(buf, live, 0, 0, tiled=True),
                        None, bucket_bytes)
    return _named("all_to_all", bucketed(
        x, lambda leaf: (_vary(leaf, axes), axes), lambda leaf: chunks(leaf).reshape(n, -1),
        from_rows, lambda buf, live, k: _EXCHANGE((live, fwd, bwd), buf, k), key, bucket_bytes))
