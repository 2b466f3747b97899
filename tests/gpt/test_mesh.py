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


# ------------------------------------------------------------------ two hops

def test_dcn_data_splits_the_data_axis_into_contiguous_blocks():
    """dcn_data=2 on (4, 2, 1): axes ('dcn', 'data', 'tensor', 'pipeline'), sizes
    (2, 2, 2, 1); in one process each dcn group is a contiguous half of the
    device order (an emulation of two nodes), tensor neighbours still adjacent,
    and data rank dcn * 2 + data holds the rows the unsplit mesh's rank does."""
    from jcomp.gpt.mesh import DCN, axis_sizes
    mesh = make_mesh((4, 2, 1), dcn_data=2)
    assert mesh.axis_names == (DCN,) + AXES
    assert dict(mesh.shape) == {"dcn": 2, "data": 2, "tensor": 2, "pipeline": 1}
    assert mesh.axis_types == (jax.sharding.AxisType.Auto,) * 4
    ids = np.vectorize(lambda dev: dev.id)(mesh.devices)
    flat = np.vectorize(lambda dev: dev.id)(make_mesh((4, 2, 1)).devices)
    np.testing.assert_array_equal(ids.reshape(4, 2, 1), flat)
    assert sorted(ids[0].ravel()) == [0, 1, 2, 3] and sorted(ids[1].ravel()) == [4, 5, 6, 7]
    assert axis_sizes((4, 2, 1), 1) == {"data": 4, "tensor": 2, "pipeline": 1}
    assert make_mesh((4, 2, 1), dcn_data=1).axis_names == AXES  # no split: as before


@pytest.mark.parametrize("dcn, error", [(3, ValueError), (8, ValueError), (0, ValueError),
                                        (-1, ValueError), (True, TypeError), (2.0, TypeError)])
def test_bad_dcn_data_is_refused_by_name(dcn, error):
    with pytest.raises(error, match=r"mesh\.dcn_data"):
        make_mesh((4, 2, 1), dcn_data=dcn)


def test_dcn_groups_must_be_whole_processes():
    from jcomp.gpt.mesh import check_processes
    check_processes((4, 2, 1), 2, 2)  # one process per group
    check_processes((4, 2, 1), 2, 4)  # two per group, each one data rank
    check_processes((4, 2, 1), 1, 3)  # no split: nothing to check
    with pytest.raises(ValueError, match=r"mesh\.dcn_data=4 does not divide the 2 processes"):
        check_processes((4, 2, 1), 4, 2)
    with pytest.raises(ValueError, match=r"mesh\.dcn_data=2: each slow-hop group spans 4"):
        check_processes((4, 1, 1), 2, 8)


class _FakeDevice:
    """What create_hybrid_device_mesh reads of a CPU device."""
    platform, device_kind = "cpu", "cpu"

    def __init__(self, i, process):
        self.id, self.process_index = i, process

    def __repr__(self):
        return f"D{self.id}@{self.process_index}"


def test_several_processes_make_each_dcn_group_whole_processes():
    """Two processes whose devices come interleaved: each dcn group is one
    process's devices (create_hybrid_device_mesh, processes as granules)."""
    devices = [_FakeDevice(i, i % 2) for i in range(8)]
    mesh = make_mesh((4, 2, 1), devices=devices, dcn_data=2)
    procs = np.vectorize(lambda d: d.process_index)(mesh.devices)
    assert (procs[0] == 0).all() and (procs[1] == 1).all(), mesh.devices
    with pytest.raises(ValueError, match=r"mesh\.dcn_data=4 does not divide the 2 processes"):
        make_mesh((4, 2, 1), devices=devices, dcn_data=4)


def test_processes_of_unequal_sizes_cannot_be_dcn_groups():
    devices = [_FakeDevice(i, 0 if i < 5 else 1) for i in range(8)]
    with pytest.raises(ValueError, match=r"mesh\.dcn_data=2: the processes hold different"):
        make_mesh((4, 2, 1), devices=devices, dcn_data=2)
