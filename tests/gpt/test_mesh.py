"""Tests for jcomp.gpt.mesh: shape resolution, its errors, and device layout."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from jcomp.gpt.mesh import AXES, make_mesh, resolve_shape


def test_axes_names():
    assert AXES == ("data", "tensor", "pipeline")


@pytest.mark.parametrize(
    "shape, expected",
    [
        ((-1, 2, 2), (2, 2, 2)),
        ((2, -1, 1), (2, 4, 1)),
        ((1, 2, -1), (1, 2, 4)),
        ((-1, 1, 1), (8, 1, 1)),
        ({"data": -1, "tensor": 4}, (2, 4, 1)),
        ({"pipeline": -1}, (1, 1, 8)),
        ({"data": 2, "tensor": 2, "pipeline": 2}, (2, 2, 2)),
        ([1, 8, 1], (1, 8, 1)),
    ],
)
def test_resolve_shape(shape, expected):
    assert resolve_shape(shape, 8) == expected


def test_resolve_shape_returns_python_ints():
    assert all(type(s) is int for s in resolve_shape((np.int64(2), -1, 1), 8))


def test_product_mismatch_names_axes_and_counts():
    with pytest.raises(ValueError) as e:
        resolve_shape({"data": 2, "tensor": 2, "pipeline": 4}, 8)
    assert "data=2 x tensor=2 x pipeline=4 = 16 devices, but 8 devices are available" in str(e.value)


def test_product_too_small():
    with pytest.raises(ValueError, match=r"data=1 x tensor=2 x pipeline=2 = 4 devices, but 8"):
        resolve_shape((1, 2, 2), 8)


@pytest.mark.parametrize("bad", [(0, 2, 4), (2, -2, 4), (2, 2, -3)])
def test_zero_or_below_minus_one(bad):
    with pytest.raises(ValueError) as e:
        resolve_shape(bad, 8)
    msg = str(e.value)
    axis = AXES[next(i for i, s in enumerate(bad) if s == 0 or s < -1)]
    assert f"axis {axis!r}" in msg and ">= 1 or -1" in msg
    assert "data=%d x tensor=%d x pipeline=%d" % bad in msg


def test_two_free_axes():
    with pytest.raises(ValueError) as e:
        resolve_shape((-1, 2, -1), 8)
    msg = str(e.value)
    assert "at most one" in msg and "data=-1 x tensor=2 x pipeline=-1" in msg and "8 devices" in msg


def test_free_axis_that_does_not_divide():
    with pytest.raises(ValueError) as e:
        resolve_shape({"data": -1, "tensor": 3}, 8)
    msg = str(e.value)
    assert "data=-1 x tensor=3 x pipeline=1" in msg and "3 devices" in msg and "8 devices" in msg


def test_unknown_axis():
    with pytest.raises(ValueError, match=r"unknown axes \['model'\].*allowed axes"):
        resolve_shape({"data": 2, "model": 4}, 8)


def test_wrong_tuple_length():
    with pytest.raises(ValueError, match=r"3 sizes.*got 2"):
        resolve_shape((2, 4), 8)


@pytest.mark.parametrize("bad", [(2.0, 2, 2), (True, 8, 1), ("2", 2, 2)])
def test_non_int_sizes(bad):
    with pytest.raises(TypeError, match="must be an int"):
        resolve_shape(bad, 8)


def test_bad_shape_type_and_device_count():
    with pytest.raises(TypeError, match="mesh shape"):
        resolve_shape("2x2x2", 8)
    with pytest.raises(ValueError, match="n_devices"):
        resolve_shape((1, 1, 1), 0)


def _tensor_fastest_ids(shape):
    d, t, p = shape
    return np.array(
        [[[(i * p + k) * t + j for k in range(p)] for j in range(t)] for i in range(d)]
    )


@pytest.mark.parametrize("shape", [(2, 2, 2), (1, 4, 2), (2, 1, 4), (8, 1, 1)])
def test_make_mesh_shape_names_and_layout(shape):
    mesh = make_mesh(shape)
    assert mesh.axis_names == AXES
    assert tuple(mesh.devices.shape) == shape
    assert dict(mesh.shape) == dict(zip(AXES, shape))
    assert mesh.axis_types == (jax.sharding.AxisType.Auto,) * 3
    ids = np.vectorize(lambda dev: dev.id)(mesh.devices)
    # On CPU the device order is jax.devices(); tensor neighbours are adjacent ids.
    np.testing.assert_array_equal(ids, _tensor_fastest_ids(shape))


def test_make_mesh_on_given_devices():
    devices = jax.devices()[4:]
    mesh = make_mesh({"tensor": -1}, devices=devices)
    assert tuple(mesh.devices.shape) == (1, 4, 1)
    assert [d.id for d in mesh.devices.ravel()] == [d.id for d in devices]
    with pytest.raises(ValueError, match="8 devices, but 4 devices are available"):
        make_mesh((2, 2, 2), devices=devices)
    with pytest.raises(ValueError, match="devices"):
        make_mesh((1, 1, 1), devices=[])


def test_mesh_works_with_device_put_and_shard_map():
    mesh = make_mesh((2, 2, 2))
    x_8x4 = jnp.arange(32.0).reshape(8, 4)
    x_sharded = jax.device_put(x_8x4, NamedSharding(mesh, P(("data", "pipeline"), "tensor")))
    # Auto axes keep eager indexing of sharded arrays available.
    np.testing.assert_array_equal(x_sharded[3], x_8x4[3])

    def tensor_sum(block_2x2):
        return jax.lax.psum(block_2x2, "tensor")

    summed = jax.shard_map(
        tensor_sum,
        mesh=mesh,
        in_specs=P(("data", "pipeline"), "tensor"),
        out_specs=P(("data", "pipeline"), None),
    )(x_sharded)
    expected = x_8x4[:, :2] + x_8x4[:, 2:]
    np.testing.assert_array_equal(np.asarray(summed), np.asarray(expected))
