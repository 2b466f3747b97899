"""Coded collective kernels on flat rows, and the choice between coded and raw.

Inside `shard_map`, on rows `x_RxM` (R = 1 or G, the devices along `axes`):

  allreduce(x_1xM)       -> (sum 1xM, what this device was sent as 1xM f32)
  reduce_scatter(x_GxM)  -> (row r of the sum 1xM f32, what was sent GxM f32)
  gather(x_1xM, to)      -> GxM (row i from device i)
  permute(x_1xM, perm)   -> 1xM
  exchange(x_GxM)        -> GxM (row i from device i)

A payload travels as one uint8 buffer per row. `plan` (`allreduce_plan`, which
also picks the form) decides from static shapes whether the codec sends fewer
bytes than the raw rows; where not, the `jax.lax` op runs raw in the named scope
`RAW_SCOPE.format(codec)`, which jcomp.wire reports, and a warning says so.
"""
from __future__ import annotations

import sys
import warnings

import jax
import jax.numpy as jnp
from jax import lax

from jcomp import codecs as _codecs

RAW_SCOPE = "jcomp_raw({})"


class RawSendWarning(UserWarning):
    """A compressed collective sends its operand uncompressed: the codec cannot
    send fewer bytes at this size (see `jcomp.collectives.kernels.plan`)."""


def _caller_level() -> int:
    """stacklevel of the first frame outside jcomp.collectives and jax."""
    frame, level = sys._getframe(2), 2
    while frame is not None and frame.f_globals.get("__name__", "").startswith(
            ("jcomp.collectives", "jax", "contextlib")):
        frame, level = frame.f_back, level + 1
    return level


def vary(x, axes):
    """`x` marked varying over those of `axes` it does not vary over yet."""
    missing = tuple(a for a in axes if a not in jax.typeof(x).mat.varying)
    return lax.pcast(x, missing, to="varying") if missing else x


def axes_of(axis_name) -> tuple:
    return tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)


def parse(codec):
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


def check_key(key, *codecs):
    for c in codecs:
        if c.needs_key and key is None:
            raise ValueError(
                f"codec {str(c)!r} draws random numbers: pass key= (a jax.random key)")


def device_key(key, axes, codec):
    """Per-device randomness: stochastic rounding must not repeat across devices.
    Rand-k keeps one key for all devices so every device picks the same entries."""
    if key is None or codec.name == "randk":
        return key
    return jax.random.fold_in(key, lax.axis_index(axes))


def rows_along(x, n, dim, tiled, what):
    """Splits `x` along `dim` into n pieces (psum_scatter's and all_to_all's split) -> [n, *piece]."""
    if tiled:
        if x.shape[dim] % n:
            raise ValueError(f"{what}: dimension {dim} of size {x.shape[dim]} "
                             f"is not divisible by the axis size {n}")
        x = x.reshape(x.shape[:dim] + (n, x.shape[dim] // n) + x.shape[dim + 1:])
    elif x.shape[dim] != n:
        raise ValueError(f"{what}: dimension {dim} has size {x.shape[dim]}; "
                         f"tiled=False needs the axis size {n}")
    return jnp.moveaxis(x, dim, 0)


def stack_along(rows_N, dim, tiled):
    """Inverse of `rows_along`: [n, *piece] -> the pieces placed along `dim`."""
    placed = jnp.moveaxis(rows_N, 0, dim)
    if not tiled:
        return placed
    shape = list(rows_N.shape[1:])
    shape[dim] *= rows_N.shape[0]
    return placed.reshape(shape)


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def plan(codec, rows: int, m: int, dtype):
    """The codec (fitted to the row length) a collective sends `rows` x `m`
    elements with, or None where it cannot send fewer bytes than the raw
    elements. (An all-reduce chooses its form as well: `allreduce_plan`.)"""
    if codec.kind == "identity":
        return None
    fitted = _codecs.fit(codec, m)
    coded = fitted.wire_bytes((rows, m), dtype)
    return fitted if coded < rows * m * jnp.dtype(dtype).itemsize else None


def allreduce_plan(codec, m: int, n: int, dtype):
    """(form, codec fitted to it, elements per coded row) for an all-reduce of m
    elements over n devices, or None where no form sends fewer bytes per device
    than lax.psum's 2(n-1)/n rows.

      "owners"  all_to_all of n coded chunks (m/n, whole blocks), each owner
                sums its chunk and all_gathers the coded sum: (n-1)/n of n coded
                chunks, twice.
      "gather"  all_gather of every device's coded row (m padded to whole
                blocks), and every device sums the n rows: (n-1) coded rows.

    "gather" wins wherever it sends no more bytes: at n = 2 always (both send
    one coded row), with one collective instead of two and one quantization
    instead of two (the owners' re-coding of their sums is gone)."""
    if codec.kind == "identity":
        return None
    per_owner = max(-(-m // n), 1)
    c = _round_up(per_owner, _codecs.fit(codec, per_owner).row_multiple)
    owners = _codecs.fit(codec, c)
    owners_bytes = (n - 1) / n * (owners.wire_bytes((n, c), dtype)
                                  + n * owners.wire_bytes((1, c), dtype))
    gather = _codecs.fit(codec, m)
    g = _round_up(m, gather.row_multiple)
    gather_bytes = (n - 1) * gather.wire_bytes((1, g), dtype)
    form, fitted, length, coded = (("gather", gather, g, gather_bytes)
                                   if gather_bytes <= owners_bytes
                                   else ("owners", owners, c, owners_bytes))
    raw = 2 * (n - 1) / n * m * jnp.dtype(dtype).itemsize
    return (form, fitted, length) if coded < raw else None


# ---------------------------------------------------------------- payloads

def _view(codec, m: int) -> tuple:
    """The shape a row of m elements is coded in: (m/u, u), or (m,) if u does not
    divide m (the same bytes). In that shape XLA:CPU's fused encode and decode
    vectorise; a flat row in int4/int2's packing fusion ran 3-4x slower."""
    u = codec.row_multiple
    return (m // u, u) if codec.kind == "dense" and u > 1 and m % u == 0 else (m,)


def encode(codec, x_RxM, key):
    r, m = x_RxM.shape
    return codec.encode(x_RxM.reshape((r,) + _view(codec, m)), key=key)


def decode(codec, payload, r: int, m: int, dtype):
    return codec.decode(payload, (r,) + _view(codec, m), dtype).reshape(r, m)


def _as_bytes(payload):
    """A payload as one uint8 buffer [R, bytes] and the function that restores it."""
    leaves, treedef = jax.tree.flatten(payload)
    if len(leaves) == 1:
        return leaves[0], lambda buf: jax.tree.unflatten(treedef, [buf])
    parts, metas = [], []
    for a in leaves:
        b = a if a.dtype == jnp.uint8 else lax.bitcast_convert_type(a, jnp.uint8)
        parts.append(b.reshape(a.shape[0], -1))
        metas.append((a.shape[1:], a.dtype, parts[-1].shape[1]))

    def restore(buf_RxB):
        r, out, off = buf_RxB.shape[0], [], 0
        for tail, dtype, nbytes in metas:
            piece = buf_RxB[:, off:off + nbytes]
            off += nbytes
            size = jnp.dtype(dtype).itemsize
            if size == 1:
                out.append(piece.reshape((r,) + tail))
            else:
                out.append(lax.bitcast_convert_type(piece.reshape((r,) + tail + (size,)), dtype))
        return jax.tree.unflatten(treedef, out)

    return jnp.concatenate(parts, axis=1), restore


def _send(payload, op):
    buf, restore = _as_bytes(payload)
    return restore(op(buf))


def _all_to_all(payload, axes):
    return _send(payload, lambda a: lax.all_to_all(a, axes, 0, 0, tiled=True))


def _all_gather(payload, axes):
    return _send(payload, lambda a: lax.all_gather(a, axes, axis=0, tiled=True, to="invarying"))


def _sum_rows(codec, payload, n: int, m: int):
    """The n decoded rows of `payload` summed in float32 -> [m]."""
    if codec.kind == "sparse":
        values, indices = payload["values"], payload["indices"]
        return jnp.zeros((m,), jnp.float32).at[indices.reshape(-1)].add(
            values.reshape(-1).astype(jnp.float32))
    if getattr(codec, "rot", False):
        return codec.from_basis(_sum_in_basis(codec, payload, n), _view(codec, m),
                                jnp.float32).reshape(m)
    rows = [codec.decode(jax.tree.map(lambda a: a[i], payload), _view(codec, m), jnp.float32)
            for i in range(n)]
    return _add_all(rows).reshape(m)


def _sum_in_basis(codec, payload, n: int):
    """The n rows of `payload` summed in the codec's rotated basis -> float32 blocks.
    A rotation is linear, so the sum of rotated rows is the rotation of their sum:
    summing first runs the inverse rotation once instead of once per row."""
    return _add_all([codec.decode_basis(jax.tree.map(lambda a: a[i], payload))
                     for i in range(n)])


def _add_all(rows):
    """Sum of same-shaped arrays as a tree of elementwise adds: XLA:CPU compiles a
    reduction over the leading axis of a fused decode 7-10x slower."""
    while len(rows) > 1:
        pairs = [a + b for a, b in zip(rows[0::2], rows[1::2])]
        rows = pairs + rows[len(pairs) * 2:]
    return rows[0]


# ---------------------------------------------------------------- kernels

def _raw(op, codec, m, n, dtype, fn, *args):
    """The lax op on the raw rows; for a real codec, marked and warned about."""
    if codec.kind == "identity":
        return fn(*args)
    warnings.warn(
        f"jcomp.collectives.{op}: codec {str(codec)!r} cannot send fewer bytes than the "
        f"uncompressed operand ({m} {jnp.dtype(dtype).name} elements per row over "
        f"{n} devices); this call sends it raw", RawSendWarning, stacklevel=_caller_level())
    with jax.named_scope(RAW_SCOPE.format(codec)):
        return fn(*args)


def allreduce(x_1xM, axes, codec, key, *, op="psum"):
    """Sum over `axes` -> (1xM in x's dtype, 1xM f32 that this device's x was sent as),
    in the form `allreduce_plan` picks. Sparse codecs send each row's (or chunk's)
    top entries: 2F of the raw bytes at any n. A rotated codec sums in its rotated
    basis: the rotation runs on the sender's row and once on the sum."""
    n, m, dtype = lax.axis_size(axes), x_1xM.shape[1], x_1xM.dtype
    chosen = allreduce_plan(codec, m, n, dtype)
    if chosen is None:
        return _raw(op, codec, m, n, dtype, lax.psum, x_1xM, axes), x_1xM.astype(jnp.float32)
    form, fitted, length = chosen
    if form == "gather":
        return _allreduce_gathered(x_1xM, axes, fitted, length, key)
    return _allreduce_owners(x_1xM, axes, fitted, length, key)


def _padded_rows(x_1xM, rows: int, length: int):
    x_flat = x_1xM.reshape(-1)
    if rows * length != x_flat.shape[0]:
        x_flat = jnp.pad(x_flat, (0, rows * length - x_flat.shape[0]))
    return x_flat.reshape(rows, length)


def _allreduce_gathered(x_1xM, axes, fitted, g, key):
    """Every device all_gathers the coded rows (g elements each) and sums all n of
    them, in one order on every device, so the sum is the same everywhere."""
    n, m, dtype = lax.axis_size(axes), x_1xM.shape[1], x_1xM.dtype
    payload = encode(fitted, _padded_rows(x_1xM, 1, g), key)
    total = _sum_rows(fitted, _all_gather(payload, axes), n, g)
    # Only error feedback reads `sent`; elsewhere XLA removes its computation.
    sent = decode(fitted, payload, 1, g, jnp.float32)
    return total[None, :m].astype(dtype), sent[:, :m]


def _allreduce_owners(x_1xM, axes, fitted, c, key):
    """Device j sums chunk j (c elements) of every device (all_to_all of coded
    chunks, float32 sum), re-codes it and all_gathers the coded sums; a rotated
    codec's owner sums and re-codes in the rotated basis."""
    n, m, dtype = lax.axis_size(axes), x_1xM.shape[1], x_1xM.dtype
    k1, k2 = (None, None) if key is None else tuple(jax.random.split(key))
    payload = encode(fitted, _padded_rows(x_1xM, n, c), k1)
    received = _all_to_all(payload, axes)
    if getattr(fitted, "rot", False):  # the owner's sum is coded again in the basis it came in
        own_B = _sum_in_basis(fitted, received, n)
        own_C = fitted.from_basis(own_B, _view(fitted, c), jnp.float32).reshape(c)
        coded = fitted.encode_basis(own_B[None], key=k2)
    else:
        own_C = _sum_rows(fitted, received, n, c)
        coded = encode(fitted, own_C[None], k2)
    gathered = _all_gather(coded, axes)
    total_GxC = decode(fitted, gathered, n, c, jnp.float32)
    # The owner also re-codes its sum; charging that error to the owner's row keeps
    # "sum of what was sent == total" exact, so error feedback repairs both phases.
    me = lax.axis_index(axes)
    shortfall_C = lax.dynamic_index_in_dim(total_GxC, me, 0, keepdims=False) - own_C
    mine_Gx1 = (jnp.arange(n) == me)[:, None]
    sent_GxC = decode(fitted, payload, n, c, jnp.float32) + jnp.where(
        mine_Gx1, shortfall_C[None], 0.0)
    total = total_GxC.reshape(1, -1)[:, :m].astype(dtype)
    return total, sent_GxC.reshape(1, -1)[:, :m]


def reduce_scatter(x_GxM, axes, codec, key, *, op="psum_scatter"):
    """Row j of every device's x_GxM summed onto device j -> (1xM f32, sent GxM f32)."""
    n, m, dtype = x_GxM.shape[0], x_GxM.shape[1], x_GxM.dtype
    fitted = plan(codec, n, m, dtype)
    if fitted is None:
        total = _raw(op, codec, m, n, dtype, lambda a: lax.psum_scatter(a, axes, scatter_dimension=0,
                                                           tiled=True), x_GxM)
        return total.astype(jnp.float32), x_GxM.astype(jnp.float32)
    payload = encode(fitted, x_GxM, key)
    total = _sum_rows(fitted, _all_to_all(payload, axes), n, m)
    return total[None], decode(fitted, payload, n, m, jnp.float32)


def _moved(op, x_RxM, axes, codec, key, send, rows_out: int):
    """`send` (a jax.lax op on arrays) of x's coded payload, decoded to rows_out x M
    of x's dtype; the raw rows where the codec cannot send fewer bytes."""
    r, m, dtype = x_RxM.shape[0], x_RxM.shape[1], x_RxM.dtype
    fitted = plan(codec, r, m, dtype)
    if fitted is None:
        return _raw(op, codec, m, lax.axis_size(axes), dtype, send, x_RxM)
    return decode(fitted, _send(encode(fitted, x_RxM, key), send), rows_out, m, dtype)


def gather(x_1xM, axes, codec, key, to):
    """Every device's row -> GxM of x's dtype; invariant over `axes` if to="invarying"."""
    return _moved("all_gather", x_1xM, axes, codec, key,
                  lambda a: lax.all_gather(a, axes, axis=0, tiled=True, to=to), lax.axis_size(axes))


def permute(x_1xM, axes, codec, key, perm):
    return _moved("ppermute", x_1xM, axes, codec, key, lambda a: lax.ppermute(a, axes, perm), 1)


def exchange(x_GxM, axes, codec, key, _=None):
    return _moved("all_to_all", x_GxM, axes, codec, key,
                  lambda a: lax.all_to_all(a, axes, 0, 0, tiled=True), x_GxM.shape[0])
