"""The GPU form of the rotated block codecs: Pallas kernels (Triton on a GPU)
that code a block in registers, its rotation, scale and packed codes
together, so the rotated values never go to memory (jcomp.codecs.rotation,
"the GPU form", holds the rotation's pieces and the kernel call). IntQuant
(blockwise) and Mx/NvFp4 (microscale) choose them with `lax.platform_dependent`
through `rotation.on_gpu`; each kernel computes what the codec's XLA form
does, bit for bit. Nothing here is a codec: the codecs import these.

Shape letters as in blockwise."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jcomp.codecs import rotation
from jcomp.codecs.formats import (ELEMENTS, _e4m3_values, _e8m0_codes, _e8m0_inverse,
                                  _e8m0_values, _element_codes, _element_values)


def _round_even(v):
    """jnp.round (to nearest, ties to even) from floor: Triton has no round.
    Exact for every float32, so it agrees with jnp.round bit for bit."""
    r = jnp.floor(v)
    d = v - r
    odd = (r - 2.0 * jnp.floor(r * 0.5)) == 1.0
    return jnp.where((d > 0.5) | ((d == 0.5) & odd), r + 1.0, r)


def _pieces_absmax(pieces):
    """blockwise._block_absmax over a block's pieces. Triton's max skips NaN, so a NaN
    is carried by a separate flag, as XLA's max carries it."""
    amax, nan = None, None
    for p in pieces:
        a = jnp.max(jnp.abs(p), axis=1)
        b = jnp.max(jnp.where(p != p, 1.0, 0.0), axis=1)
        amax = a if amax is None else jnp.maximum(amax, a)
        nan = b if nan is None else jnp.maximum(nan, b)
    return jnp.where(nan > 0, jnp.nan, amax)


def _int_rot_encoder(bits: int, block: int):
    """Kernel: blocks -> packed codes and scales of IntQuant(bits, block, rot=True),
    the steps of `encode_basis(_rotate(x))` on pieces."""
    qmax, per = 2 ** (bits - 1) - 1, 8 // bits
    width = rotation.piece_width(block, per)

    def kernel(x_ref, s_ref, h_ref, q_ref, scale_ref):
        from jax.experimental import pallas as pl

        pieces = rotation.transform_pieces(lambda lo, k: x_ref[:, pl.ds(lo, k)], s_ref, h_ref,
                                           block, width, inverse=False)
        scale = _pieces_absmax(pieces) / qmax
        finite = jnp.isfinite(scale)
        safe = jnp.where(finite & (scale > 0), scale, 1.0)
        codes = []
        for p in pieces:
            v = jnp.clip(_round_even(p / safe[:, None]), -qmax, qmax)
            signed = jnp.where(p > 0, qmax, jnp.where(p < 0, -qmax, 0.0))
            codes.append((jnp.where(finite[:, None], v, signed) + qmax).astype(jnp.uint8))
        run = len(codes) // per  # pieces per packing run
        for j in range(run):
            b = codes[j]
            for k in range(1, per):
                b = b | (codes[j + k * run] << (k * bits))
            q_ref[:, pl.ds(j * width, width)] = b
        scale_ref[...] = scale

    return kernel


def _int_rot_decoder(bits: int, block: int):
    """Kernel: packed codes and scales -> blocks, `_unrotate(decode_basis(p))` on pieces."""
    qmax, per = 2 ** (bits - 1) - 1, 8 // bits
    width = rotation.piece_width(block, per)
    run = block // per // width

    def kernel(q_ref, s_ref, h_ref, scale_ref, o_ref):
        from jax.experimental import pallas as pl

        scale = scale_ref[...]

        def load(lo, k):  # k == width: piece lo // width
            j, part = (lo // width) % run, (lo // width) // run
            b = q_ref[:, pl.ds(j * width, width)]
            if per > 1:
                b = (b >> (part * bits)) & jnp.uint8(2**bits - 1)
            return (b.astype(jnp.float32) - qmax) * scale[:, None]

        pieces = rotation.transform_pieces(load, s_ref, h_ref, block, width, inverse=True)
        for k, p in enumerate(pieces):
            o_ref[:, pl.ds(k * width, width)] = p

    return kernel


# ------------------------------------------------------ the microscaled kernels
#
# A block is rotation.transform_pieces' pieces of W = min(BL, 32) elements.
# Packed E2M1 puts codes j and j + BL/2 of a block in byte j: for BL > 32 those
# are pieces k and k + BL/2W, for BL <= 32 the two halves of the one piece.


def _fp_rot_encoder(bits: int, block: int, mode: str):
    """Kernel on blocks, the steps of `encode_basis(_rotate(x))` on pieces.
    mode "mx": -> packed codes, E8M0 scale codes; "amax": -> each block's
    absmax; "scaled": (with 1/divisor per block, NaN for a block coded as
    zeros) -> packed codes."""
    width = min(block, rotation._LO)

    def kernel(x_ref, s_ref, h_ref, *refs):
        from jax.experimental import pallas as pl

        pieces = rotation.transform_pieces(lambda lo, k: x_ref[:, pl.ds(lo, k)], s_ref, h_ref,
                                           block, width, inverse=False)
        if mode == "amax":
            refs[0][...] = _pieces_absmax(pieces)
            return
        if mode == "mx":
            amax = _pieces_absmax(pieces)
            code = _e8m0_codes(amax, ELEMENTS[bits][2])
            inv, finite = _e8m0_inverse(code), jnp.isfinite(amax)
            q_ref, scale_ref = refs
            scale_ref[...] = code
        else:
            inv_ref, q_ref = refs
            inv = inv_ref[...]
            finite = inv == inv
        codes = [_element_codes(jnp.where(finite[:, None], p * inv[:, None], 0.0), bits, None,
                                _round_even) for p in pieces]
        if bits == 8:
            for k, c in enumerate(codes):
                q_ref[:, pl.ds(k * width, width)] = c
        elif len(codes) == 1:
            lo, hi = jax.lax.split(codes[0], (width // 2, width // 2), axis=1)
            q_ref[...] = (lo | (hi << 4)).astype(jnp.uint8)
        else:
            half = len(codes) // 2
            for j in range(half):
                q_ref[:, pl.ds(j * width, width)] = (codes[j] | (codes[j + half] << 4)).astype(
                    jnp.uint8)

    return kernel


def _fp_rot_decoder(bits: int, block: int, mode: str):
    """Kernel: packed codes and block scales -> blocks, `_unrotate(decode_basis(p))`
    on pieces. The scales, by mode: "code" E8M0 codes; "row" E4M3 codes and
    the program's row scale; "scale" float32 block scales."""
    width = min(block, rotation._LO)
    half = block // width // 2

    def kernel(q_ref, s_ref, h_ref, *refs):
        from jax.experimental import pallas as pl

        o_ref = refs[-1]
        if mode == "code":
            scale = _e8m0_values(refs[0][...])
        elif mode == "row":
            scale = _e4m3_values(refs[0][...]) * refs[1][...]
        else:
            scale = refs[0][...]
        scale = scale[:, None]

        def load(lo, k):  # k == width: piece lo // width
            if bits == 8:
                return _element_values(q_ref[:, pl.ds(lo, k)], 8) * scale
            if half == 0:  # the piece's two halves share its bytes
                # Each byte twice, then each half's nibble: joining two decoded
                # halves (stack, transpose) let XLA:CPU fold the transpose
                # into the product's contraction, which sums in another order.
                b = q_ref[...]
                b = jnp.broadcast_to(b[:, None, :], (b.shape[0], 2, k // 2)).reshape(-1, k)
                high = jax.lax.iota(jnp.int32, k) >= k // 2
                shift = jnp.where(high, 4, 0).astype(jnp.uint8)[None, :]
                return _element_values((b >> shift) & jnp.uint8(15), 4) * scale
            j, part = (lo // width) % half, (lo // width) // half
            b = q_ref[:, pl.ds(j * width, width)]
            return _element_values((b >> 4) if part else (b & jnp.uint8(15)), 4) * scale

        pieces = rotation.transform_pieces(load, s_ref, h_ref, block, width, inverse=True)
        for k, p in enumerate(pieces):
            o_ref[:, pl.ds(k * width, width)] = p

    return kernel
