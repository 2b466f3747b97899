"""Block quantizers: int8/int4/int2 (optionally rotated) and fp8, each a float32
absmax scale per block of the last axis, codes packed into bytes; and `fit`,
`fit_row`, which size a codec's block to a row. Their GPU kernels live in
jcomp.codecs.gpu, fp8's bit arithmetic in jcomp.codecs.formats, the spec
grammar that reads them in jcomp.codecs.spec.

Shape letters (jcomp's legend): R the leading (row) dimensions, C a row's
length, NB the blocks per row, BL a block's length (the `block` field),
PR = NB * BL the padded row; in packing, NG groups of GS codes, cut into runs
of RUN codes; HB half a block."""
from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import jax
import jax.numpy as jnp

from jcomp.codecs import rotation
from jcomp.codecs.base import Payload, _as_rows, _check_float, _join, _numel, _rows_shape
from jcomp.codecs.formats import _e4m3_bits, _e4m3_values
from jcomp.codecs.gpu import _int_rot_decoder, _int_rot_encoder
from jcomp.codecs.rotation import _rotate, _unrotate

# 256 elements per float32 scale: the scale costs 4/256 bytes per element
# (1.6% on top of int8, 3.1% on int4, 6.3% on int2). Smaller blocks track the
# local magnitude better (lower error on heavy-tailed gradients) but the scale
# overhead grows as 4/N; 256 keeps it small while a block stays local.
DEFAULT_BLOCK = 256


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


def _block_absmax(x_RxNBxBL):
    """max |x| over each block -> (*lead, NB); NaN if the block holds a NaN.

    Written as a reduction with the reducer max(|a|, |b|), not max(abs(x)):
    XLA:CPU hands plain max-reductions of large arrays to a library kernel that
    skips NaN, which would let a NaN block quantize as finite. This form also
    lets XLA fuse whatever computes x (a decoded sum) into the reduction.
    """
    zero = jnp.zeros((), x_RxNBxBL.dtype)
    return jax.lax.reduce(x_RxNBxBL, zero, _max_abs, (x_RxNBxBL.ndim - 1,))


def _block_scale(x_RxNBxBL, qmax: float):
    """Per-block absmax scale and the scaled values x/scale in [-qmax, qmax].

    A zero block gets scale 0 and values 0 (dividing by 1 instead of 0). A block
    holding NaN/Inf gets a NaN/Inf scale: the absmax propagates NaN, |Inf| is Inf.
    Returns (v_RxNBxBL, scale_RxNB, finite_RxNBx1).
    """
    scale_RxNB = _block_absmax(x_RxNBxBL) / qmax
    finite_RxNB = jnp.isfinite(scale_RxNB)
    safe_RxNB = jnp.where(finite_RxNB & (scale_RxNB > 0), scale_RxNB, 1.0)
    return x_RxNBxBL / safe_RxNB[..., None], scale_RxNB, finite_RxNB[..., None]


def _nonfinite_codes(x_RxNBxBL, finite_RxNBx1, v_RxNBxBL, qmax: float):
    """In a non-finite block, code sign(x)*qmax so decode gives +-Inf (Inf scale)
    or NaN (NaN scale); zeros and NaNs code as 0, which decodes to NaN."""
    signed = jnp.where(x_RxNBxBL > 0, qmax, jnp.where(x_RxNBxBL < 0, -qmax, 0.0))
    return jnp.where(finite_RxNBx1, v_RxNBxBL, signed)


def _from_blocks(v_RxNBxBL, scale_RxNB, shape, dtype):
    """Multiplies back by the scale (None: already scaled) in float32, drops
    padding, casts to `dtype`."""
    rows = _rows_shape(shape)
    x_RxNBxBL = v_RxNBxBL.astype(jnp.float32)
    if scale_RxNB is not None:
        x_RxNBxBL = x_RxNBxBL * scale_RxNB[..., None]
    x_RxPR = x_RxNBxBL.reshape(*x_RxNBxBL.shape[:-2], -1)
    if x_RxPR.shape[-1] != rows[-1]:
        x_RxPR = x_RxPR[..., : rows[-1]]
    return x_RxPR.reshape(shape).astype(dtype)


# Packing. Codes are packed 8 // bits per byte in runs: a group of S codes is
# cut into 8 // bits runs of S * bits // 8 consecutive codes, and byte j of the
# group holds code j of every run (run k in bits [k*bits, (k+1)*bits)). A group
# is one quantization block when the block length divides evenly, else the
# whole (padded) row. Runs of consecutive codes, unlike neighbouring codes
# sharing a byte, keep every step a contiguous slice that XLA:CPU vectorises.


def _groups(u_RxNBxBL, per: int):
    """Codes as (*lead, G, S) groups with S a multiple of `per`."""
    if u_RxNBxBL.shape[-1] % per == 0:
        return u_RxNBxBL
    u_RxPR = u_RxNBxBL.reshape(*u_RxNBxBL.shape[:-2], 1, -1)
    p = u_RxPR.shape[-1]
    return jnp.pad(u_RxPR, [(0, 0)] * (u_RxPR.ndim - 1) + [(0, -(-p // per) * per - p)])


def _pack(u_RxNBxBL, bits: int):
    """Packs unsigned codes < 2**bits: (*lead, NB, BL) uint8 -> (*lead, ceil(NB*BL*bits/8))."""
    per = 8 // bits
    lead = u_RxNBxBL.shape[:-2]
    if per == 1:
        return u_RxNBxBL.reshape(*lead, -1)
    u_RxNGxGS = _groups(u_RxNBxBL, per)
    run = u_RxNGxGS.shape[-1] // per
    packed_RxNGxRUN = u_RxNGxGS[..., :run]
    for k in range(1, per):
        packed_RxNGxRUN = packed_RxNGxRUN | (u_RxNGxGS[..., k * run:(k + 1) * run] << (k * bits))
    return packed_RxNGxRUN.reshape(*lead, -1)


def _unpack(b_RxNbytes, bits: int, nb: int, block: int):
    """Inverse of `_pack`: (*lead, nbytes) uint8 -> (*lead, nb, block) uint8 codes."""
    per = 8 // bits
    lead = b_RxNbytes.shape[:-1]
    if per == 1:
        return b_RxNbytes.reshape(*lead, nb, block)
    whole_blocks = block % per == 0  # the groups `_pack` chose
    b_RxNGxRUN = b_RxNbytes.reshape(*lead, nb if whole_blocks else 1, -1)
    mask = jnp.uint8(2**bits - 1)
    runs = [(b_RxNGxRUN >> (k * bits)) & mask for k in range(per)]
    u_RxNGxGS = jnp.concatenate(runs, axis=-1)
    if whole_blocks:
        return u_RxNGxGS
    return u_RxNGxGS.reshape(*lead, -1)[..., : nb * block].reshape(*lead, nb, block)


@dataclasses.dataclass(frozen=True)
class IntQuant:
    """`int8` / `int4` / `int2`: blockwise absmax quantization along the last axis.

    Per block: scale = max|x| / qmax (float32), qmax = 2**(bits-1) - 1, q =
    round(x / scale), stored biased (q + qmax) and packed 8 // bits per byte;
    it errs by at most scale/2. With `sr`, q = floor(x/scale + u), u ~ U[0, 1)
    from `key`: unbiased at up to twice the error. With `rot`, each block is
    rotated (jcomp.codecs.rotation) before quantizing and back after decoding:
    the same bytes, a lower error on heavy-tailed data; a NaN or Inf then makes
    its whole block non-finite (an Inf may come back as NaN).

    Payload: {"q": uint8 (*lead, ceil(PR*bits/8)), "scale": float32 (*lead, NB)}.
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
        x_RxNBxBL = _to_blocks(x, self.block)
        if self._fused(x_RxNBxBL.shape):
            return rotation.on_gpu((x_RxNBxBL,), lambda v: self.encode_basis(_rotate(v)),
                                   self.encode_gpu)
        return self.encode_basis(_rotate(x_RxNBxBL) if self.rot else x_RxNBxBL, key=key)

    def decode(self, payload: Payload, shape, dtype):
        if self.rot:
            nb = payload["scale"].shape[-1]
            if self._fused(payload["scale"].shape + (self.block,)) and nb:
                blocks = rotation.on_gpu((payload,), lambda p: _unrotate(self.decode_basis(p)),
                                         self.decode_gpu)
                return _from_blocks(blocks, None, shape, dtype)
            return self.from_basis(self.decode_basis(payload), shape, dtype)
        v_RxNBxBL, scale_RxNB = self._codes(payload)
        return _from_blocks(v_RxNBxBL, scale_RxNB, shape, dtype)

    # On a GPU a rotated codec codes in one Pallas kernel per direction: the
    # rotation, the block scale and the codes of a block in registers, so the
    # rotated values never go to memory (jcomp.codecs.gpu; jcomp.codecs.rotation,
    # "the GPU form").

    def _fused(self, blocks_shape) -> bool:
        return (self.rot and not self.sr
                and rotation.piece_width(self.block, 8 // self.bits) == min(self.block, 32)
                and rotation.gpu_applies(blocks_shape, jnp.float32, 8 // self.bits))

    def encode_gpu(self, x_RxNBxBL, *, interpret: bool = False, tile=None) -> Payload:
        """`encode_basis(_rotate(x))` as one kernel; the same payload (`tile`:
        rotation.rotate_gpu's)."""
        lead, block = x_RxNBxBL.shape[:-2], self.block
        n = math.prod(x_RxNBxBL.shape[:-1])
        per = 8 // self.bits
        q, scale = rotation.kernel_call(
            _int_rot_encoder(self.bits, block), x_RxNBxBL.reshape(n, block), block,
            tile or rotation.gpu_tile(n, block, per),
            [((block // per,), jnp.uint8), ((), jnp.float32)], interpret=interpret)
        return {"q": q.reshape(*lead, -1), "scale": scale.reshape(x_RxNBxBL.shape[:-1])}

    def decode_gpu(self, payload: Payload, *, interpret: bool = False, tile=None):
        """`_unrotate(decode_basis(payload))` as one kernel: float32 (*lead, NB, BL)."""
        scale_RxNB, block, per = payload["scale"], self.block, 8 // self.bits
        n = math.prod(scale_RxNB.shape)
        (x,) = rotation.kernel_call(
            _int_rot_decoder(self.bits, block), payload["q"].reshape(n, block // per), block,
            tile or rotation.gpu_tile(n, block, per), [((block,), jnp.float32)],
            extra=[(scale_RxNB.reshape(n), ())], interpret=interpret)
        return x.reshape(*scale_RxNB.shape, block)

    # The rotated basis. A dense collective sums decoded rows and codes the sum
    # again; with `rot` it can do both in the basis the codes live in (the
    # rotation is linear), leaving out an inverse and a forward rotation.

    def encode_basis(self, x_RxNBxBL, *, key=None) -> Payload:
        """`encode` of blocks already in the codec's basis (rotated if `rot`)."""
        if self.sr and key is None:
            raise ValueError(f"codec {str(self)!r} uses stochastic rounding and needs key=")
        v, scale_RxNB, finite = _block_scale(x_RxNBxBL, self.qmax)
        if self.sr:
            v = jnp.floor(v + jax.random.uniform(key, v.shape, jnp.float32))
        else:
            v = jnp.round(v)
        v = _nonfinite_codes(x_RxNBxBL, finite, jnp.clip(v, -self.qmax, self.qmax), self.qmax)
        u_RxNBxBL = (v + self.qmax).astype(jnp.uint8)
        return {"q": _pack(u_RxNBxBL, self.bits), "scale": scale_RxNB}

    def decode_basis(self, payload: Payload):
        """The payload's values in the codec's basis, padding kept: float32 (*lead, NB, BL)."""
        v_RxNBxBL, scale_RxNB = self._codes(payload)
        return v_RxNBxBL * scale_RxNB[..., None]

    def from_basis(self, x_RxNBxBL, shape, dtype):
        """Blocks in the codec's basis back to an array of `shape`."""
        x_RxNBxBL = rotation.unrotate(x_RxNBxBL) if self.rot else x_RxNBxBL
        return _from_blocks(x_RxNBxBL, None, shape, dtype)

    def _codes(self, payload: Payload):
        scale_RxNB = payload["scale"]
        u_RxNBxBL = _unpack(payload["q"], self.bits, scale_RxNB.shape[-1], self.block)
        return u_RxNBxBL.astype(jnp.float32) - self.qmax, scale_RxNB

    def wire_bytes(self, shape, dtype) -> int:
        rows = _rows_shape(shape)
        nb = -(-rows[-1] // self.block)
        q_bytes = -(-nb * self.block * self.bits // 8)
        return _numel(rows[:-1]) * (q_bytes + 4 * nb)

    def __str__(self):
        return _join(self.name, _block_opt(self.block), "sr" if self.sr else "",
                     "rot" if self.rot else "")


@dataclasses.dataclass(frozen=True)
class Fp8:
    """`fp8`: float8_e4m3fn with a per-block float32 scale max|x| / 448, so large
    inputs do not overflow (e4m3fn has no Inf). Relative error is at most 2**-4
    for scaled values above 2**-6, absolute error 2**-10 * scale below. Padding,
    zero and NaN/Inf rules are those of `IntQuant`.

    Payload: {"q": uint8 (*lead, NB*block), "scale": float32 (*lead, NB)}: the
    bits travel as uint8, since XLA on CPU widens float8 collectives to f16.
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
        x_RxNBxBL = _to_blocks(x, self.block)
        v, scale_RxNB, finite = _block_scale(x_RxNBxBL, self.qmax)
        v = _nonfinite_codes(x_RxNBxBL, finite, jnp.clip(v, -self.qmax, self.qmax), self.qmax)
        q = _e4m3_bits(v).reshape(*v.shape[:-2], -1)
        return {"q": q, "scale": scale_RxNB}

    def decode(self, payload: Payload, shape, dtype):
        scale_RxNB = payload["scale"]
        v = _e4m3_values(payload["q"].reshape(*scale_RxNB.shape, self.block))
        return _from_blocks(v, scale_RxNB, shape, dtype)

    def wire_bytes(self, shape, dtype) -> int:
        rows = _rows_shape(shape)
        nb = -(-rows[-1] // self.block)
        return _numel(rows[:-1]) * nb * (self.block + 4)

    def __str__(self):
        return _join(self.name, _block_opt(self.block))


def _block_opt(block: int) -> str:
    return "" if block == DEFAULT_BLOCK else f"block={block}"


def _codes_per_byte(codec) -> int:
    """How many codes share a byte (int4 and the FP4 formats: 2): a fitted block
    holds whole bytes of them."""
    return 8 // getattr(codec, "bits", 8)


def fit(codec, m: int):
    """`codec` for rows of m elements: a block quantizer whose block is longer
    than the row gets the shortest block that covers it (whole bytes of codes),
    so a short row is not padded to a full block; every other codec as it is."""
    block = getattr(codec, "block", None)
    if block is None or m >= block:
        return codec
    per = _codes_per_byte(codec)
    if getattr(codec, "rot", False):  # the Hadamard transform needs a power of two
        return dataclasses.replace(codec, block=max(1 << (int(m) - 1).bit_length(), per))
    return dataclasses.replace(codec, block=max(-(-int(m) // per) * per, per))


def fit_row(codec, c: int):
    """`codec` for rows of c elements that are coded each on its own (row-local):
    no block spans two rows. A row no longer than a block gets one block that
    covers it (`fit`); a longer row that blocks do not divide gets equal blocks,
    as long as the codec's but fewer of them wasted on padding (300 elements:
    two blocks of 150, not two of 256); a rotated codec keeps its power-of-two
    block and pads each row to whole blocks."""
    block = getattr(codec, "block", None)
    if block is None or c <= block:
        return fit(codec, c)
    if c % block == 0 or getattr(codec, "rot", False):
        return codec
    per = _codes_per_byte(codec)
    nb = -(-int(c) // block)
    return dataclasses.replace(codec, block=-(-(-(-int(c) // nb)) // per) * per)
