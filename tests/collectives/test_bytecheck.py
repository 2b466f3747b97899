"""cc.value_and_grad checks its bytes against the plain gradient program
(jcomp/collectives/jit/bytecheck.py): an axis on which it sends more is named."""
import warnings

import jax
import pytest
from jax.sharding import PartitionSpec as P

from jcomp import collectives as cc
from tests.collectives import tp_mlp


@pytest.fixture(scope="module")
def setup():
    return tp_mlp.make()


_loss = tp_mlp.loss


def _trace(mesh, params, x, **kw):
    with jax.set_mesh(mesh), warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        jax.jit(cc.value_and_grad(_loss, mesh=mesh, mean_over="examples", codec="int8",
                                  **kw)).lower(params, x)
    return [w for w in got if issubclass(w.category, cc.ExtraBytesWarning)]


def test_a_step_that_sends_more_on_one_axis_is_named(setup):
    """param_specs that call a tensor-parallel kernel replicated: the per-rank map
    then gathers it over "model" every step, which the plain program never does.
    The warning names the axis, the factor and the leaf."""
    mesh, params, x, specs = setup
    got = _trace(mesh, params, x, param_specs={**specs, "w": P()})
    assert len(got) == 1
    text = str(got[0].message)
    assert "sends more bytes than the plain program on axis 'model'" in text, text
    assert "leaves ['w']" in text and "all-gather f32[64, 512]" in text, text
    assert "'data'" not in text  # int8 sends less there


def test_a_step_that_sends_no_more_is_quiet(setup):
    mesh, params, x, specs = setup
    assert _trace(mesh, params, x, param_specs=specs) == []


def test_check_bytes_false_compiles_no_twin(setup):
    mesh, params, x, specs = setup
    assert _trace(mesh, params, x, param_specs={**specs, "w": P()}, check_bytes=False) == []


def test_a_codec_that_draws_is_checked_with_the_callers_key(setup):
    """int8:sr draws: the twins compile with a key of the caller's type, and the
    check runs (it names the axis) instead of failing to compile."""
    mesh, params, x, specs = setup
    with jax.set_mesh(mesh), warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        fn = cc.value_and_grad(_loss, mesh=mesh, mean_over="examples", codec="int8:sr",
                               param_specs={**specs, "w": P()})
        jax.jit(fn).lower(params, x, jax.random.key(0))
    texts = [str(w.message) for w in got if issubclass(w.category, cc.ExtraBytesWarning)]
    assert len(texts) == 1 and "on axis 'model'" in texts[0], texts
