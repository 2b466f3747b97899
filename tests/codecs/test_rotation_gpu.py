"""The GPU form of the rotated codecs (Pallas kernels), run here by Pallas's
interpreter, against the XLA form every other platform runs: bit for bit."""
import numpy as np
import pytest

import jax
import jax.numpy as jnp

from jcomp import codecs
from jcomp.codecs import rotation
from jcomp.codecs.blockwise import _to_blocks
from jcomp.codecs.gpu import _round_even
from jcomp.codecs.rotation import _rotate, _unrotate

# A tile of 64 blocks: on XLA:CPU a product of at least 64 rows rounds as one
# large product does (smaller ones take another kernel), so the interpreter's
# per-program products agree with `_fwht`'s bit for bit.
TILE = 64


def _bits(a):
    a = np.asarray(a)
    return a.view(np.uint32) if a.dtype == np.float32 else a


def _data(shape, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(np.float32)
    x *= np.exp(2 * rng.standard_normal(shape)).astype(np.float32)  # heavy tails
    x.reshape(-1, shape[-1])[0, 3] = np.nan
    x.reshape(-1, shape[-1])[1, 5] = np.inf
    x.reshape(-1, shape[-1])[2, :] = 0.0
    return x


@pytest.mark.parametrize("spec,shape", [
    ("int4:rot", (64, 256)), ("int8:rot", (32, 2, 256)), ("int2:rot", (64, 256)),
    ("int4:rot:block=64", (128, 64)), ("int4:rot:block=1024", (64, 1024)),
    ("mxfp4:rot", (64, 256)), ("mxfp4:rot:block=16", (32, 2, 256)),
    ("mxfp4:rot:block=128", (64, 256)), ("mxfp8:rot", (64, 256)),
    ("mxfp8:rot:block=64", (64, 256)),
    ("nvfp4:rot", (4, 1024)), ("nvfp4:rot:block=32", (8, 1024)), ("nvfp4:rot:block=64", (4, 2048)),
])
def test_kernels_agree_with_xla_form_bit_for_bit(spec, shape):
    codec = codecs.parse(spec)
    x = _to_blocks(jnp.asarray(_data(shape)), codec.block)
    assert codec._fused(x.shape)
    want = jax.jit(lambda v: codec.encode_basis(_rotate(v)))(x)
    got = jax.jit(lambda v: codec.encode_gpu(v, interpret=True, tile=TILE))(x)
    assert set(got) == set(want)
    for k in want:
        assert got[k].shape == want[k].shape and got[k].dtype == want[k].dtype
        np.testing.assert_array_equal(_bits(got[k]), _bits(want[k]))
    back = jax.jit(lambda p: _unrotate(codec.decode_basis(p)))(want)
    back_gpu = jax.jit(lambda p: codec.decode_gpu(p, interpret=True, tile=TILE))(want)
    np.testing.assert_array_equal(_bits(back_gpu), _bits(back))
    for inverse, ref in ((False, _rotate), (True, _unrotate)):
        y = jax.jit(lambda v: rotation.rotate_gpu(v, inverse=inverse, interpret=True,
                                                  tile=TILE))(x)
        np.testing.assert_array_equal(_bits(y), _bits(jax.jit(ref)(x)))


def test_nvfp4_row_scale_spans_kernel_programs():
    """A row of many programs' blocks: its scale comes from every block's absmax,
    and a row whose blocks all hold NaN or Inf codes as the XLA form does."""
    codec = codecs.parse("nvfp4:rot")
    x = _data((3, 4096), seed=1)
    x[0, 4000] = 1e30  # the row's largest block sits in its last program
    x[1, :] = np.inf
    blocks = _to_blocks(jnp.asarray(x), codec.block)
    want = jax.jit(lambda v: codec.encode_basis(_rotate(v)))(blocks)
    got = jax.jit(lambda v: codec.encode_gpu(v, interpret=True, tile=TILE))(blocks)
    for k in want:
        np.testing.assert_array_equal(_bits(got[k]), _bits(want[k]))


def test_round_even_is_jnp_round():
    v = np.concatenate([np.arange(-20, 20, 0.25, dtype=np.float32),
                        np.nextafter(np.float32([0.5, -0.5, 1.5, 2.5]), np.float32(0)),
                        np.nextafter(np.float32([0.5, -0.5, 1.5, 2.5]), np.float32(9)),
                        np.float32([0.49999997, 7.5, -7.5, 1e7 + 0.5, 3e38])])
    np.testing.assert_array_equal(np.asarray(_round_even(jnp.asarray(v))), np.round(v))


def test_cpu_program_is_the_xla_form():
    """On a CPU the lowering keeps only the XLA branch: no kernel, the same values."""
    codec = codecs.parse("int4:rot")
    x = jnp.asarray(_data((64, 256)))
    f = jax.jit(lambda v: codec.decode(codec.encode(v), v.shape, v.dtype))
    text = f.lower(x).compile().as_text()
    assert "custom-call" not in text and "pallas" not in text
    blocks = _to_blocks(x, codec.block)
    ref = jax.jit(lambda v: _unrotate(codec.decode_basis(codec.encode_basis(_rotate(v)))))(blocks)
    np.testing.assert_array_equal(_bits(f(x)), _bits(np.asarray(ref).reshape(x.shape)))


def test_where_the_kernels_apply():
    assert rotation.gpu_tile(65536, 256, 2) == 32  # 8192 elements per program
    assert rotation.gpu_tile(8, 256) is None  # fewer than 16 blocks: Triton's dot needs 16 rows
    assert rotation.gpu_tile(1024, 48) is None  # not a power of two
    assert rotation.gpu_tile(1024, 16, 2) is None  # codes of 8 per packing run
    # Stochastic rounding and short blocks keep the XLA form on GPUs too.
    assert not codecs.parse("int4:rot:sr")._fused((64, 256))
    assert not codecs.parse("int4:rot:block=32")._fused((64, 32))
    assert codecs.parse("int8:rot:block=32")._fused((64, 32))
    assert not codecs.parse("int4")._fused((64, 256))
    assert codecs.parse("mxfp4:rot")._fused((64, 32)) and codecs.parse("nvfp4:rot")._fused((64, 16))
    assert not codecs.parse("mxfp4:rot:block=8")._fused((64, 8))  # Triton's dot: 16
    assert not codecs.parse("nvfp4:rot:sr")._fused((64, 16)) and not codecs.parse("mxfp4")._fused((64, 32))
