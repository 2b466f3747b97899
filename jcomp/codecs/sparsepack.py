"""A sparse chunk packed near its entropy: the positions of its k kept entries
and their values on 2 bits (SparseLoCo's payload, `jcomp.collectives.outer.sparseloco`).

Positions. The k kept positions of a chunk of c, sorted, carry about
log2 C(c, k) bits. They are sent as an Elias-Fano code, or as a bitmap where
that is smaller, chosen by size from (c, k) alone, so the payload's shape is
fixed at trace time:

- **Elias-Fano** (the sorted gaps' Rice code, laid out to decode in parallel):
  with r = floor(log2(c / k)), position p_i (i = 0..k-1, ascending) sends its
  low r bits as they are, and its high part p_i >> r in unary: bit
  (p_i >> r) + i of an upper bit vector of k + ((c - 1) >> r) + 1 bits is set.
  Total k (r + 1) + ((c - 1) >> r) + 1 bits: at most 2 + log2(c / k) bits a
  position, for every set of positions (the bound holds for any gaps). At
  k = 256 of 4096: 192 B, against 174 B of entropy and 512 B of uint16.
- **Bitmap**: c bits, one per entry; smaller from about k = c / 4 on.

Decoding is exact: the i-th set bit of the upper vector at j gives
p_i = ((j - i) << r) | low_i.

Values, 2 bits each (4 levels): a sign bit and a magnitude bit. The chunk's
two magnitudes come from one Lloyd step from the mean: t = mean |v| over the
kept entries; `hi` is the mean |v| of those with |v| >= t, `lo` the mean of
the rest (t itself where a group is empty), both float32. An entry decodes to
+-hi or +-lo, so all four levels carry information and none is spent on zero
(every kept entry is one of the chunk's largest). A NaN in a chunk makes its
scales NaN (every entry of the chunk decodes to NaN); an Inf stays Inf.
"""
from __future__ import annotations

import jax.numpy as jnp

VALUE_BITS = 2  # sign and magnitude
SCALES = 2      # lo and hi, float32, per chunk


def low_bits(c: int, k: int) -> int:
    """Elias-Fano's r for k positions of c: floor(log2(c / k)), at least 0."""
    return max((c // k).bit_length() - 1, 0)


def uses_bitmap(c: int, k: int) -> bool:
    """Whether a bitmap (c bits) is no larger than the Elias-Fano code."""
    return c <= _ef_bits(c, k)


def _ef_bits(c: int, k: int) -> int:
    r = low_bits(c, k)
    return k * r + k + ((c - 1) >> r) + 1


def position_bytes(c: int, k: int) -> int:
    """Bytes of one chunk's positions."""
    return -(-(c if uses_bitmap(c, k) else _ef_bits(c, k)) // 8)


def value_bytes(k: int) -> int:
    """Bytes of one chunk's values and its two float32 scales."""
    return -(-VALUE_BITS * k // 8) + 4 * SCALES


def encode_positions(idx_RxK, c: int):
    """Sorted (ascending) positions int32 [R, k] in [0, c) -> uint8 [R, position_bytes]."""
    r_rows, k = idx_RxK.shape
    rows = jnp.arange(r_rows)[:, None]
    if uses_bitmap(c, k):
        bits = jnp.zeros((r_rows, c), jnp.uint8).at[rows, idx_RxK].set(1)
        return jnp.packbits(bits, axis=-1)
    r = low_bits(c, k)
    low = ((idx_RxK[..., None] >> jnp.arange(r)) & 1).astype(jnp.uint8).reshape(r_rows, k * r)
    upper = jnp.zeros((r_rows, k + ((c - 1) >> r) + 1), jnp.uint8).at[
        rows, (idx_RxK >> r) + jnp.arange(k)].set(1)
    return jnp.packbits(jnp.concatenate([low, upper], axis=-1), axis=-1)


def decode_positions(code_RxB, c: int, k: int):
    """encode_positions' bytes -> the positions, int32 [R, k], ascending."""
    if uses_bitmap(c, k):
        return _set_bits(jnp.unpackbits(code_RxB, axis=-1, count=c), k)
    r = low_bits(c, k)
    bits = jnp.unpackbits(code_RxB, axis=-1, count=_ef_bits(c, k)).astype(jnp.int32)
    low = (bits[:, : k * r].reshape(-1, k, r) << jnp.arange(r)).sum(-1)
    high = _set_bits(bits[:, k * r:], k) - jnp.arange(k)
    return (high << r) | low


def _set_bits(bits_RxN, k: int):
    """Where the k set bits of every row are, ascending -> int32 [R, k]."""
    r_rows, n = bits_RxN.shape
    on = bits_RxN.astype(bool)
    rank = jnp.where(on, jnp.cumsum(on, axis=-1, dtype=jnp.int32) - 1, k)  # k: dropped
    rows = jnp.arange(r_rows)[:, None]
    where = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (r_rows, n))
    return jnp.zeros((r_rows, k), jnp.int32).at[rows, rank].set(where, mode="drop")


def encode_values(v_RxK):
    """float32 [R, k] -> {"q": uint8 [R, ceil(k/4)], "scale": float32 [R, 2] (lo, hi)}."""
    a = jnp.abs(v_RxK)
    t = jnp.mean(a, axis=-1, keepdims=True)
    big = a >= t
    hi = _mean_where(a, big, t)
    lo = _mean_where(a, ~big, t)
    bits = jnp.stack([jnp.signbit(v_RxK) & (v_RxK != 0), big], axis=-1).astype(jnp.uint8)
    return {"q": jnp.packbits(bits.reshape(v_RxK.shape[0], -1), axis=-1),
            "scale": jnp.concatenate([lo, hi], axis=-1)}


def decode_values(payload, k: int):
    """encode_values' payload -> float32 [R, k]."""
    bits = jnp.unpackbits(payload["q"], axis=-1, count=VALUE_BITS * k).reshape(-1, k, 2)
    lo, hi = payload["scale"][:, :1], payload["scale"][:, 1:]
    mag = jnp.where(bits[..., 1] == 1, hi, lo)
    return jnp.where(bits[..., 0] == 1, -mag, mag)


def _mean_where(a, mask, fallback):
    n = mask.sum(axis=-1, keepdims=True)
    total = jnp.where(mask, a, 0.0).sum(axis=-1, keepdims=True)
    # A NaN never belongs to either group (comparisons with NaN are false), so a
    # chunk holding one must still come out NaN: through the fallback t.
    out = jnp.where(n > 0, total / jnp.maximum(n, 1), fallback)
    return jnp.where(jnp.isnan(fallback), fallback, out)
