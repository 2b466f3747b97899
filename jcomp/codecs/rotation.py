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
import numpy as np

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


# ---------------------------------------------------------------- the GPU form
#
# On a GPU, XLA compiles `_fwht`'s product with H_LO to a Triton gemm that
# writes the rotated blocks to memory, and the quantizer's reductions and
# packing read them back (kernel I/O 16 B per operand byte for an int4:rot
# psum of 64 MiB over 8 H100s, against 4 for lax.psum; benchmarks/aot.py).
# So there the transform runs inside Pallas (Triton) kernels that also
# quantize or dequantize: each block is read once and written once, coded.
# `on_gpu` picks them when the program is lowered for CUDA; every other
# platform keeps the XLA form, unchanged.
#
# In a kernel a block is a list of pieces: (TR, W) arrays of W consecutive
# elements of TR blocks, in order. W is at most LO and divides a packing run
# (blockwise._pack), so a piece of codes is a contiguous run of bytes.

_TILE_ELEMENTS = 8192  # per kernel program: (TR, BL) float32 blocks in registers
_MIN_DIM = 16  # Triton's dot needs every dimension of at least 16


def piece_width(block: int, per: int = 1) -> int:
    """W for blocks of `block` elements packed `per` codes to a byte."""
    return min(block, _LO, max(block // per, 1))


def gpu_tile(n_blocks: int, block: int, per: int = 1):
    """Blocks per kernel program (a power of two dividing n_blocks), or None
    where the kernels do not apply and the XLA form runs on GPUs too."""
    if block & (block - 1) or piece_width(block, per) < _MIN_DIM:
        return None
    tile = 1
    while tile * 2 * block <= max(_TILE_ELEMENTS, _MIN_DIM * block) and n_blocks % (tile * 2) == 0:
        tile *= 2
    return tile if tile >= _MIN_DIM else None


def on_gpu(args, xla, cuda):
    """`cuda(*args)` where the program is lowered for CUDA, else `xla(*args)`.
    The choice is made at lowering: the other branch never reaches a compiler."""
    return jax.lax.platform_dependent(*args, default=xla, cuda=cuda)


def _pallas():
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as pltriton

    return pl, pltriton


def _varying_like(c, x):
    """Constant c with x's varying mesh axes (a shard_map body checks them)."""
    axes = tuple(getattr(jax.typeof(x).mat, "varying", ()) or ())
    return jax.lax.pcast(c, axes, to="varying") if axes else c


def kernel_call(kernel, x_NxBL, block: int, tile: int, outs, *, extra=(), interpret=False):
    """pallas_call of kernel(x_ref, signs_ref, h_ref, *extra_refs, *out_refs) over
    programs of `tile` rows of x_NxBL (N rows of BL). `outs`: (shape per row,
    dtype) of each output; `extra`: (array, shape per row) row-blocked inputs,
    or (array, n) for a 1-D array read one element per program, the one at
    program * tile // n (a value per coded row of n blocks)."""
    pl, pltriton = _pallas()
    n = x_NxBL.shape[0]
    lo = min(block, _LO)
    mat = jax.typeof(x_NxBL).mat

    def rows(tail):
        return pl.BlockSpec((tile, *tail), lambda i, k=len(tail): (i, *([0] * k)))

    consts = [_varying_like(_rot_signs(block), x_NxBL), _varying_like(_hadamard(lo), x_NxBL)]
    in_specs = [rows((x_NxBL.shape[1],)), pl.BlockSpec((block,), lambda i: (0,)),
                pl.BlockSpec((lo, lo), lambda i: (0, 0))]
    for _, t in extra:
        in_specs.append(rows(t) if isinstance(t, tuple) else
                        pl.BlockSpec((1,), lambda i, per=t: (i * tile // per,)))
    return pl.pallas_call(
        kernel, grid=(n // tile,), in_specs=in_specs,
        out_specs=[rows(tail) for tail, _ in outs],
        out_shape=[jax.ShapeDtypeStruct((n, *tail), dtype, manual_axis_type=mat)
                   for tail, dtype in outs],
        compiler_params=pltriton.CompilerParams(), interpret=interpret,
        name="jcomp_rotation")(x_NxBL, *consts, *[a for a, _ in extra])


def _butterfly_pieces(groups):
    """`_butterflies` on a list of HI groups (each a list of pieces): the same
    adds, in the same order, so the results agree bit for bit."""
    n, h = len(groups), 1
    while h < n:
        r = min(8, n // h)
        for a in range(n // (r * h)):
            for b in range(h):
                idx = [a * r * h + i * h + b for i in range(r)]
                step = 1
                while step < r:
                    for i in range(r):
                        if not i & step:
                            p, q = groups[idx[i]], groups[idx[i + step]]
                            groups[idx[i]] = [u + v for u, v in zip(p, q)]
                            groups[idx[i + step]] = [u - v for u, v in zip(p, q)]
                    step *= 2
        h *= r
    return groups


def transform_pieces(load, s_ref, h_ref, block: int, width: int, *, inverse: bool):
    """Inside a kernel: the block's rotation (`_rotate`, or `_unrotate` with
    `inverse`) as block // width pieces of `width`. `load(lo, n)` gives the
    block's elements [lo, lo + n) as a (TR, n) array."""
    pl, _ = _pallas()
    lo = min(block, _LO)
    groups = []
    for g in range(block // lo):
        x = load(g * lo, lo)
        if not inverse:
            x = x * s_ref[pl.ds(g * lo, lo)][None, :]
        groups.append([jnp.dot(x, h_ref[:, pl.ds(c * width, width)],
                               precision=jax.lax.Precision.HIGHEST)
                       for c in range(lo // width)])
    scale = 1.0 / math.sqrt(block)
    pieces = [p * scale for grp in _butterfly_pieces(groups) for p in grp]
    if inverse:
        pieces = [p * s_ref[pl.ds(k * width, width)][None, :] for k, p in enumerate(pieces)]
    return pieces


def _rotation_kernel(inverse: bool, block: int, width: int):
    def kernel(x_ref, s_ref, h_ref, o_ref):
        pl, _ = _pallas()
        pieces = transform_pieces(lambda lo, n: x_ref[:, pl.ds(lo, n)], s_ref, h_ref, block,
                                  width, inverse=inverse)
        for k, p in enumerate(pieces):
            o_ref[:, pl.ds(k * width, width)] = p
    return kernel


def rotate_gpu(x_RxNBxBL, *, inverse: bool = False, interpret: bool = False, tile=None):
    """`_rotate` (or `_unrotate`) as one Pallas kernel (`gpu_applies` must hold).
    `tile` (blocks per program) changes no value; under `interpret` on a CPU, a
    product of at least 64 rows rounds as `_fwht`'s one large product does."""
    block = x_RxNBxBL.shape[-1]
    n = math.prod(x_RxNBxBL.shape[:-1])
    width = piece_width(block)
    (y,) = kernel_call(_rotation_kernel(inverse, block, width), x_RxNBxBL.reshape(n, block),
                       block, tile or gpu_tile(n, block), [((block,), jnp.float32)],
                       interpret=interpret)
    return y.reshape(x_RxNBxBL.shape)


def gpu_applies(shape, dtype, per: int = 1) -> bool:
    """Whether float32 blocks of `shape` (*lead, NB, BL) have a kernel form."""
    return (jnp.dtype(dtype) == jnp.float32 and len(shape) >= 1
            and gpu_tile(math.prod(shape[:-1]), shape[-1], per) is not None)


def rotate(x_RxNBxBL):
    """`_rotate`, by the kernel where the program runs on a GPU."""
    if not gpu_applies(x_RxNBxBL.shape, x_RxNBxBL.dtype):
        return _rotate(x_RxNBxBL)
    return on_gpu((x_RxNBxBL,), _rotate, rotate_gpu)


def unrotate(x_RxNBxBL):
    """`_unrotate`, by the kernel where the program runs on a GPU."""
    if not gpu_applies(x_RxNBxBL.shape, x_RxNBxBL.dtype):
        return _unrotate(x_RxNBxBL)
    return on_gpu((x_RxNBxBL,), _unrotate, lambda v: rotate_gpu(v, inverse=True))
