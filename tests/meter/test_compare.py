"""jcomp.meter.compare: two programs' bytes per mesh axis, side by side."""
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jcomp.meter import compare


@pytest.fixture(scope="module")
def programs():
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
    spec = P(("data", "model"))
    x = jax.device_put(np.ones((8, 256), np.float32), NamedSharding(mesh, spec))
    sm = lambda f: jax.jit(jax.shard_map(f, mesh=mesh, in_specs=spec, out_specs=spec))
    plain = sm(lambda a: lax.psum(a, "data") * 1.0)
    # the same sum, plus a gather over "model" it did not need
    more = sm(lambda a: lax.psum(a, "data")
              + 0.0 * jnp.sum(lax.all_gather(a, "model", tiled=True), 0, keepdims=True))
    return mesh, x, plain, more


def test_a_program_sending_more_on_one_axis_is_named(programs):
    mesh, x, plain, more = programs
    c = compare.compare(plain, more, x, mesh=mesh)
    assert set(c.extra()) == {"model"}
    p, s = c.extra()["model"]
    assert p == 0 and s > 0
    assert c.by_axis()["data"][0] == c.by_axis()["data"][1]
    assert [a.kind for a in c.added("model")] == ["all-gather"]
    assert c.added("data") == []
    assert "! model: sends more than the plain program" in c.table()
    with pytest.warns(compare.ExtraBytesWarning,
                      match=r"my step sends more bytes than the plain program on axis 'model'"
                            r".*collectives the plain program lacks: all-gather f32"):
        c.warn("my step")


def test_the_same_program_is_not_more(programs):
    mesh, x, plain, _ = programs
    c = compare.compare(plain, plain, x, mesh=mesh)
    assert c.extra() == {}
    assert c.message("x") is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        c.warn("x")


def test_tolerances_say_how_much_more_counts(programs):
    """rel and atol: an axis counts as more only past plain * (1 + rel) + atol."""
    mesh, x, plain, more = programs
    c = compare.compare(plain, more, x, mesh=mesh)
    sent = c.by_axis()["model"][1]
    assert compare.Comparison(c.plain, c.step, atol=sent).extra() == {}
    assert set(compare.Comparison(c.plain, c.step, atol=sent - 1).extra()) == {"model"}
