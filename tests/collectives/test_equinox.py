"""An Equinox step (eqx.filter_jit, a Megatron MLP of eqx.nn.Linear on a
(data 4, model 2) mesh; tests/collectives/equinox_step.py) through the byte
meter and cc.value_and_grad."""
import warnings

import jax
import numpy as np
import pytest

eqx = pytest.importorskip("equinox", reason="equinox is not installed (pip install '.[test]')")

from jcomp.meter import wire  # noqa: E402
from tests.collectives import equinox_step as es  # noqa: E402


@pytest.fixture(scope="module")
def setup():
    mesh = es.make_mesh()
    return (mesh,) + es.init(mesh)


def test_the_meter_reads_a_filter_jit_step(setup):
    """wire.measure on eqx.filter_jit raised AttributeError: 'Compiled' object
    has no attribute 'as_text'."""
    mesh, model, tx, opt_state, batch = setup
    plain = es.step(mesh, model, tx)
    report = wire.measure(plain, model, opt_state, batch, mesh=mesh)
    assert set(report.by_mesh_axis()) == {"data", "model"}
    compiled = plain.lower(model, opt_state, batch).compile()
    assert wire.measure_compiled(compiled, mesh).by_axis() == report.by_axis()


def test_int8_keeps_the_layout_and_sends_a_quarter_over_data(setup):
    """Specs read from the arrays' own shardings outside jit: the gradients come
    back split as their parameters, within int8's error of the plain ones, and
    "data" carries about a quarter of the plain step's bytes, "model" the same."""
    mesh, model, tx, opt_state, batch = setup
    plain, coded = es.step(mesh, model, tx), es.step(mesh, model, tx, "int8")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no byte-check or replication warning
        _, _, loss_c, g_c = coded(model, opt_state, batch)
    _, _, loss_p, g_p = plain(model, opt_state, batch)
    np.testing.assert_allclose(float(loss_c), float(loss_p), rtol=1e-6)
    params = eqx.filter(model, eqx.is_array)
    for p, a, b in zip(jax.tree.leaves(params), jax.tree.leaves(g_p), jax.tree.leaves(g_c)):
        assert b.sharding.spec == p.sharding.spec
        a, b = np.asarray(a), np.asarray(b)
        assert np.abs(a - b).max() <= 0.02 * np.abs(a).max()
    b_plain = wire.measure(plain, model, opt_state, batch, mesh=mesh).by_mesh_axis()
    b_coded = wire.measure(coded, model, opt_state, batch, mesh=mesh).by_mesh_axis()
    assert b_coded["data"] <= 0.3 * b_plain["data"]
    assert b_coded["model"] <= 1.01 * b_plain["model"]


def test_param_specs_none_warns_that_the_gradients_come_back_replicated(setup):
    """Inside filter_jit the arrays are traced and their Auto-axis layout is not
    in their types: param_specs=None took them as replicated without a word."""
    mesh, model, tx, opt_state, batch = setup
    with pytest.warns(UserWarning, match=r"param_specs=None .* 4 parameter\(s\) traced inside "
                                         r"jax.jit .* \['model'\]: they are taken as "
                                         r"replicated"):
        es.step(mesh, model, tx, "int8", param_specs=None).lower(model, opt_state, batch)
