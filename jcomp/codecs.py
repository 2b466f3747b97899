"""Codecs: what a compressed collective actually puts on the wire.

A codec is a small immutable object. It codes each slice along the *last*
axis of its input independently, so a collective can split a buffer into one
row per peer (`x_NxC`) and encode all rows at once:

  payload = codec.encode(x_RxC, key=None)   # pytree of arrays, leading dims R
  x_RxC   = codec.decode(payload, (R, C), dtype)
  nbytes  = codec.wire_bytes((R, C), dtype) # exact bytes of `payload`

Leading dimensions are arbitrary (`x` of shape (*lead, C) gives payload leaves
with leading dims `lead`); a 0-d input is coded as shape (1,).

`kind` tells a collective how partial results combine:
  "identity": no coding at all; collectives call `jax.lax` unchanged.
  "dense":    payload rows can be decoded, summed in float32 and re-encoded.
  "sparse":   payload is (values, indices); sums are scatter-adds.

`row_multiple` is the row length that codes without padding: a collective that
chooses its row length C as a multiple of it sends no padding bytes.

Codecs with `needs_key` (stochastic rounding, random-k) take a PRNG key in
`encode`. Collectives fold the device's axis index into that key
(`jax.random.fold_in(key, lax.axis_index(axis))`) so that devices draw
independent noise; the same key on every device would correlate their errors.

Non-finite inputs are never turned into finite outputs: a NaN or Inf inside a
quantization block makes that block decode to NaN/Inf.
"""
from __future__ import annotations

import dataclasses
import fractions
import math
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

Payload = Any  # a dict of arrays

# 256 elements per float32 scale: the scale costs 4/256 bytes per element
# (1.6% on top of int8, 3.1% on int4, 6.3% on int2). Smaller blocks track the
# local magnitude better (lower error on heavy-tailed gradients) but the scale
# overhead grows as 4/N; 256 keeps it small while a block stays local.
DEFAULT_BLOCK = 256

VALID_FORMS = (
    "none",
    "bf16",
    "fp16",
    "fp8[:block=N]",
    "int8[:block=N][:sr][:rot]",
    "int4[:block=N][:sr][:rot]",
    "int2[:block=N][:sr][:rot]  (rot: block a power of two)",
    "topk:F  (0 < F <= 1)",
    "randk:F (0 < F <= 1)",
    "powersgd:rank=R[:factor=C][:fallback=C]  (data-parallel gradients only)",
)


def _itemsize(dtype) -> int:
    return jnp.dtype(dtype).itemsize


def _check_float(x, name: str):
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"codec {name!r} codes floating-point arrays; got dtype {x.dtype}")


def _as_rows(x):
    """A 0-d array is coded as one element; everything else keeps its shape."""
    return x.reshape(1) if x.ndim == 0 else x


def _rows_shape(shape) -> tuple:
    """The shape actually coded for an input of `shape` (0-d becomes (1,))."""
    shape = tuple(int(s) for s in shape)
    return shape if shape else (1,)


@dataclasses.dataclass(frozen=True)
class Identity:
    """`none`: sends the array as it is. Collectives call `jax.lax` directly."""

    name: str = "none"
    kind: str = "identity"
    needs_key: bool = False
    row_multiple: ClassVar[int] = 1

    def encode(self, x, *, key=None) -> Payload:
        return {"x": x}

    def decode(self, payload: Payload, shape, dtype):
        return payload["x"].reshape(shape).astype(dtype)

    def wire_bytes(self, shape, dtype) -> int:
        return _numel(shape) * _itemsize(dtype)

    def __str__(self):
        return self.name


@dataclasses.dataclass(frozen=True)
class Cast:
    """`bf16` / `fp16`: a plain cast to a narrower float. Inf/NaN survive the cast;
    fp16 overflows to +-Inf above 65504 (it never saturates to a finite value).

    The 16-bit values travel as uint16 bits: XLA on CPU widens bf16 collectives
    to f32 in the compiled program, which would send the full f32 bytes.
    """

    name: str
    wire_dtype: Any
    kind: str = "dense"
    needs_key: bool = False
    row_multiple: ClassVar[int] = 1

    def encode(self, x, *, key=None) -> Payload:
        _check_float(x, self.name)
        narrow = _as_rows(x).astype(self.wire_dtype)
        return {"x": jax.lax.bitcast_convert_type(narrow, jnp.uint16)}

    def decode(self, payload: Payload, shape, dtype):
        narrow = jax.lax.bitcast_convert_type(payload["x"], self.wire_dtype)
        return narrow.reshape(shape).astype(dtype)

    def wire_bytes(self, shape, dtype) -> int:
        return max(_numel(shape), 1) * _itemsize(self.wire_dtype)

    def __str__(self):
        return self.name


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


# ---------------------------------------------------------------- blockwise


def _check_block(block):
    if isinstance(block, bool) or not isinstance(block, int) or block <= 0:
        raise ValueError(f"block must be a positive int; got {block!r}")


def _to_blocks(x, block: int):
    """(*lead, C) float -> float32 (*lead, NB, block), zero-padded, NB = ceil(C/block)."""
    x = _as_rows(jnp.asarray(x)).astype(jnp.float32)
    c = x.shape[-1]
    nb = -(-c // block)
    if nb * block != c:
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, nb * block - c)])
    return x.reshape(*x.shape[:-1], nb, block)


def _max_abs(a, b):
    return jax.lax.max(jax.lax.abs(a), jax.lax.abs(b))


def _block_absmax(x_LxNBxB):
    """max |x| over each block -> (*lead, NB); NaN if the block holds a NaN.

    Written as a reduction with the reducer max(|a|, |b|), not max(abs(x)):
    XLA:CPU hands plain max-reductions of large arrays to a library kernel that
    skips NaN, which would let a NaN block quantize as finite. This form also
    lets XLA fuse whatever computes x (a decoded sum) into the reduction.
    """
    zero = jnp.zeros((), x_LxNBxB.dtype)
    return jax.lax.reduce(x_LxNBxB, zero, _max_abs, (x_LxNBxB.ndim - 1,))


def _block_scale(x_LxNBxB, qmax: float):
    """Per-block absmax scale and the scaled values x/scale in [-qmax, qmax].

    A zero block gets scale 0 and values 0 (dividing by 1 instead of 0). A block
    holding NaN/Inf gets a NaN/Inf scale: the absmax propagates NaN, |Inf| is Inf.
    Returns (v_LxNBxB, scale_LxNB, finite_LxNBx1).
    """
    scale_LxNB = _block_absmax(x_LxNBxB) / qmax
    finite_LxNB = jnp.isfinite(scale_LxNB)
    safe_LxNB = jnp.where(finite_LxNB & (scale_LxNB > 0), scale_LxNB, 1.0)
    return x_LxNBxB / safe_LxNB[..., None], scale_LxNB, finite_LxNB[..., None]


def _nonfinite_codes(x_LxNBxB, finite_LxNBx1, v_LxNBxB, qmax: float):
    """In a non-finite block, code sign(x)*qmax so decode gives +-Inf (Inf scale)
    or NaN (NaN scale); zeros and NaNs code as 0, which decodes to NaN."""
    signed = jnp.where(x_LxNBxB > 0, qmax, jnp.where(x_LxNBxB < 0, -qmax, 0.0))
    return jnp.where(finite_LxNBx1, v_LxNBxB, signed)


def _from_blocks(v_LxNBxB, scale_LxNB, shape, dtype):
    """Multiplies back by the scale in float32, drops padding, casts to `dtype`."""
    rows = _rows_shape(shape)
    x_LxNBxB = v_LxNBxB.astype(jnp.float32) * scale_LxNB[..., None]
    x_LxP = x_LxNBxB.reshape(*x_LxNBxB.shape[:-2], -1)
    if x_LxP.shape[-1] != rows[-1]:
        x_LxP = x_LxP[..., : rows[-1]]
    return x_LxP.reshape(shape).astype(dtype)


# Rotation. A randomized Hadamard transform, H D / sqrt(B) with D a fixed +-1
# diagonal, spreads a block's outliers over all of its B elements, so the
# absmax scale sits near the block's RMS instead of its largest entry and the
# rounding step shrinks. It is orthonormal and linear: decode inverts it
# exactly, and a sum of rotated rows is the rotation of the sum, so the dense
# collectives' decode-sum-encode stays correct. D comes from a fixed seed: every
# device and every step uses the same one and nothing extra travels.

_ROT_SEED = 0x407A7E


def _rot_signs(block: int):
    """The +-1 diagonal D for blocks of `block` elements: a NumPy PCG64 stream's
    raw bits (stable across NumPy releases), a trace-time constant."""
    import numpy as np

    raw = np.random.PCG64(np.random.SeedSequence(_ROT_SEED)).random_raw(block)
    return jnp.asarray(1.0 - 2.0 * (raw & 1).astype(np.float32))


def _fwht(x_LxNBxB):
    """Orthonormal fast Walsh-Hadamard transform along the last axis (a power of
    two, B): log2(B) butterfly passes of O(B) each, no B x B matrix. Its own inverse."""
    b = x_LxNBxB.shape[-1]
    lead = x_LxNBxB.shape[:-1]
    h = 1
    while h < b:
        x_LxGx2xH = x_LxNBxB.reshape(*lead, b // (2 * h), 2, h)
        lo, hi = x_LxGx2xH[..., 0, :], x_LxGx2xH[..., 1, :]
        x_LxNBxB = jnp.stack([lo + hi, lo - hi], axis=-2).reshape(*lead, b)
        h *= 2
    return x_LxNBxB * (1.0 / math.sqrt(b))


def _rotate(x_LxNBxB):
    return _fwht(x_LxNBxB * _rot_signs(x_LxNBxB.shape[-1]))


def _unrotate(x_LxNBxB):
    return _fwht(x_LxNBxB) * _rot_signs(x_LxNBxB.shape[-1])


# Packing. Codes are packed 8 // bits per byte in runs: a group of S codes is
# cut into 8 // bits runs of S * bits // 8 consecutive codes, and byte j of the
# group holds code j of every run (run k in bits [k*bits, (k+1)*bits)). A group
# is one quantization block when the block length divides evenly, else the
# whole (padded) row. Runs of consecutive codes, unlike neighbouring codes
# sharing a byte, keep every step a contiguous slice that XLA:CPU vectorises.


def _groups(u_LxNBxB, per: int):
    """Codes as (*lead, G, S) groups with S a multiple of `per`."""
    if u_LxNBxB.shape[-1] % per == 0:
        return u_LxNBxB
    u_LxP = u_LxNBxB.reshape(*u_LxNBxB.shape[:-2], 1, -1)
    p = u_LxP.shape[-1]
    return jnp.pad(u_LxP, [(0, 0)] * (u_LxP.ndim - 1) + [(0, -(-p // per) * per - p)])


def _pack(u_LxNBxB, bits: int):
    """Packs unsigned codes < 2**bits: (*lead, NB, B) uint8 -> (*lead, ceil(NB*B*bits/8))."""
    per = 8 // bits
    lead = u_LxNBxB.shape[:-2]
    if per == 1:
        return u_LxNBxB.reshape(*lead, -1)
    u_LxGxS = _groups(u_LxNBxB, per)
    run = u_LxGxS.shape[-1] // per
    packed_LxGxR = u_LxGxS[..., :run]
    for k in range(1, per):
        packed_LxGxR = packed_LxGxR | (u_LxGxS[..., k * run:(k + 1) * run] << (k * bits))
    return packed_LxGxR.reshape(*lead, -1)


def _unpack(b_LxNbytes, bits: int, nb: int, block: int):
    """Inverse of `_pack`: (*lead, nbytes) uint8 -> (*lead, nb, block) uint8 codes."""
    per = 8 // bits
    lead = b_LxNbytes.shape[:-1]
    if per == 1:
        return b_LxNbytes.reshape(*lead, nb, block)
    whole_blocks = block % per == 0  # the groups `_pack` chose
    b_LxGxR = b_LxNbytes.reshape(*lead, nb if whole_blocks else 1, -1)
    mask = jnp.uint8(2**bits - 1)
    runs = [(b_LxGxR >> (k * bits)) & mask for k in range(per)]
    u_LxGxS = jnp.concatenate(runs, axis=-1)
    if whole_blocks:
        return u_LxGxS
    return u_LxGxS.reshape(*lead, -1)[..., : nb * block].reshape(*lead, nb, block)


@dataclasses.dataclass(frozen=True)
class IntQuant:
    """`int8` / `int4` / `int2`: blockwise absmax quantization along the last axis.

    Per block of `block` elements: scale = max|x| / qmax (float32), qmax =
    2**(bits-1) - 1, q = round(x / scale) in [-qmax, qmax]. q is stored biased
    (q + qmax, unsigned) and packed 8 // bits codes per byte. Round-to-nearest
    errs by at most scale/2 per element. With `sr`, q = floor(x/scale + u),
    u ~ U[0, 1) drawn from `key`: unbiased (E[decode] = x) at up to twice the
    worst-case error; it needs `key=` (collectives fold in the axis index).
    With `rot`, each block is rotated by a randomized Hadamard transform before
    quantizing and rotated back after decoding (see `_rotate`): the same bytes,
    a lower error on heavy-tailed data. A NaN or Inf then makes its whole block
    decode non-finite (an Inf may come back as NaN: the inverse rotation mixes
    +Inf and -Inf).

    Payload: {"q": uint8 (*lead, ceil(P*bits/8)), "scale": float32 (*lead, NB)}
    with NB = ceil(C/block) and P = NB*block (the zero padding never reaches
    the caller).
    """

    bits: int
    block: int = DEFAULT_BLOCK
    sr: bool = False
    rot: bool = False
    kind: ClassVar[str] = "dense"

    def __post_init__(self):
        if self.bits not in (8, 4, 2):
            raise ValueError(f"bits must be 8, 4 or 2; got {self.bits!r}")
        _check_block(self.block)
        for field in ("sr", "rot"):
            if not isinstance(getattr(self, field), bool):
                raise TypeError(f"{field} must be a bool; got {getattr(self, field)!r}")
        if self.rot and self.block & (self.block - 1):
            raise ValueError(f"rot needs a block that is a power of two; got block={self.block}")

    @property
    def name(self) -> str:
        return f"int{self.bits}"

    @property
    def needs_key(self) -> bool:
        return self.sr

    @property
    def qmax(self) -> int:
        return 2 ** (self.bits - 1) - 1

    @property
    def row_multiple(self) -> int:
        return math.lcm(self.block, 8 // self.bits)

    def encode(self, x, *, key=None) -> Payload:
        x = jnp.asarray(x)
        _check_float(x, self.name)
        if self.sr and key is None:
            raise ValueError(f"codec {str(self)!r} uses stochastic rounding and needs key=")
        x_LxNBxB = _to_blocks(x, self.block)
        if self.rot:
            x_LxNBxB = _rotate(x_LxNBxB)
        v, scale_LxNB, finite = _block_scale(x_LxNBxB, self.qmax)
        if self.sr:
            v = jnp.floor(v + jax.random.uniform(key, v.shape, jnp.float32))
        else:
            v = jnp.round(v)
        v = _nonfinite_codes(x_LxNBxB, finite, jnp.clip(v, -self.qmax, self.qmax), self.qmax)
        u_LxNBxB = (v + self.qmax).astype(jnp.uint8)
        return {"q": _pack(u_LxNBxB, self.bits), "scale": scale_LxNB}

    def decode(self, payload: Payload, shape, dtype):
        scale_LxNB = payload["scale"]
        u_LxNBxB = _unpack(payload["q"], self.bits, scale_LxNB.shape[-1], self.block)
        v = u_LxNBxB.astype(jnp.float32) - self.qmax
        if self.rot:
            v = _unrotate(v * scale_LxNB[..., None])
            scale_LxNB = jnp.ones_like(scale_LxNB)
        return _from_blocks(v, scale_LxNB, shape, dtype)

    def wire_bytes(self, shape, dtype) -> int:
        rows = _rows_shape(shape)
        nb = -(-rows[-1] // self.block)
        q_bytes = -(-nb * self.block * self.bits // 8)
        return _numel(rows[:-1]) * (q_bytes + 4 * nb)

    def __str__(self):
        return _join(self.name, _block_opt(self.block), "sr" if self.sr else "",
                     "rot" if self.rot else "")


# float8_e4m3fn bits by integer arithmetic on float32 bits. XLA:CPU's own
# conversions run 2-5x slower than an elementwise pass; these agree with them
# bit for bit on the values Fp8 codes (tested exhaustively on the codes).

def _e4m3_bits(v):
    """float8_e4m3fn bits (uint8) of float32 v, rounded to nearest even.

    Requires finite |v| <= 448 (Fp8 clips and codes non-finite blocks apart).
    """
    mag = jnp.abs(v)
    b = jax.lax.bitcast_convert_type(mag, jnp.uint32)
    # Normal range: keep 3 of 23 mantissa bits, ties to even; a carry rolls
    # into the exponent. Then rebias the exponent from 127 to 7.
    normal = ((b + (0x7FFFF + ((b >> 20) & 1))) >> 20) - (120 << 3)
    subnormal = jnp.round(mag * 512.0).astype(jnp.uint32)  # multiples of 2**-9
    code = jnp.where(mag < 2.0**-6, subnormal, normal)
    sign = (jax.lax.bitcast_convert_type(v, jnp.uint32) >> 31) << 7
    return (code | sign).astype(jnp.uint8)


def _e4m3_values(c):
    """float32 values of float8_e4m3fn bits (uint8); 0x7F/0xFF are NaN."""
    c = c.astype(jnp.uint32)
    mag = c & 0x7F
    normal = jax.lax.bitcast_convert_type((mag + (120 << 3)) << 20, jnp.float32)
    v = jnp.where(mag < 8, mag.astype(jnp.float32) * 2.0**-9, normal)
    v = jnp.where(mag == 0x7F, jnp.nan, v)
    return jnp.where(c >= 0x80, -v, v)


@dataclasses.dataclass(frozen=True)
class Fp8:
    """`fp8`: float8_e4m3fn with a per-block float32 scale max|x| / 448.

    Scaling maps each block's absmax onto e4m3's largest value, so large inputs
    do not overflow (e4m3fn has no Inf; overflow would be NaN). Relative error
    is at most 2**-4 for scaled values above 2**-6; below that, e4m3 is
    subnormal and the absolute error is at most 2**-10 * scale. Padding, zero
    and NaN/Inf rules are those of `IntQuant`.

    Payload: {"q": uint8 (*lead, NB*block), "scale": float32 (*lead, NB)}. The
    e4m3 bits travel as uint8: XLA on CPU widens float8 collectives to f16,
    which would double the bytes; a byte is a byte on every backend.
    """

    block: int = DEFAULT_BLOCK
    kind: ClassVar[str] = "dense"
    needs_key: ClassVar[bool] = False
    name: ClassVar[str] = "fp8"
    qmax: ClassVar[float] = 448.0

    def __post_init__(self):
        _check_block(self.block)

    @property
    def row_multiple(self) -> int:
        return self.block

    def encode(self, x, *, key=None) -> Payload:
        x = jnp.asarray(x)
        _check_float(x, self.name)
        x_LxNBxB = _to_blocks(x, self.block)
        v, scale_LxNB, finite = _block_scale(x_LxNBxB, self.qmax)
        v = _nonfinite_codes(x_LxNBxB, finite, jnp.clip(v, -self.qmax, self.qmax), self.qmax)
        q = _e4m3_bits(v).reshape(*v.shape[:-2], -1)
        return {"q": q, "scale": scale_LxNB}

    def decode(self, payload: Payload, shape, dtype):
        scale_LxNB = payload["scale"]
        v = _e4m3_values(payload["q"].reshape(*scale_LxNB.shape, self.block))
        return _from_blocks(v, scale_LxNB, shape, dtype)

    def wire_bytes(self, shape, dtype) -> int:
        rows = _rows_shape(shape)
        nb = -(-rows[-1] // self.block)
        return _numel(rows[:-1]) * nb * (self.block + 4)

    def __str__(self):
        return _join(self.name, _block_opt(self.block))


# ------------------------------------------------------------------- sparse


def _check_fraction(fraction):
    ok = isinstance(fraction, (int, float)) and not isinstance(fraction, bool)
    if not ok or not 0.0 < fraction <= 1.0:
        raise ValueError(f"fraction F must be a float with 0 < F <= 1; got {fraction!r}")


def _num_kept(fraction: float, c: int) -> int:
    """k = ceil(F*C), at least 1 and at most C. F is read as the decimal it
    prints as, so 0.01 * 300 gives 3 rather than ceil(3.0000000000000004)."""
    k = math.ceil(fractions.Fraction(repr(float(fraction))) * c)
    return min(max(k, 1), c)


def _gather(x_LxC, idx_LxK):
    return jnp.take_along_axis(x_LxC, idx_LxK, axis=-1)


def _top_k_indices(score_LxC, k: int):
    """Indices of the k largest scores of every row -> int32 (*lead, k).

    Scores are non-negative floats (no NaN). Ties go to the lower index, as in
    `lax.top_k`. Which k indices are chosen is exact; their order within the
    row is not part of the result (`lax.top_k` order for k <= C/40, index
    order above, where a threshold search beats XLA's partial sort, whose cost
    grows with k: 4x faster at k = C/10 on a million elements).
    """
    lead, c = score_LxC.shape[:-1], score_LxC.shape[-1]
    score_RxC = score_LxC.reshape(-1, c)
    if _THRESHOLD_SELECT * k > c:
        idx_RxK = _threshold_top_k(score_RxC, k)
    elif score_RxC.shape[0] <= _UNROLLED_ROWS:
        # One `lax.top_k` per row: XLA:CPU runs a row's top-k as a partial sort,
        # but once the rows of a batched top-k are sliced apart (as an
        # all_to_all does with the payload) it rewrites the whole top-k into a
        # full sort of every row, about 100x slower at a million elements.
        idx_RxK = jnp.stack([jax.lax.top_k(row_C, k)[1] for row_C in score_RxC])
    else:
        idx_RxK = jax.lax.map(lambda row_C: jax.lax.top_k(row_C, k)[1], score_RxC)
    return idx_RxK.astype(jnp.int32).reshape(*lead, k)


_THRESHOLD_SELECT = 40  # threshold search when k > C / 40
_UNROLLED_ROWS = 8


def _threshold_top_k(score_RxC, k: int):
    """Indices of the k largest non-negative scores of every row, in index order.

    The bits of a non-negative float32 order like its value, so the k-th
    largest score of a row is found by bisection over the 31 value bits (one
    counting pass each). Everything above it is kept, and the first of the
    entries equal to it (lowest index first) until there are k.
    """
    r, c = score_RxC.shape
    key_RxC = jax.lax.bitcast_convert_type(score_RxC.astype(jnp.float32), jnp.int32)

    def halve(_, bounds):
        # invariant: at least k keys >= lo, fewer than k keys >= hi
        lo_R, hi_R = bounds
        mid_R = lo_R + (hi_R - lo_R) // 2
        enough_R = jnp.sum(key_RxC >= mid_R[:, None], axis=-1) >= k
        return jnp.where(enough_R, mid_R, lo_R), jnp.where(enough_R, hi_R, mid_R)

    # Bounds computed from the keys carry their type, including how they vary
    # over mesh axes inside shard_map, as the loop requires.
    lo_R = key_RxC[:, 0] * 0
    kth_R = jax.lax.fori_loop(0, 31, halve, (lo_R, lo_R + 0x7F800001))[0]  # +inf bits + 1
    above_RxC = key_RxC > kth_R[:, None]
    tied_RxC = key_RxC == kth_R[:, None]
    need_Rx1 = (k - jnp.sum(above_RxC, axis=-1))[:, None]
    # Running counts by associative scan: XLA:CPU's cumsum is 3x slower here.
    n_above_RxC = jax.lax.associative_scan(jnp.add, above_RxC.astype(jnp.int32), axis=-1)
    n_tied_RxC = jax.lax.associative_scan(jnp.add, tied_RxC.astype(jnp.int32), axis=-1)
    keep_RxC = above_RxC | (tied_RxC & (n_tied_RxC <= need_Rx1))
    slot_RxC = n_above_RxC + jnp.minimum(n_tied_RxC, need_Rx1) - 1 + k * jnp.arange(r)[:, None]
    slot_RxC = jnp.where(keep_RxC, slot_RxC, r * k)  # r*k is out of range: dropped
    col_RxC = jnp.broadcast_to(jnp.arange(c, dtype=jnp.int32), (r, c))
    idx = jnp.zeros((r * k,), jnp.int32).at[slot_RxC.reshape(-1)].set(
        col_RxC.reshape(-1), mode="drop")
    return idx.reshape(r, k)


def _scatter(payload: Payload, shape, dtype):
    """Writes values at their indices into zeros of `shape`."""
    rows = _rows_shape(shape)
    vals_RxK = payload["values"].reshape(-1, payload["values"].shape[-1]).astype(dtype)
    idx_RxK = payload["indices"].reshape(vals_RxK.shape)
    r = jnp.arange(vals_RxK.shape[0])[:, None]
    out_RxC = jnp.zeros((vals_RxK.shape[0], rows[-1]), dtype).at[r, idx_RxK].set(vals_RxK)
    return out_RxC.reshape(shape)


def _sparse_bytes(fraction: float, shape, dtype) -> int:
    rows = _rows_shape(shape)
    return _numel(rows[:-1]) * _num_kept(fraction, rows[-1]) * (_itemsize(dtype) + 4)


@dataclasses.dataclass(frozen=True)
class TopK:
    """`topk:F`: per row, the k = ceil(F*C) entries largest in magnitude.

    NaN ranks as +inf magnitude, so non-finite entries are kept first: none is
    dropped while k >= their number. Decoding scatters into zeros.
    Payload: {"values": x.dtype (*lead, k), "indices": int32 (*lead, k)}.
    """

    fraction: float
    kind: ClassVar[str] = "sparse"
    needs_key: ClassVar[bool] = False
    name: ClassVar[str] = "topk"
    row_multiple: ClassVar[int] = 1

    def __post_init__(self):
        _check_fraction(self.fraction)
        object.__setattr__(self, "fraction", float(self.fraction))

    def encode(self, x, *, key=None) -> Payload:
        x = _as_rows(jnp.asarray(x))
        _check_float(x, self.name)
        mag = jnp.abs(x.astype(jnp.float32))
        mag = jnp.where(jnp.isnan(mag), jnp.inf, mag)
        idx = _top_k_indices(mag, _num_kept(self.fraction, x.shape[-1]))
        return {"values": _gather(x, idx), "indices": idx}

    def decode(self, payload: Payload, shape, dtype):
        return _scatter(payload, shape, dtype)

    def wire_bytes(self, shape, dtype) -> int:
        return _sparse_bytes(self.fraction, shape, dtype)

    def __str__(self):
        return f"{self.name}:{self.fraction!r}"


@dataclasses.dataclass(frozen=True)
class RandK:
    """`randk:F`: per row, k = ceil(F*C) indices drawn uniformly without
    replacement from `key` (required).

    Values are sent as they are, not rescaled by C/k: the result is a biased
    estimate of x, meant for use with error feedback, which carries the unsent
    remainder to the next step. Non-finite entries are always picked first (up
    to k) so a NaN/Inf is not hidden by chance. Payload as `TopK`.
    """

    fraction: float
    kind: ClassVar[str] = "sparse"
    needs_key: ClassVar[bool] = True
    name: ClassVar[str] = "randk"
    row_multiple: ClassVar[int] = 1

    def __post_init__(self):
        _check_fraction(self.fraction)
        object.__setattr__(self, "fraction", float(self.fraction))

    def encode(self, x, *, key=None) -> Payload:
        x = _as_rows(jnp.asarray(x))
        _check_float(x, self.name)
        if key is None:
            raise ValueError(f"codec {str(self)!r} draws random indices and needs key=")
        # The k largest of iid uniforms are a uniform k-subset.
        score = jax.random.uniform(key, x.shape, jnp.float32)
        score = jnp.where(jnp.isfinite(x), score, 2.0)
        idx = _top_k_indices(score, _num_kept(self.fraction, x.shape[-1]))
        return {"values": _gather(x, idx), "indices": idx}

    def decode(self, payload: Payload, shape, dtype):
        return _scatter(payload, shape, dtype)

    def wire_bytes(self, shape, dtype) -> int:
        return _sparse_bytes(self.fraction, shape, dtype)

    def __str__(self):
        return f"{self.name}:{self.fraction!r}"


def fit(codec, m: int):
    """`codec` for rows of m elements: a block quantizer whose block is longer
    than the row gets the shortest block that covers it (whole bytes of codes),
    so a short row is not padded to a full block; every other codec as it is."""
    block = getattr(codec, "block", None)
    if block is None or m >= block:
        return codec
    per = 8 // codec.bits if isinstance(codec, IntQuant) else 1
    if getattr(codec, "rot", False):  # the Hadamard transform needs a power of two
        return dataclasses.replace(codec, block=max(1 << (int(m) - 1).bit_length(), per))
    return dataclasses.replace(codec, block=max(-(-int(m) // per) * per, per))


# -------------------------------------------------------------------- specs


def _block_opt(block: int) -> str:
    return "" if block == DEFAULT_BLOCK else f"block={block}"


def _join(*parts: str) -> str:
    return ":".join(p for p in parts if p)


def parse(spec) -> Any:
    """Reads a codec spec such as "int8", "int4:block=128:sr", "topk:0.01".

    Case-insensitive; surrounding whitespace is ignored. A codec object passes
    through unchanged. Raises ValueError naming the spec and listing the valid
    forms.
    """
    if not isinstance(spec, str):
        if hasattr(spec, "encode") and hasattr(spec, "wire_bytes"):
            return spec
        if getattr(spec, "kind", None) in ("lowrank", "learned"):
            return spec  # PowerSGD (jcomp.powersgd), autoencoder (jcomp.autoencoder)
        raise TypeError(f"codec spec must be a string or a codec; got {type(spec).__name__}")
    name, *opts = [part.strip() for part in spec.strip().lower().split(":")]
    plain = {"none": Identity, "bf16": lambda: Cast("bf16", jnp.bfloat16),
             "fp16": lambda: Cast("fp16", jnp.float16)}
    if name in plain:
        if opts:
            raise _bad(spec, f"{name!r} takes no options")
        return plain[name]()
    if name in ("int8", "int4", "int2"):
        block, sr, rot = _block_sr_options(spec, opts, allow_sr=True)
        if rot and block & (block - 1):
            raise _bad(spec, f"rot needs a block that is a power of two, got block={block}")
        return IntQuant(int(name[3:]), block, sr, rot)
    if name == "fp8":
        block, _, _ = _block_sr_options(spec, opts, allow_sr=False)
        return Fp8(block)
    if name in ("topk", "randk"):
        return (TopK if name == "topk" else RandK)(_fraction_option(spec, name, opts))
    if name == "powersgd":
        from jcomp import powersgd  # it builds on this module and the collectives

        return powersgd.parse(spec)
    if name == "ae":
        from jcomp import autoencoder

        return autoencoder.parse(spec)
    raise _bad(spec, f"unknown codec {name!r}")


def _block_sr_options(spec, opts, *, allow_sr: bool):
    """Reads `block=N` and (if allowed) `sr` and `rot`, each at most once."""
    block, sr, rot, seen = DEFAULT_BLOCK, False, False, set()
    for opt in opts:
        key = opt.split("=", 1)[0]
        if key in seen:
            raise _bad(spec, f"option {key!r} given twice")
        seen.add(key)
        if opt == "sr" and allow_sr:
            sr = True
        elif opt == "rot" and allow_sr:
            rot = True
        elif key == "block" and "=" in opt:
            try:
                block = int(opt.split("=", 1)[1])
            except ValueError:
                raise _bad(spec, f"block must be a positive int, got {opt!r}") from None
            if block <= 0:
                raise _bad(spec, f"block must be a positive int, got {opt!r}")
        else:
            raise _bad(spec, f"unknown option {opt!r}")
    return block, sr, rot


def key_value_options(opts, keys, bad) -> dict[str, str]:
    """Reads options `key=value`, each of `keys` at most once -> {key: value text}.
    `bad(why)` makes the ValueError (it names the spec and its valid form)."""
    fields = {}
    for opt in opts:
        key, eq, value = opt.partition("=")
        if key not in keys or not eq:
            raise bad(f"unknown option {opt!r}")
        if key in fields:
            raise bad(f"option {key!r} given twice")
        fields[key] = value
    return fields


def _fraction_option(spec, name: str, opts) -> float:
    """Reads the single fraction option F of topk/randk, 0 < F <= 1."""
    if len(opts) != 1:
        raise _bad(spec, f"{name!r} takes exactly one option, the fraction F")
    try:
        fraction = float(opts[0])
    except ValueError:
        raise _bad(spec, f"fraction must be a number, got {opts[0]!r}") from None
    if not 0.0 < fraction <= 1.0:
        raise _bad(spec, f"fraction must satisfy 0 < F <= 1, got {opts[0]!r}")
    return fraction


def _bad(spec, why: str) -> ValueError:
    return ValueError(
        f"invalid codec spec {spec!r}: {why}. Valid forms: " + ", ".join(VALID_FORMS)
    )
