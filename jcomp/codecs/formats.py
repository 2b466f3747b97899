"""The narrow float formats the codecs send, as integer arithmetic on float32
bits: E4M3 (float8_e4m3fn: max 448, no Inf, 0x7F NaN), the elements of fp8
and mxfp8 and nvfp4's block scales; E2M1 (0, 0.5, 1, 1.5, 2, 3, 4, 6 and
their negatives; code: sign bit 3, then the magnitude's index in that list),
the elements of mxfp4 and nvfp4; E8M0 (a biased exponent, 2**(code - 127),
0xFF NaN), the MX block scales. The tests hold each to the format's own
conversion (jnp's and ml_dtypes' casts) bit for bit. Used by blockwise (fp8),
microscale and the GPU kernels of both (jcomp.codecs.gpu)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

E2M1_MAX = 6.0
E4M3_MAX = 448.0
# (mantissa bits, smallest normal exponent, largest value) of each element format.
ELEMENTS = {4: (1, 0, E2M1_MAX), 8: (3, -6, E4M3_MAX)}
E8M0_NAN = 255
E4M3_NAN = 0x7F


def _bits(v):
    return jax.lax.bitcast_convert_type(v, jnp.uint32)


def _from_bits(b):
    return jax.lax.bitcast_convert_type(b.astype(jnp.uint32), jnp.float32)


# ---------------------------------------------------------------------- E4M3
#
# float8_e4m3fn bits by integer arithmetic on float32 bits. XLA:CPU's own
# conversions run 2-5x slower than an elementwise pass; these agree with them
# bit for bit on the values Fp8 codes (tested exhaustively on the codes).

def _e4m3_bits(v, rnd=jnp.round):
    """float8_e4m3fn bits (uint8) of float32 v, rounded to nearest even.

    Requires finite |v| <= 448 (Fp8 clips and codes non-finite blocks apart).
    `rnd`: jnp.round, or gpu._round_even inside a Triton kernel.
    """
    mag = jnp.abs(v)
    b = jax.lax.bitcast_convert_type(mag, jnp.uint32)
    # Normal range: keep 3 of 23 mantissa bits, ties to even; a carry rolls
    # into the exponent. Then rebias the exponent from 127 to 7.
    normal = ((b + (0x7FFFF + ((b >> 20) & 1))) >> 20) - (120 << 3)
    subnormal = rnd(mag * 512.0).astype(jnp.uint32)  # multiples of 2**-9
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


# ------------------------------------------------------------------ elements


def _e2m1_bits(mag, rnd=jnp.round):
    """4-bit E2M1 magnitude codes (uint32, 0-7) of float32 mag in [0, 6], to
    nearest, ties to even. Normal values (>= 1) keep 1 of 23 mantissa bits, as
    _e4m3_bits keeps 3; below 1 the grid is 0, 0.5, 1. `rnd`:
    jnp.round, or gpu._round_even inside a Triton kernel."""
    b = _bits(mag)
    normal = ((b + (0x1FFFFF + ((b >> 22) & 1))) >> 22) - (126 << 1)
    subnormal = rnd(mag * 2.0).astype(jnp.uint32)
    return jnp.where(mag < 1.0, subnormal, normal)


def _e2m1_values(code):
    """float32 values of E2M1 codes (uint8, 0-15)."""
    c = code.astype(jnp.uint32)
    mag = c & 7
    normal = _from_bits(((mag >> 1) + 126) << 23 | (mag & 1) << 22)
    v = jnp.where(mag < 2, mag.astype(jnp.float32) * 0.5, normal)
    return jnp.where(c >= 8, -v, v)


def _stochastic_grid(mag, u, mbits: int, emin: int):
    """mag (float32 >= 0, at most the format's largest value) rounded to a
    neighbouring value of a float format with `mbits` mantissa bits and smallest
    normal exponent `emin`: up with probability equal to the distance from the
    lower one over the spacing, so unbiased. The spacing is a power of two read
    from mag's exponent bits, so every step is exact; the format's largest value
    lies on the grid of its binade, so nothing rounds past it."""
    e = ((_bits(mag) >> 23) & 0xFF).astype(jnp.int32) - 127
    step_exp = jnp.maximum(e, emin) - mbits
    step = _from_bits((step_exp + 127) << 23)
    inv = _from_bits((127 - step_exp) << 23)
    return jnp.floor(mag * inv + u) * step


def _element_codes(v, bits: int, u, rnd=jnp.round):
    """Codes of scaled values v (float32, finite) in E2M1 (bits=4, as uint32) or
    E4M3 (bits=8, as uint8), saturating at the format's largest value, rounded
    to nearest or, given uniform draws u, stochastically."""
    mbits, emin, vmax = ELEMENTS[bits]
    mag = jnp.minimum(jnp.abs(v), vmax)  # saturate, as both formats define
    if u is not None:
        mag = _stochastic_grid(mag, u, mbits, emin)
    if bits == 8:
        return _e4m3_bits(jnp.where(v < 0, -mag, mag), rnd)
    return _e2m1_bits(mag, rnd) | jnp.where(v < 0, 8, 0).astype(jnp.uint32)


def _element_values(code, bits: int):
    return _e4m3_values(code) if bits == 8 else _e2m1_values(code)


# -------------------------------------------------------------------- scales


def _e8m0_codes(amax, vmax: float):
    """The E8M0 code of the smallest power of two X with amax / X <= vmax: the
    block's largest element lands in the top binade without saturating. (OCP's
    example conversion rounds the exponent down instead, so a scaled absmax
    lies in [4, 8) and whatever lands above 6 saturates; NVIDIA's MXFP8 recipe
    rounds up, as here.) Exact,
    on the float bits: amax = (1 + m) 2**e, vmax = (1 + f) 2**E, so X = 2**(e - E),
    doubled where m > f. Codes stay in [1, 254]: 2**-127 (code 0) is no normal
    float32. NaN/Inf amax: the NaN code."""
    b, vb = _bits(amax), int(np.float32(vmax).view(np.uint32))
    exp, vexp = ((b >> 23) & 0xFF).astype(jnp.int32), (vb >> 23) - 127
    code = exp - vexp + ((b & 0x7FFFFF) > (vb & 0x7FFFFF)).astype(jnp.int32)
    code = jnp.clip(code, 1, 254)
    return jnp.where(jnp.isfinite(amax), code, E8M0_NAN).astype(jnp.uint8)


def _e8m0_values(code):
    c = code.astype(jnp.uint32)
    return jnp.where(c == E8M0_NAN, jnp.nan, _from_bits(c << 23))


def _e8m0_inverse(code):
    """1 / 2**(code - 127) for codes 1-254, exactly (a normal float32)."""
    return _from_bits((254 - jnp.minimum(code.astype(jnp.uint32), 253)) << 23)
