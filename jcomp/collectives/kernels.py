"""Coded collective kernels on flat rows, and the choice between coded and raw.

Inside `shard_map`, on buffers `x_RxC` (R = 1 or G, the devices along `axes`):

  allreduce(x_1xC)       -> (sum 1xC, what this device was sent as 1xC f32)
  reduce_scatter(x_GxC)  -> (row r of the sum 1xC f32, what was sent GxC f32)
  gather(x_1xC, to)      -> GxC (row i from device i)
  permute(x_1xC, perm)   -> 1xC
  exchange(x_GxC)        -> GxC (row i from device i)

`row` is the length of the rows a codec codes each on its own: a block, scale,
rotation or top-k selection never spans two of them (C is a multiple of
`row`): a leaf's last axis, or in `rows="flat"` buckets one block or one
leaf (`arguments.flat_group`). None codes each buffer row of C elements as one flat
vector (a cast's flat bucket, where no element depends on another).

A payload travels as one uint8 buffer per buffer row. `plan` (`allreduce_plan`, which
also picks the form) decides from static shapes whether the codec sends fewer
bytes than the raw rows; where not, the `jax.lax` op runs raw in the named scope
`RAW_SCOPE.format(codec)`, which jcomp.meter.wire reports, and a warning says so.
"""
from __future__ import annotations

import warnings
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jcomp import codecs as _codecs
from jcomp.collectives.arguments import RawSendWarning, caller_level
from jcomp.meter.scope import RAW_SCOPE



def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _fitted(codec, m: int, row):
    """`codec` fitted to the rows it codes: rows of `row` elements, or the flat m."""
    return _codecs.fit(codec, m) if row is None else _codecs.fit_row(codec, row)


def _coded_bytes(fitted, rows: int, m: int, row, dtype) -> int:
    return fitted.wire_bytes((rows, m) if row is None else (rows * (m // row), row), dtype)


def plan(codec, rows: int, m: int, dtype, row=None):
    """The codec (fitted to the row length) a collective sends `rows` x `m`
    elements with, or None where it cannot send fewer bytes than the raw
    elements. (An all-reduce chooses its form as well: `allreduce_plan`.)"""
    if codec.kind == "identity":
        return None
    fitted = _fitted(codec, m, row)
    coded = _coded_bytes(fitted, rows, m, row, dtype)
    return fitted if coded < rows * m * jnp.dtype(dtype).itemsize else None


class Form(NamedTuple):
    """How an all-reduce sends: `name` "gather" or "owners", the codec fitted to
    its coded rows, `length` elements per buffer row sent (m for gather, one
    owner's chunk for owners), `row` the coded row (None: the buffer row, flat),
    and `split`: owners get 1/n of every row (rows of `row` elements each)
    rather than whole rows."""
    name: str
    codec: Any
    length: int
    row: int | None = None
    split: bool = False


def allreduce_plan(codec, m: int, n: int, dtype, row=None):
    """The `Form` of an all-reduce of m elements over n devices, or None where no
    form sends fewer bytes per device than lax.psum's 2(n-1)/n rows.

      "owners"  all_to_all of n coded chunks (m/n, whole blocks), each owner
                sums its chunk and all_gathers the coded sum: (n-1)/n of n coded
                chunks, twice.
      "gather"  all_gather of every device's coded row (m padded to whole
                blocks), and every device sums the n rows: (n-1) coded rows.

    "gather" wins wherever it sends no more bytes: at n = 2 always (both send
    one coded row), with one collective instead of two and one quantization
    instead of two (the owners' re-coding of their sums is gone). With `row`,
    an owner's chunk is whole rows (the last chunk padded with zero rows) or,
    where that sends fewer bytes (fewer rows than owners, say), the n-th part
    of every row."""
    if codec.kind == "identity":
        return None
    raw = 2 * (n - 1) / n * m * jnp.dtype(dtype).itemsize
    forms = _forms_flat(codec, m, n, dtype) if row is None else _forms_rows(codec, m, n, dtype,
                                                                            row)
    coded, form = min(forms, key=lambda f: f[0])  # ties: the first, gather
    return form if coded < raw else None


def _forms_flat(codec, m: int, n: int, dtype):
    per_owner = max(-(-m // n), 1)
    c = _round_up(per_owner, _codecs.fit(codec, per_owner).row_multiple)
    owners = _codecs.fit(codec, c)
    owners_bytes = (n - 1) / n * (owners.wire_bytes((n, c), dtype)
                                  + n * owners.wire_bytes((1, c), dtype))
    gather = _codecs.fit(codec, m)
    g = _round_up(m, gather.row_multiple)
    return [((n - 1) * gather.wire_bytes((1, g), dtype), Form("gather", gather, g)),
            (owners_bytes, Form("owners", owners, c))]


def _forms_rows(codec, m: int, n: int, dtype, row: int):
    nrows, fitted = m // row, _codecs.fit_row(codec, row)
    c = -(-nrows // n) * row  # whole rows per owner
    piece = max(-(-row // n), 1)  # or 1/n of every row
    split = _codecs.fit_row(codec, piece)
    per_owner = lambda f, r, k: (n - 1) / n * (f.wire_bytes((n * k, r), dtype)
                                               + n * f.wire_bytes((k, r), dtype))
    return [((n - 1) * fitted.wire_bytes((nrows, row), dtype), Form("gather", fitted, m, row)),
            (per_owner(fitted, row, c // row), Form("owners", fitted, c, row)),
            (per_owner(split, piece, nrows), Form("owners", split, nrows * piece, piece, True))]


# ---------------------------------------------------------------- payloads

def _view(codec, m: int, row=None) -> tuple:
    """The shape a buffer row of m elements is coded in: (m/row, row) with `row`;
    flat, (m/u, u), or (m,) if u does not divide m (the same bytes). In that
    shape XLA:CPU's fused encode and decode vectorise; a flat row in int4/int2's
    packing fusion ran 3-4x slower."""
    if row is not None:
        return (m // row, row)
    u = codec.row_multiple
    if getattr(codec, "row_scale", False):  # rows of u would each carry a row scale
        return (m,)
    return (m // u, u) if codec.kind == "dense" and u > 1 and m % u == 0 else (m,)


def encode(codec, x_RxC, key, row=None):
    r, m = x_RxC.shape
    return codec.encode(x_RxC.reshape((r,) + _view(codec, m, row)), key=key)


def decode(codec, payload, r: int, m: int, dtype, row=None):
    return codec.decode(payload, (r,) + _view(codec, m, row), dtype).reshape(r, m)


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


def _sum_rows(codec, payload, n: int, m: int, row=None):
    """The n decoded buffer rows of `payload` summed in float32 -> [m]."""
    if codec.kind == "sparse":  # indices count within each coded row
        k = payload["values"].shape[-1]
        values_NxRxK = payload["values"].reshape(n, -1, k)
        per_row = values_NxRxK.shape[1]
        offset_Rx1 = (jnp.arange(per_row, dtype=jnp.int32) * (m // per_row))[:, None]
        index_NxRxK = payload["indices"].reshape(n, per_row, k) + offset_Rx1
        return jnp.zeros((m,), jnp.float32).at[index_NxRxK.reshape(-1)].add(
            values_NxRxK.reshape(-1).astype(jnp.float32))
    if getattr(codec, "rot", False):
        return codec.from_basis(_sum_in_basis(codec, payload, n), _view(codec, m, row),
                                jnp.float32).reshape(m)
    rows = [codec.decode(jax.tree.map(lambda a: a[i], payload), _view(codec, m, row),
                         jnp.float32) for i in range(n)]
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

def _raw(op, codec, m, n, dtype, fn, *args, row=None):
    """The lax op on the raw rows; for a real codec, marked and warned about."""
    if codec.kind == "identity":
        return fn(*args)
    what = (f"{m} {jnp.dtype(dtype).name} elements per row" if row is None else
            f"rows of {row} {jnp.dtype(dtype).name} elements, each coded on its own")
    warnings.warn(
        f"jcomp.collectives.{op}: codec {str(codec)!r} cannot send fewer bytes than the "
        f"uncompressed operand ({what}, over {n} devices); this call sends it raw",
        RawSendWarning, stacklevel=caller_level())
    with jax.named_scope(RAW_SCOPE.format(codec)):
        return fn(*args)


def allreduce(x_1xC, axes, codec, key, *, op="psum", row=None):
    """Sum over `axes` -> (1xC in x's dtype, 1xC f32 that this device's x was sent as),
    in the form `allreduce_plan` picks. Sparse codecs send each row's (or chunk's)
    top entries: 2F of the raw bytes at any n. A rotated codec sums in its rotated
    basis: the rotation runs on the sender's row and once on the sum."""
    n, m, dtype = lax.axis_size(axes), x_1xC.shape[1], x_1xC.dtype
    form = allreduce_plan(codec, m, n, dtype, row)
    if form is None:
        return (_raw(op, codec, m, n, dtype, lax.psum, x_1xC, axes, row=row),
                x_1xC.astype(jnp.float32))
    if form.name == "gather":
        return _allreduce_gathered(x_1xC, axes, form.codec, form.length, key, form.row)
    return _allreduce_owners(x_1xC, axes, form, key, row)


def _padded_rows(x_1xC, rows: int, length: int):
    x_flat = x_1xC.reshape(-1)
    if rows * length != x_flat.shape[0]:
        x_flat = jnp.pad(x_flat, (0, rows * length - x_flat.shape[0]))
    return x_flat.reshape(rows, length)


def _allreduce_gathered(x_1xC, axes, fitted, g, key, row=None):
    """Every device all_gathers the coded rows (g elements each) and sums all n of
    them, in one order on every device, so the sum is the same everywhere."""
    n, m, dtype = lax.axis_size(axes), x_1xC.shape[1], x_1xC.dtype
    payload = encode(fitted, _padded_rows(x_1xC, 1, g), key, row)
    total = _sum_rows(fitted, _all_gather(payload, axes), n, g, row)
    # Only error feedback reads `sent`; elsewhere XLA removes its computation.
    sent = decode(fitted, payload, 1, g, jnp.float32, row)
    return total[None, :m].astype(dtype), sent[:, :m]


def _owner_chunks(x_1xC, n: int, form, row):
    """x as the n owners' chunks [n, c]: consecutive elements, or with
    `form.split` the j-th n-th part of every row of `row` elements (each row
    zero-padded to n parts)."""
    if not form.split:
        return _padded_rows(x_1xC, n, form.length)
    piece = form.row
    x_RxC = x_1xC.reshape(-1, row)
    if n * piece != row:
        x_RxC = jnp.pad(x_RxC, ((0, 0), (0, n * piece - row)))
    return jnp.swapaxes(x_RxC.reshape(-1, n, piece), 0, 1).reshape(n, -1)


def _from_owner_chunks(y_GxC, m: int, form, row):
    """Inverse of `_owner_chunks` -> [1, m]."""
    if not form.split:
        return y_GxC.reshape(1, -1)[:, :m]
    n, piece = y_GxC.shape[0], form.row
    y_RxC = jnp.swapaxes(y_GxC.reshape(n, -1, piece), 0, 1).reshape(-1, n * piece)
    return y_RxC[:, :row].reshape(1, m)


def _allreduce_owners(x_1xC, axes, form, key, row=None):
    """Device j sums chunk j (c elements) of every device (all_to_all of coded
    chunks, float32 sum), re-codes it and all_gathers the coded sums; a rotated
    codec's owner sums and re-codes in the rotated basis."""
    n, m, dtype = lax.axis_size(axes), x_1xC.shape[1], x_1xC.dtype
    fitted, c, crow = form.codec, form.length, form.row
    k1, k2 = (None, None) if key is None else tuple(jax.random.split(key))
    payload = encode(fitted, _owner_chunks(x_1xC, n, form, row), k1, crow)
    received = _all_to_all(payload, axes)
    if getattr(fitted, "rot", False):  # the owner's sum is coded again in the basis it came in
        own_B = _sum_in_basis(fitted, received, n)
        own_C = fitted.from_basis(own_B, _view(fitted, c, crow), jnp.float32).reshape(c)
        coded = fitted.encode_basis(own_B[None], key=k2)
    else:
        own_C = _sum_rows(fitted, received, n, c, crow)
        coded = encode(fitted, own_C[None], k2, crow)
    gathered = _all_gather(coded, axes)
    total_GxC = decode(fitted, gathered, n, c, jnp.float32, crow)
    # The owner also re-codes its sum; charging that error to the owner's row keeps
    # "sum of what was sent == total" exact, so error feedback repairs both phases.
    me = lax.axis_index(axes)
    shortfall_C = lax.dynamic_index_in_dim(total_GxC, me, 0, keepdims=False) - own_C
    mine_Gx1 = (jnp.arange(n) == me)[:, None]
    sent_GxC = decode(fitted, payload, n, c, jnp.float32, crow) + jnp.where(
        mine_Gx1, shortfall_C[None], 0.0)
    total = _from_owner_chunks(total_GxC, m, form, row).astype(dtype)
    return total, _from_owner_chunks(sent_GxC, m, form, row)


def reduce_scatter(x_GxC, axes, codec, key, *, op="psum_scatter", row=None):
    """Row j of every device's x_GxC summed onto device j -> (1xC f32, sent GxC f32)."""
    n, m, dtype = x_GxC.shape[0], x_GxC.shape[1], x_GxC.dtype
    fitted = plan(codec, n, m, dtype, row)
    if fitted is None:
        total = _raw(op, codec, m, n, dtype, lambda a: lax.psum_scatter(a, axes, scatter_dimension=0,
                                                           tiled=True), x_GxC, row=row)
        return total.astype(jnp.float32), x_GxC.astype(jnp.float32)
    payload = encode(fitted, x_GxC, key, row)
    total = _sum_rows(fitted, _all_to_all(payload, axes), n, m, row)
    return total[None], decode(fitted, payload, n, m, jnp.float32, row)


def _moved(op, x_RxC, axes, codec, key, send, rows_out: int, row):
    """`send` (a jax.lax op on arrays) of x's coded payload, decoded to rows_out x C
    of x's dtype; the raw rows where the codec cannot send fewer bytes."""
    r, m, dtype = x_RxC.shape[0], x_RxC.shape[1], x_RxC.dtype
    fitted = plan(codec, r, m, dtype, row)
    if fitted is None:
        return _raw(op, codec, m, lax.axis_size(axes), dtype, send, x_RxC, row=row)
    return decode(fitted, _send(encode(fitted, x_RxC, key, row), send), rows_out, m, dtype, row)


def gather(x_1xC, axes, codec, key, to, row=None):
    """Every device's row -> GxC of x's dtype; invariant over `axes` if to="invarying"."""
    return _moved("all_gather", x_1xC, axes, codec, key,
                  lambda a: lax.all_gather(a, axes, axis=0, tiled=True, to=to),
                  lax.axis_size(axes), row)


def permute(x_1xC, axes, codec, key, perm, row=None):
    return _moved("ppermute", x_1xC, axes, codec, key, lambda a: lax.ppermute(a, axes, perm), 1,
                  row)


def exchange(x_GxC, axes, codec, key, row=None):
    return _moved("all_to_all", x_GxC, axes, codec, key,
                  lambda a: lax.all_to_all(a, axes, 0, 0, tiled=True), x_GxC.shape[0], row)
