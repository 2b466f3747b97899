"""Microscaling floating-point codecs: OCP MX (`mxfp8`, `mxfp4`) and NVIDIA's
`nvfp4`, small blocks of narrow floats with a cheap scale per block.

  mxfp8  E4M3 elements, an E8M0 (power-of-two) scale per 32: 8.25 bits/element
  mxfp4  E2M1 elements, an E8M0 scale per 32:                 4.25 bits/element
  nvfp4  E2M1 elements, an E4M3 scale per 16, and one float32 scale per coded
         row (NVIDIA's per-tensor scale, kept inside a row): 4.5 bits/element
         plus 32 bits per row

E2M1 holds 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives (code: sign bit 3,
then the magnitude's index in that list); two codes pack into a byte as int4's
do (blockwise._pack). E8M0 is a biased exponent, 2**(code - 127), 0xFF NaN;
E4M3 is float8_e4m3fn (max 448, no Inf, 0x7F NaN). The formats' bit
arithmetic lives in jcomp.codecs.formats, the codecs' GPU kernels in
jcomp.codecs.gpu.

Shape letters as in blockwise: R the leading (row) dimensions, NB blocks per
row, BL a block's length."""
from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import jax
import jax.numpy as jnp

from jcomp.codecs import rotation
from jcomp.codecs.base import Payload, _check_float, _join, _numel, _rows_shape
from jcomp.codecs.blockwise import (_block_absmax, _check_block, _from_blocks, _pack,
                                    _to_blocks, _unpack)
from jcomp.codecs.formats import (E2M1_MAX, E4M3_MAX, E4M3_NAN, ELEMENTS, _e4m3_bits,
                                  _e4m3_values, _e8m0_codes, _e8m0_inverse, _e8m0_values,
                                  _element_codes, _element_values)
from jcomp.codecs.gpu import _fp_rot_decoder, _fp_rot_encoder
from jcomp.codecs.rotation import _rotate, _unrotate, rotate, unrotate


@dataclasses.dataclass(frozen=True)
class _Microscaled:
    """What the three share: blocks inside a row, `:rot` and `:sr` as IntQuant's,
    packing, and NaN/Inf: a block holding one gets its scale format's NaN code
    and decodes as NaN throughout (the formats hold no Inf, so an Inf comes
    back as NaN, never finite). A zero block decodes to exact zeros."""

    kind: ClassVar[str] = "dense"

    def _validate(self):
        _check_block(self.block)
        for field in ("sr", "rot"):
            if not isinstance(getattr(self, field), bool):
                raise TypeError(f"{field} must be a bool; got {getattr(self, field)!r}")
        if self.rot and self.block & (self.block - 1):
            raise ValueError(f"rot needs a block that is a power of two; got block={self.block}")

    @property
    def needs_key(self) -> bool:
        return self.sr

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
        return self.encode_basis(rotate(x_RxNBxBL) if self.rot else x_RxNBxBL, key=key)

    def decode(self, payload: Payload, shape, dtype):
        if self.rot:
            nb = payload["scale"].shape[-1]
            if self._fused(payload["scale"].shape + (self.block,)) and nb:
                blocks = rotation.on_gpu((payload,), lambda p: _unrotate(self.decode_basis(p)),
                                         self.decode_gpu)
                return _from_blocks(blocks, None, shape, dtype)
            return self.from_basis(self.decode_basis(payload), shape, dtype)
        return _from_blocks(self.decode_basis(payload), None, shape, dtype)

    # On a GPU a rotated codec codes in Pallas kernels (jcomp.codecs.gpu), as
    # IntQuant's do (jcomp.codecs.rotation, "the GPU form"): the rotation, the
    # block scale and the packed codes of a block in registers. nvfp4's row
    # scale needs the whole row's largest rotated block first: one kernel
    # rotates and writes each block's absmax, XLA reduces those per row (1/16
    # of the elements), and a second kernel rotates again and codes. Rotating
    # twice reads the input twice but never writes or re-reads the rotated blocks.

    def _fused(self, blocks_shape) -> bool:
        return (self.rot and not self.sr and blocks_shape[-1] % 2 == 0
                and rotation.gpu_applies(blocks_shape, jnp.float32))

    def encode_gpu(self, x_RxNBxBL, *, interpret: bool = False, tile=None) -> Payload:
        """`encode_basis(_rotate(x))` in kernels; the same payload (`tile`:
        rotation.rotate_gpu's)."""
        lead, block = x_RxNBxBL.shape[:-2], self.block
        n = math.prod(x_RxNBxBL.shape[:-1])
        x_NxBL = x_RxNBxBL.reshape(n, block)
        tile = tile or rotation.gpu_tile(n, block)
        nbytes = block * self.bits // 8
        if not self.row_scale:
            q, code = rotation.kernel_call(
                _fp_rot_encoder(self.bits, block, "mx"), x_NxBL, block, tile,
                [((nbytes,), jnp.uint8), ((), jnp.uint8)], interpret=interpret)
            return {"q": q.reshape(*lead, -1), "scale": code.reshape(x_RxNBxBL.shape[:-1])}
        (amax,) = rotation.kernel_call(_fp_rot_encoder(self.bits, block, "amax"), x_NxBL, block,
                                       tile, [((), jnp.float32)], interpret=interpret)
        amax_RxNB = amax.reshape(x_RxNBxBL.shape[:-1])
        # The block scales take two divisions: left to XLA, they round as the
        # XLA form's do (Triton may lower a float32 division to an approximate one).
        scales, inv_RxNB = self._encode_scales(amax_RxNB)
        # NaN marks a block that codes as zeros (one holding a NaN or Inf).
        inv_RxNB = jnp.where(jnp.isfinite(amax_RxNB), inv_RxNB, jnp.nan)
        (q,) = rotation.kernel_call(_fp_rot_encoder(self.bits, block, "scaled"), x_NxBL, block,
                                    tile, [((nbytes,), jnp.uint8)],
                                    extra=[(inv_RxNB.reshape(n), ())], interpret=interpret)
        return {"q": q.reshape(*lead, -1), **scales}

    def decode_gpu(self, payload: Payload, *, interpret: bool = False, tile=None):
        """`_unrotate(decode_basis(payload))` as one kernel: float32 (*lead, NB, BL)."""
        code_RxNB, block = payload["scale"], self.block
        shape, nb = code_RxNB.shape, code_RxNB.shape[-1]
        n = math.prod(shape)
        # The kernel reads the scale codes, and nvfp4's row scale once per
        # program where a program's blocks lie in one row; else XLA writes
        # each block's float32 scale first.
        tile = (tile or (self.row_scale and rotation.gpu_tile(nb, block))
                or rotation.gpu_tile(n, block))
        if not self.row_scale:
            extra, mode = [(code_RxNB.reshape(n), ())], "code"
        elif nb % tile == 0:
            extra, mode = [(code_RxNB.reshape(n), ()), (payload["row"].reshape(-1), nb)], "row"
        else:
            extra, mode = [(self._decode_scales(payload).reshape(n), ())], "scale"
        (x,) = rotation.kernel_call(
            _fp_rot_decoder(self.bits, block, mode), payload["q"].reshape(n, block * self.bits // 8),
            block, tile, [((block,), jnp.float32)], extra=extra, interpret=interpret)
        return x.reshape(*shape, block)

    def encode_basis(self, x_RxNBxBL, *, key=None) -> Payload:
        """`encode` of blocks already in the codec's basis (rotated if `rot`)."""
        if self.sr and key is None:
            raise ValueError(f"codec {str(self)!r} uses stochastic rounding and needs key=")
        amax_RxNB = _block_absmax(x_RxNBxBL)
        scales, inv_RxNB = self._encode_scales(amax_RxNB)
        finite_RxNBx1 = jnp.isfinite(amax_RxNB)[..., None]
        u = jax.random.uniform(key, x_RxNBxBL.shape, jnp.float32) if self.sr else None

        def codes(lo, hi):  # of elements [lo, hi) of every block
            v = jnp.where(finite_RxNBx1, x_RxNBxBL[..., lo:hi] * inv_RxNB[..., None], 0.0)
            return _element_codes(v, self.bits, None if u is None else u[..., lo:hi])

        lead, bl = x_RxNBxBL.shape[:-2], self.block
        if self.bits == 8:
            q = codes(0, bl).reshape(*lead, -1)
        elif bl % 2:
            q = _pack(codes(0, bl).astype(jnp.uint8), 4)
        else:
            # blockwise._pack's layout (byte j of a block: codes j and j + BL/2),
            # each half coded on its own: XLA:CPU ran one pass over whole blocks
            # followed by the packing's slices 3.6x slower.
            q = (codes(0, bl // 2) | (codes(bl // 2, bl) << 4)).astype(jnp.uint8).reshape(*lead, -1)
        return {"q": q, **scales}

    def decode_basis(self, payload: Payload):
        """The payload's values in the codec's basis, padding kept: float32 (*lead, NB, BL)."""
        scale_RxNB = self._decode_scales(payload)
        nb = scale_RxNB.shape[-1]
        if self.bits == 4:
            codes = _unpack(payload["q"], 4, nb, self.block)
        else:
            codes = payload["q"].reshape(*payload["q"].shape[:-1], nb, self.block)
        return _element_values(codes, self.bits) * scale_RxNB[..., None]

    def from_basis(self, x_RxNBxBL, shape, dtype):
        """Blocks in the codec's basis back to an array of `shape`."""
        x_RxNBxBL = unrotate(x_RxNBxBL) if self.rot else x_RxNBxBL
        return _from_blocks(x_RxNBxBL, None, shape, dtype)

    def _row_bytes(self, c: int) -> int:
        nb = -(-c // self.block)
        return -(-nb * self.block * self.bits // 8) + nb

    def wire_bytes(self, shape, dtype) -> int:
        rows = _rows_shape(shape)
        return _numel(rows[:-1]) * (self._row_bytes(rows[-1]) + 4 * self.row_scale)

    def __str__(self):
        default = type(self).__dataclass_fields__["block"].default
        return _join(self.name, "" if self.block == default else f"block={self.block}",
                     "sr" if self.sr else "", "rot" if self.rot else "")


@dataclasses.dataclass(frozen=True)
class Mx(_Microscaled):
    """`mxfp8` / `mxfp4`: OCP MX. Per block of 32 (BL): X = the smallest power of
    two with max|x| / X <= the element format's largest value (448 for E4M3, 6
    for E2M1), sent as its E8M0 code; elements x / X in E4M3 or E2M1, rounded to
    nearest even, or stochastically with `sr`. Dividing by a power of two is
    exact, so the only error is the elements' rounding: relative 2**-4 (E4M3)
    or 2**-2 (E2M1) in the normal range, below it absolute 2**-10 X (E4M3) or
    X/4 (E2M1).

    Payload: {"q": uint8 (*lead, ceil(PR*bits/8)), "scale": uint8 E8M0 (*lead, NB)}.
    """

    bits: int
    block: int = 32
    sr: bool = False
    rot: bool = False
    row_scale: ClassVar[bool] = False

    def __post_init__(self):
        if self.bits not in (8, 4):
            raise ValueError(f"bits must be 8 or 4; got {self.bits!r}")
        self._validate()

    @property
    def name(self) -> str:
        return f"mxfp{self.bits}"

    def _encode_scales(self, amax_RxNB):
        code = _e8m0_codes(amax_RxNB, ELEMENTS[self.bits][2])
        return {"scale": code}, _e8m0_inverse(code)

    def _decode_scales(self, payload):
        return _e8m0_values(payload["scale"])


@dataclasses.dataclass(frozen=True)
class NvFp4(_Microscaled):
    """`nvfp4`: E2M1 elements, an E4M3 scale per block of 16 and a float32 scale
    per coded row, s = (the row's largest finite |x|) / (6 * 448). A block's
    scale is d = E4M3(max|x| / (6 s)), to nearest even (at most 448), and its
    elements are x / (d s) in E2M1, saturating at +-6 where d rounded down. The
    row scale replaces NVIDIA's per-tensor one: no scale spans two rows. A
    block whose d underflows E4M3 (max|x| below 2**-10 * 6 s, 1/2**18.4 of the
    row's largest) decodes as zeros; so does a row whose s underflows float32.

    Payload: {"q": uint8 (*lead, ceil(PR/2)), "scale": uint8 E4M3 (*lead, NB),
    "row": float32 (*lead, 1)}.
    """

    block: int = 16
    sr: bool = False
    rot: bool = False
    bits: ClassVar[int] = 4
    name: ClassVar[str] = "nvfp4"
    # Coding a row whole or in pieces sends different bytes (one row scale each);
    # jcomp.collectives.kernels keeps a flat row whole for such a codec.
    row_scale: ClassVar[bool] = True

    def __post_init__(self):
        self._validate()

    def _encode_scales(self, amax_RxNB):
        finite = jnp.where(jnp.isfinite(amax_RxNB), amax_RxNB, 0.0)
        s_Rx1 = jnp.max(finite, axis=-1, keepdims=True) * (1.0 / (E2M1_MAX * E4M3_MAX))
        live_Rx1 = s_Rx1 > 0
        ratio_RxNB = jnp.where(live_Rx1, finite / (E2M1_MAX * jnp.where(live_Rx1, s_Rx1, 1.0)),
                               0.0)
        d_RxNB = _e4m3_bits(jnp.minimum(ratio_RxNB, E4M3_MAX))
        code = jnp.where(jnp.isfinite(amax_RxNB), d_RxNB, E4M3_NAN).astype(jnp.uint8)
        divisor_RxNB = _e4m3_values(d_RxNB) * s_Rx1
        live = divisor_RxNB > 0
        return {"scale": code, "row": s_Rx1}, jnp.where(live, 1.0 / jnp.where(live, divisor_RxNB,
                                                                                 1.0), 0.0)

    def _decode_scales(self, payload):
        return _e4m3_values(payload["scale"]) * payload["row"]
