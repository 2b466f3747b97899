"""The long form of tests/collectives/test_ops.py: every op against jax.lax, its
backward codec and the absence of full-precision collectives, for every other
codec and with bfloat16 inputs (about 3 minutes on two cores)."""
import jax.numpy as jnp
import pytest

from tests.collectives import test_ops as ops
from tests.collectives.test_ops import mesh  # noqa: F401

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("codec,dtype", [(c, jnp.float32) for c in ops.CODECS_LONG]
                         + [(c, jnp.bfloat16) for c in ops.CODECS + ops.CODECS_LONG
                            if c not in ops.BF16_CODECS])
def test_every_op_matches_lax_within_the_codec_error(mesh, codec, dtype):  # noqa: F811
    ops.test_every_op_matches_lax_within_the_codec_error(mesh, codec, dtype)


@pytest.mark.parametrize("codec", ops.CODECS_LONG)
def test_backward_uses_bwd_codec(mesh, codec):  # noqa: F811
    ops.test_backward_uses_bwd_codec(mesh, codec)


@pytest.mark.parametrize("codec", ops.NO_F32_CODECS_LONG)
@pytest.mark.parametrize("op", ops.NO_F32_OPS)
def test_no_full_precision_collective_remains(mesh, codec, op):  # noqa: F811
    ops.test_no_full_precision_collective_remains(mesh, codec, op)
