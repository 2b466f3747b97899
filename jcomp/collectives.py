"""Compressed drop-in replacements for the `jax.lax` collectives.

    from jcomp import collectives as cc
    y = cc.psum(x, "data", codec="int8")           # inside jax.shard_map

Every function takes the positional and keyword arguments of its `jax.lax`
twin plus `codec=` (what the forward collective sends), `bwd_codec=` (what the
backward collective sends; defaults to `codec`) and `key=` (randomness for
codecs that draw it: stochastic rounding, rand-k). With `codec="none"` each
call *is* the `jax.lax` call, bitwise.

What travels is the codec's payload, never a decoded full-precision array:
  psum          all_to_all of encoded chunks, float32 sum of the decoded chunks
                on their owner, then all_gather of the re-encoded sums (dense
                codecs); all_gather of (values, indices) and a scatter-add
                (sparse codecs).
  psum_scatter  all_to_all of encoded chunks, float32 sum.
  all_gather    all_gather of the payload.
  ppermute      ppermute of the payload.
  all_to_all    all_to_all of the payload.
Over an axis of size 1 nothing moves, and the `jax.lax` op is used as is.

Gradients come from `jax.custom_vjp`: the backward pass is the transpose of
the `jax.lax` op, sent with `bwd_codec`. These functions assume `shard_map`'s
`check_vma=True` (the default): a `cc.psum` result is invariant over the
summed axes, exactly like `lax.psum`, so it may be declared replicated.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from jcomp import codecs as _codecs

__all__ = [
    "psum", "psum_scatter", "all_gather", "ppermute", "all_to_all",
    "copy_to_parallel", "reduce_from_parallel", "psum_ef", "psum_scatter_ef", "vary",
]


# ---------------------------------------------------------------- helpers

def _axes(axis_name) -> tuple:
    return tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)


def _parse(codec):
    """A codec these collectives can send with; the others are refused loudly
    rather than replaced by an uncompressed collective."""
    c = _codecs.parse(codec)
    if c.kind == "lowrank":
        raise ValueError(f"codec {c} compresses data-parallel gradients through "
                         "jcomp.powersgd.reduce (or the optimizer), not a collective")
    if c.kind == "learned":
        raise ValueError(f"codec {c} is a learned autoencoder whose weights are model "
                         "parameters; jcomp.parallel applies it inside the model's blocks")
    return c


def _varying(x) -> frozenset:
    return jax.typeof(x).mat.varying


def vary(x, axes):
    """Marks `x` varying over those of `axes` (a name or a tuple of names) it is
    not yet varying over (`lax.pcast` refuses axes the value already varies over)."""
    missing = tuple(a for a in _axes(axes) if a not in _varying(x))
    return lax.pcast(x, missing, to="varying") if missing else x



def _bwd_key(key):
    """The backward pass draws its own randomness, distinct from the forward's."""
    return None if key is None else jax.random.fold_in(key, 1)


def _codec_pair(codec, bwd_codec):
    fwd = _parse(codec)
    bwd = fwd if bwd_codec is None else _parse(bwd_codec)
    return fwd, bwd


def _check_key(key, *codecs):
    for c in codecs:
        if c.needs_key and key is None:
            raise ValueError(
                f"codec {str(c)!r} draws random numbers: pass key= (a jax.random key)")


def _check_groups(axis_index_groups, codec):
    if axis_index_groups is not None:
        raise ValueError(
            f"axis_index_groups is not supported with codec {str(codec)!r}; "
            "use codec='none' or a mesh axis that spans the groups")


def _device_key(key, axes, codec):
    """Per-device randomness: stochastic rounding must not repeat across devices.
    Rand-k keeps one key for all devices so every device picks the same entries."""
    if key is None or codec.name == "randk":
        return key
    return jax.random.fold_in(key, lax.axis_index(axes))


def _split(key, n=2):
    return (None,) * n if key is None else tuple(jax.random.split(key, n))


def _leaf_keys(key, leaves):
    if key is None:
        return [None] * len(leaves)
    return [jax.random.fold_in(key, i) for i in range(len(leaves))]


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _map(fn, tree, key):
    leaves, treedef = jax.tree.flatten(tree)
    outs = [fn(leaf, k) for leaf, k in zip(leaves, _leaf_keys(key, leaves))]
    return jax.tree.unflatten(treedef, outs)


def _send(payload, op):
    return jax.tree.map(op, payload)


def _all_to_all_rows(payload, axes):
    """Row j of every leaf goes to device j; row i of the result came from device i."""
    return _send(payload, lambda a: lax.all_to_all(a, axes, 0, 0, tiled=True))


def _gather_rows(payload, axes, to):
    return _send(payload, lambda a: lax.all_gather(a, axes, axis=0, tiled=True, to=to))


# Dense codecs code blocks independently, so a chunk of C elements may be coded
# as C/u rows of u = codec.row_multiple elements instead of one row of C: the
# payload holds the same bytes, only shaped (n, C/u, ...). Kept in that shape
# up to the collective, XLA:CPU's fused encode and decode run over one array
# shape and vectorise; a reshape to a flat row inside such a fusion (as the
# packing of int4/int2 needs) was seen to make it emit scalar loops 3-4x slower.

def _view(codec, m: int) -> tuple:
    """The shape a row of m elements is coded in: (m/u, u), or (m,) if u does not divide m."""
    u = codec.row_multiple
    return (m // u, u) if codec.kind == "dense" and u > 1 and m % u == 0 else (m,)


def _encode(codec, x_NxM, key):
    """Payload of the n rows of x_NxM, each coded in `_view` shape."""
    n, m = x_NxM.shape
    return codec.encode(x_NxM.reshape((n,) + _view(codec, m)), key=key)


def _decode(codec, payload, n: int, m: int, dtype):
    """Inverse of `_encode` -> [n, m] of `dtype`."""
    return codec.decode(payload, (n,) + _view(codec, m), dtype).reshape(n, m)


def _sum_rows(codec, payload, n: int, m: int):
    """Sums the n decoded rows of `payload` (each of length m) in float32 -> [m]."""
    if codec.kind == "sparse":
        values, indices = payload["values"], payload["indices"]
        return jnp.zeros((m,), jnp.float32).at[indices.reshape(-1)].add(
            values.reshape(-1).astype(jnp.float32))
    rows = [codec.decode(jax.tree.map(lambda a: a[i], payload), _view(codec, m), jnp.float32)
            for i in range(n)]
    return _add_all(rows).reshape(m)


def _add_all(rows):
    """Sum of same-shaped arrays as a tree of elementwise adds.

    XLA:CPU compiles a reduction over the leading axis of a fused decode, and
    row slices taken after the decode, into unvectorised loops 7-10x slower
    than an elementwise add; decoding each row on its own and adding fuses
    into one vectorised pass."""
    while len(rows) > 1:
        pairs = [a + b for a, b in zip(rows[0::2], rows[1::2])]
        rows = pairs + rows[len(pairs) * 2:]
    return rows[0]


# ------------------------------------------------------- compressed kernels

def _reduce_scatter_rows(x_NxM, axes, codec, key):
    """Row j of every device's x_NxM is summed onto device j.
    -> (sum [M] f32, payload this device sent)."""
    n, m = x_NxM.shape
    payload = _encode(codec, x_NxM, key)
    return _sum_rows(codec, _all_to_all_rows(payload, axes), n, m), payload


def _allreduce(x, axes, codec, key):
    """Compressed all-reduce of one array. -> (sum with x's shape/dtype, what x was sent as)."""
    n = lax.axis_size(axes)
    k1, k2 = _split(key)
    if codec.kind == "sparse":
        payload = codec.encode(x.reshape(1, -1), key=k1)
        sent = codec.decode(payload, (1, x.size), jnp.float32).reshape(x.shape)
        total = _sum_rows(codec, _gather_rows(payload, axes, "invarying"), n, x.size)
        return total.astype(x.dtype).reshape(x.shape), sent
    size = x.size
    chunk = _round_up(max(-(-size // n), 1), codec.row_multiple)
    x_flat = x.reshape(-1)
    if n * chunk != size:
        x_flat = jnp.pad(x_flat, (0, n * chunk - size))
    own_C, payload = _reduce_scatter_rows(x_flat.reshape(n, chunk), axes, codec, k1)
    gathered = _gather_rows(_encode(codec, own_C[None], k2), axes, "invarying")
    total_NxC = _decode(codec, gathered, n, chunk, jnp.float32)
    # The owner of a chunk also re-codes its sum; charging that error to the owner's
    # row keeps "sum of what was sent == total" exact, so error feedback repairs both phases.
    # (Only psum_ef reads `sent`; psum drops it and XLA removes its computation.)
    me = lax.axis_index(axes)
    shortfall_C = lax.dynamic_index_in_dim(total_NxC, me, 0, keepdims=False) - own_C
    mine_Nx1 = (jnp.arange(n) == me)[:, None]
    sent_NxC = _decode(codec, payload, n, chunk, jnp.float32) + jnp.where(
        mine_Nx1, shortfall_C[None], 0.0)
    return _unpad(total_NxC.astype(x.dtype), x), _unpad(sent_NxC, x)  # sent: float32


def _unpad(x_NxC, like):
    """The first like.size elements of x_NxC, shaped like `like`."""
    flat = x_NxC.reshape(-1)
    if flat.shape[0] != like.size:
        flat = flat[: like.size]
    return flat.reshape(like.shape)


def _gather(x, axes, codec, key, axis, tiled, to):
    """Compressed all_gather with `jax.lax.all_gather`'s layout."""
    n = lax.axis_size(axes)
    payload = _encode(codec, x.reshape(1, -1), key)
    rows = _decode(codec, _gather_rows(payload, axes, to), n, x.size, x.dtype)
    stacked = jnp.moveaxis(rows.reshape((n,) + x.shape), 0, axis)
    if not tiled:
        return stacked
    shape = x.shape[:axis] + (n * x.shape[axis],) + x.shape[axis + 1:]
    return stacked.reshape(shape)


def _scatter_rows(x, n, dim, tiled):
    """Splits `x` along `dim` into n pieces as psum_scatter does -> x_N [n, *piece]."""
    if tiled:
        if x.shape[dim] % n:
            raise ValueError(f"psum_scatter: dimension {dim} of size {x.shape[dim]} "
                             f"is not divisible by the axis size {n}")
        x = x.reshape(x.shape[:dim] + (n, x.shape[dim] // n) + x.shape[dim + 1:])
    elif x.shape[dim] != n:
        raise ValueError(f"psum_scatter: dimension {dim} has size {x.shape[dim]}; "
                         f"tiled=False needs the axis size {n}")
    return jnp.moveaxis(x, dim, 0)


def _scatter(x, axes, codec, key, dim, tiled):
    """Compressed psum_scatter with `jax.lax.psum_scatter`'s layout."""
    x_N = _scatter_rows(x, lax.axis_size(axes), dim, tiled)
    total, _ = _reduce_scatter_rows(x_N.reshape(x_N.shape[0], -1), axes, codec, key)
    return total.astype(x.dtype).reshape(x_N.shape[1:])


def _permute(x, axes, codec, key, perm):
    payload = _encode(codec, x.reshape(1, -1), key)
    moved = _send(payload, lambda a: lax.ppermute(a, axes, perm))
    return _decode(codec, moved, 1, x.size, x.dtype).reshape(x.shape)


def _exchange(x, axes, codec, key, split_axis, concat_axis, tiled):
    """Compressed all_to_all with `jax.lax.all_to_all`'s layout."""
    n = lax.axis_size(axes)
    if tiled:
        if x.shape[split_axis] % n:
            raise ValueError(f"all_to_all: split_axis {split_axis} of size {x.shape[split_axis]} "
                             f"is not divisible by the axis size {n}")
        parts = x.reshape(x.shape[:split_axis] + (n, x.shape[split_axis] // n)
                          + x.shape[split_axis + 1:])
        chunks_N = jnp.moveaxis(parts, split_axis, 0)
    else:
        if x.shape[split_axis] != n:
            raise ValueError(f"all_to_all: split_axis {split_axis} has size "
                             f"{x.shape[split_axis]}; tiled=False needs the axis size {n}")
        chunks_N = jnp.moveaxis(x, split_axis, 0)
    chunk_shape = chunks_N.shape[1:]
    payload = _encode(codec, chunks_N.reshape(n, -1), key)
    rows = _decode(codec, _all_to_all_rows(payload, axes), n, math.prod(chunk_shape), x.dtype)
    received = jnp.moveaxis(rows.reshape((n,) + chunk_shape), 0, concat_axis)
    if not tiled:
        return received
    shape = list(chunk_shape)
    shape[concat_axis] *= n
    return received.reshape(shape)


# ----------------------------------------------------------- custom VJPs
# Non-differentiable arguments (axes, codecs, layout) come first so that
# custom_vjp's nondiff_argnums stay static; `key` is an ordinary argument
# whose cotangent is None.

@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _psum_vjp(axes, codec, bwd_codec, x, key):
    return _allreduce(x, axes, codec, key)[0]


def _psum_fwd(axes, codec, bwd_codec, x, key):
    return _allreduce(x, axes, codec, key)[0], None


def _psum_bwd(axes, codec, bwd_codec, _, ct):
    # The transpose of an all-reduce into an invariant value is a broadcast: no traffic.
    return vary(ct, axes), None


_psum_vjp.defvjp(_psum_fwd, _psum_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _copy_vjp(axes, codec, bwd_codec, x, key):
    return lax.pcast(x, axes, to="varying")


def _copy_fwd(axes, codec, bwd_codec, x, key):
    return lax.pcast(x, axes, to="varying"), key


def _copy_bwd(axes, codec, bwd_codec, key, ct):
    return _allreduce(ct, axes, bwd_codec, key)[0], None


_copy_vjp.defvjp(_copy_fwd, _copy_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _gather_vjp(axes, codec, bwd_codec, layout, x, key):
    axis, tiled, to = layout
    return _gather(x, axes, codec, key, axis, tiled, to)


def _gather_fwd(axes, codec, bwd_codec, layout, x, key):
    return _gather(x, axes, codec, key, *layout), key


def _gather_bwd(axes, codec, bwd_codec, layout, key, ct):
    axis, tiled, to = layout
    kb = _bwd_key(key)
    if to == "invarying":
        # Every device holds the same gathered value: its slice of the cotangent is local.
        n = lax.axis_size(axes)
        rows = _to_gather_rows(ct, n, axis, tiled)
        own = lax.dynamic_index_in_dim(rows, lax.axis_index(axes), 0, keepdims=False)
        return vary(own, axes), None
    return _scatter(ct, axes, bwd_codec, kb, axis, tiled), None


def _to_gather_rows(ct, n, axis, tiled):
    if tiled:
        ct = ct.reshape(ct.shape[:axis] + (n, ct.shape[axis] // n) + ct.shape[axis + 1:])
    return jnp.moveaxis(ct, axis, 0)


_gather_vjp.defvjp(_gather_fwd, _gather_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _scatter_vjp(axes, codec, bwd_codec, layout, x, key):
    dim, tiled = layout
    return _scatter(x, axes, codec, key, dim, tiled)


def _scatter_fwd(axes, codec, bwd_codec, layout, x, key):
    return _scatter(x, axes, codec, key, *layout), key


def _scatter_bwd(axes, codec, bwd_codec, layout, key, ct):
    dim, tiled = layout
    kb = _bwd_key(key)
    return _gather(ct, axes, bwd_codec, kb, dim, tiled, "varying"), None


_scatter_vjp.defvjp(_scatter_fwd, _scatter_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _permute_vjp(axes, codec, bwd_codec, perm, x, key):
    return _permute(x, axes, codec, key, perm)


def _permute_fwd(axes, codec, bwd_codec, perm, x, key):
    return _permute(x, axes, codec, key, perm), key


def _permute_bwd(axes, codec, bwd_codec, perm, key, ct):
    kb = _bwd_key(key)
    inverse = tuple((dst, src) for src, dst in perm)
    return _permute(ct, axes, bwd_codec, kb, inverse), None


_permute_vjp.defvjp(_permute_fwd, _permute_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _exchange_vjp(axes, codec, bwd_codec, layout, x, key):
    split_axis, concat_axis, tiled = layout
    return _exchange(x, axes, codec, key, split_axis, concat_axis, tiled)


def _exchange_fwd(axes, codec, bwd_codec, layout, x, key):
    return _exchange(x, axes, codec, key, *layout), key


def _exchange_bwd(axes, codec, bwd_codec, layout, key, ct):
    split_axis, concat_axis, tiled = layout
    kb = _bwd_key(key)
    return _exchange(ct, axes, bwd_codec, kb, concat_axis, split_axis, tiled), None


_exchange_vjp.defvjp(_exchange_fwd, _exchange_bwd)


# ------------------------------------------------------------ public API

def _prepare(axis_name, codec, bwd_codec, key, axis_index_groups=None):
    """-> (axes, fwd codec, bwd codec, per-device key) or None when jax.lax should run."""
    fwd, bwd = _codec_pair(codec, bwd_codec)
    axes = _axes(axis_name)
    if fwd.kind == "identity" and bwd.kind == "identity":
        return None
    _check_groups(axis_index_groups, fwd)
    if lax.axis_size(axes) == 1:
        return None  # nothing crosses the wire over a size-1 axis
    _check_key(key, fwd, bwd)
    return axes, fwd, bwd, key


def psum(x, axis_name, *, axis_index_groups=None, codec="none", bwd_codec=None, key=None):
    """`jax.lax.psum` that sends `codec`-encoded chunks. Result: x's shape and dtype,
    invariant over `axis_name`. Its backward pass moves nothing (as for lax.psum)."""
    ready = _prepare(axis_name, codec, bwd_codec, key, axis_index_groups)
    if ready is None:
        return lax.psum(x, axis_name, axis_index_groups=axis_index_groups)
    axes, fwd, bwd, key = ready

    def one(leaf, k):
        invariant = tuple(a for a in axes if a not in _varying(leaf))
        if invariant:  # a sum of identical copies is a product: no traffic
            leaf = lax.psum(leaf, invariant)
        live = tuple(a for a in axes if a not in invariant)
        if not live:
            return leaf
        return _psum_vjp(live, fwd, bwd, leaf, _device_key(k, live, fwd))

    return _map(one, x, key)


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
    bwd = _parse(bwd_codec)
    axes = _axes(axis_name)

    def one(leaf, k):
        missing = tuple(a for a in axes if a not in _varying(leaf))
        if not missing:
            return leaf
        if bwd.kind == "identity" or lax.axis_size(missing) == 1:
            return lax.pcast(leaf, missing, to="varying")
        _check_key(k, bwd)
        return _copy_vjp(missing, bwd, bwd, leaf, _device_key(k, missing, bwd))

    return _map(one, x, key)


def all_gather(x, axis_name, *, axis_index_groups=None, axis=0, tiled=False, to="varying",
               codec="none", bwd_codec=None, key=None):
    """`jax.lax.all_gather` that sends the codec's payload. Backward: a compressed
    reduce-scatter with `bwd_codec` (to="varying") or a local slice (to="invarying")."""
    ready = _prepare(axis_name, codec, bwd_codec, key, axis_index_groups)
    if ready is None:
        return lax.all_gather(x, axis_name, axis_index_groups=axis_index_groups, axis=axis,
                              tiled=tiled, to=to)
    axes, fwd, bwd, key = ready
    if to not in ("varying", "invarying"):
        raise ValueError(f"all_gather: to={to!r} is not supported with compression; "
                         "allowed: 'varying', 'invarying'")

    def one(leaf, k):
        ax = axis % (leaf.ndim + (0 if tiled else 1))
        return _gather_vjp(axes, fwd, bwd, (ax, tiled, to), vary(leaf, axes),
                           _device_key(k, axes, fwd))

    return _map(one, x, key)


def psum_scatter(x, axis_name, *, scatter_dimension=0, axis_index_groups=None, tiled=False,
                 codec="none", bwd_codec=None, key=None):
    """`jax.lax.psum_scatter` as all_to_all of encoded chunks + float32 sum.
    Backward: compressed all_gather with `bwd_codec`."""
    ready = _prepare(axis_name, codec, bwd_codec, key, axis_index_groups)
    if ready is None:
        return lax.psum_scatter(x, axis_name, scatter_dimension=scatter_dimension,
                                axis_index_groups=axis_index_groups, tiled=tiled)
    axes, fwd, bwd, key = ready

    def one(leaf, k):
        dim = scatter_dimension % leaf.ndim
        return _scatter_vjp(axes, fwd, bwd, (dim, tiled), vary(leaf, axes),
                            _device_key(k, axes, fwd))

    return _map(one, x, key)


def ppermute(x, axis_name, perm, *, codec="none", bwd_codec=None, key=None):
    """`jax.lax.ppermute` of the payload. Backward: the inverse permutation, `bwd_codec`."""
    ready = _prepare(axis_name, codec, bwd_codec, key)
    if ready is None:
        return lax.ppermute(x, axis_name, perm)
    axes, fwd, bwd, key = ready
    perm = tuple((int(s), int(d)) for s, d in perm)
    return _map(lambda leaf, k: _permute_vjp(axes, fwd, bwd, perm, vary(leaf, axes),
                                             _device_key(k, axes, fwd)), x, key)


def all_to_all(x, axis_name, split_axis, concat_axis, *, axis_index_groups=None, tiled=False,
               codec="none", bwd_codec=None, key=None):
    """`jax.lax.all_to_all` of the payload. Backward: the reverse all_to_all, `bwd_codec`."""
    ready = _prepare(axis_name, codec, bwd_codec, key, axis_index_groups)
    if ready is None:
        return lax.all_to_all(x, axis_name, split_axis, concat_axis,
                              axis_index_groups=axis_index_groups, tiled=tiled)
    axes, fwd, bwd, key = ready

    def one(leaf, k):
        layout = (split_axis % leaf.ndim, concat_axis % leaf.ndim, tiled)
        return _exchange_vjp(axes, fwd, bwd, layout, vary(leaf, axes),
                             _device_key(k, axes, fwd))

    return _map(one, x, key)


# ------------------------------------------------------- error feedback

def psum_ef(x, residual, axis_name, *, codec, key=None):
    """Error-feedback all-reduce for gradients: sends codec(x + residual).

    -> (sum over the axis, new residual) where new residual = (x + residual) minus
    what this device's contribution was sent as. Carry the residual from step to
    step (same shape as x); start from zeros. Not differentiable (use on gradients).
    """
    return _ef(x, residual, axis_name, codec, key, _allreduce)


def psum_scatter_ef(x, residual, axis_name, *, scatter_dimension=0, tiled=False, codec,
                    key=None):
    """Error-feedback reduce-scatter (ZeRO-2 gradients). -> (shard of the sum, new residual)."""

    def kernel(leaf, axes, c, k):
        dim = scatter_dimension % leaf.ndim
        x_N = _scatter_rows(leaf, lax.axis_size(axes), dim, tiled)
        n, m = x_N.shape[0], math.prod(x_N.shape[1:])
        total, payload = _reduce_scatter_rows(x_N.reshape(n, m), axes, c, k)
        sent_NxM = _decode(c, payload, n, m, jnp.float32)
        sent = jnp.moveaxis(sent_NxM.reshape(x_N.shape), 0, dim).reshape(leaf.shape)
        return total.astype(leaf.dtype).reshape(x_N.shape[1:]), sent

    def exact(leaf):
        return lax.psum_scatter(leaf, axis_name, scatter_dimension=scatter_dimension, tiled=tiled)

    return _ef(x, residual, axis_name, codec, key, kernel, exact)


def _ef(x, residual, axis_name, codec, key, kernel, exact=None):
    c = _parse(codec)
    axes = _axes(axis_name)
    exact = exact or (lambda leaf: lax.psum(leaf, axis_name))
    if c.kind == "identity" or lax.axis_size(axes) == 1:
        total = jax.tree.map(lambda a, r: exact(a + r), x, residual)
        return total, jax.tree.map(jnp.zeros_like, residual)
    _check_key(key, c)
    leaves, treedef = jax.tree.flatten(x)
    res_leaves = treedef.flatten_up_to(residual)
    outs, news = [], []
    for leaf, res, k in zip(leaves, res_leaves, _leaf_keys(key, leaves)):
        corrected = lax.stop_gradient(vary(leaf + res.astype(leaf.dtype), axes))
        total, sent = kernel(corrected, axes, c, _device_key(k, axes, c))
        outs.append(total)
        news.append((corrected.astype(jnp.float32) - sent).astype(res.dtype))
    return jax.tree.unflatten(treedef, outs), jax.tree.unflatten(treedef, news)
