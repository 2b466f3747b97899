"""The rotation of rotated block quantizers (`int4:rot`, ...): a randomized
Hadamard transform per block, applied before quantizing and inverted after
decoding.

Shape letters (jcomp's legend): R the leading (row) dimensions, NB the blocks
per row, BL a block's length (a power of two)."""
from __future__ import annotations

import math

import jax.numpy as jnp

# Rotation. A randomized Hadamard transform, H D / sqrt(BL) with D a fixed +-1
# diagonal, spreads a block's outliers over all of its BL elements, so the
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


def _fwht(x_RxNBxBL):
    """Orthonormal fast Walsh-Hadamard transform along the last axis (a power of
    two, BL), its own inverse, with no BL x BL matrix.

    A block of BL = HI * LO (LO <= 8) is an HI x LO matrix; the transform is
    that of its low index bits followed by that of its high bits. The low bits'
    butterflies run on the transposed block, so that every butterfly of both
    passes adds contiguous runs of elements. On XLA:CPU, 1M elements in blocks of
    256 took 0.6x the time of log2(BL) radix-2 passes along the last axis,
    whose first passes pair neighbours. The additions are those of the radix-2
    passes, in their order: the values are the same, bit for bit."""
    b = x_RxNBxBL.shape[-1]
    lead = x_RxNBxBL.shape[:-1]
    hi = max(b // 8, 1)
    y = jnp.swapaxes(x_RxNBxBL.reshape(*lead, hi, b // hi), -1, -2)
    y = jnp.swapaxes(_butterflies(y, lead), -1, -2)
    return _butterflies(y, lead).reshape(*lead, b) * (1.0 / math.sqrt(b))


def _rotate(x_RxNBxBL):
    return _fwht(x_RxNBxBL * _rot_signs(x_RxNBxBL.shape[-1]))


def _unrotate(x_RxNBxBL):
    return _fwht(x_RxNBxBL) * _rot_signs(x_RxNBxBL.shape[-1])
