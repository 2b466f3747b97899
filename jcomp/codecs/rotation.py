"""The rotation of `:rot` block quantizers: a randomized Hadamard transform per
block (BL a power of two), applied before quantizing and inverted after decoding.

H D / sqrt(BL), with D a fixed +-1 diagonal, spreads a block's outliers over all
of its elements, so the absmax scale sits near the block's RMS instead of its
largest entry and the rounding step shrinks. It is orthonormal and linear:
decode inverts it exactly, and a sum of rotated rows is the rotation of the
sum, so dense collectives may sum in the rotated basis. D comes from a fixed
seed, the same on every device and step: nothing extra travels."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

_ROT_SEED = 0x407A7E


def _rot_signs(block: int):
    """The +-1 diagonal D for blocks of `block` elements: a NumPy PCG64 stream's
    raw bits (stable across NumPy releases), a trace-time constant."""
    import numpy as np

    raw = np.random.PCG64(np.random.SeedSequence(_ROT_SEED)).random_raw(block)
    return jnp.asarray(1.0 - 2.0 * (raw & 1).astype(np.float32))


def _butterflies(y, lead):
    """The Hadamard transform along axis -2 of y (*lead, LEN, W): radix-8 passes,
    each combining 8 slices (W contiguous elements) of stride h in registers, in
    the order of the radix-2 butterflies (stride 1 first)."""
    n, w, h = y.shape[-2], y.shape[-1], 1
    while h < n:
        r = min(8, n // h)
        z = y.reshape(*lead, n // (r * h), r, h, w)
        p = [z[..., i, :, :] for i in range(r)]
        step = 1
        while step < r:
            for i in range(r):
                if not i & step:
                    p[i], p[i + step] = p[i] + p[i + step], p[i] - p[i + step]
            step *= 2
        y = jnp.stack(p, axis=-3).reshape(*lead, n, w)
        h *= r
    return y


def _hadamard(n: int):
    """The n x n Sylvester Hadamard matrix, entry (i, j) = (-1)**popcount(i & j),
    a trace-time constant."""
    import numpy as np

    bits = np.bitwise_and.outer(np.arange(n), np.arange(n))
    ones = np.vectorize(lambda v: bin(v).count("1"))(bits)
    return jnp.asarray(1.0 - 2.0 * (ones & 1), jnp.float32)


# The low index bits of a block go through one matrix product with H_LO, the rest
# through butterflies. H_BL = H_HI (x) H_LO (Sylvester order), so the two parts
# compose to the whole transform. On XLA:CPU a product with H_32 (64 flops per
# element, a plain GEMM) beat the butterflies of the same 5 bits, which pair
# elements closer than a vector apart: in configs/base.py's hybrid step the
# rotation's time fell by a fifth.
_LO = 32


def _fwht(x_RxNBxBL):
    """Orthonormal fast Walsh-Hadamard transform along the last axis (a power of
    two, BL), its own inverse, with no matrix past 32 x 32: the block as an HI x LO
    matrix (LO = min(BL, 32)), a product with H_LO along its rows, then radix-8
    butterflies along its columns, whose slices are LO contiguous elements.

    The product runs at Precision.HIGHEST, so that a GPU does not round the
    operands to TF32: the transform stays within float32 rounding of the exact
    one (the tests compare it with the dense matrix and with radix-2 passes)."""
    b = x_RxNBxBL.shape[-1]
    lead = x_RxNBxBL.shape[:-1]
    lo = min(b, _LO)
    y = jnp.matmul(x_RxNBxBL.reshape(-1, lo), _hadamard(lo),
                   precision=jax.lax.Precision.HIGHEST).reshape(*lead, b // lo, lo)
    if b > lo:
        y = _butterflies(y, lead)
    return y.reshape(*lead, b) * (1.0 / math.sqrt(b))


def _rotate(x_RxNBxBL):
    return _fwht(x_RxNBxBL * _rot_signs(x_RxNBxBL.shape[-1]))


def _unrotate(x_RxNBxBL):
    return _fwht(x_RxNBxBL) * _rot_signs(x_RxNBxBL.shape[-1])
