"""The ('data', 'tensor', 'pipeline') device mesh, or ('dcn', 'data', 'tensor',
'pipeline') when the data axis is split into a slow and a fast hop.

Axis types are `Auto`, not `Explicit`. The train step runs inside
`jax.shard_map` over all three axes, where every axis is manual anyway, so
Explicit axes would buy nothing there; outside it they would make every
`device_put` input carry exactly the sharding shard_map expects, forbid eager
indexing of sharded arrays and break embedding lookups on batch-sharded
tokens. With Auto axes, `jax.device_put(x, NamedSharding(mesh, P(...)))` and
plain jit code work as usual.

Device order. `mesh.devices` has shape (data, tensor, pipeline), but devices
are laid out with 'tensor' varying fastest, then 'pipeline', then 'data':

    mesh.devices[d, t, p] = ordered[(d * P + p) * T + t]

where `ordered` is the device list as `mesh_utils.create_device_mesh` orders
it (the given order on CPU, sorted by id on GPU, topology-aware on TPU). The
T devices of one tensor group are therefore neighbours in device order and
stay inside one node whenever T divides the devices per node: tensor
parallelism all-reduces activations in every layer and is the axis that
needs the fastest links. 'pipeline' only sends activations between stage
neighbours and 'data' reduces gradients once per step, so they may span nodes.

Two hops (`dcn_data=k > 1`). The data axis of size D is split into a slow
factor 'dcn' of size k (nodes, slices or processes: the groups between which
the link is slow) and a fast factor 'data' of size D/k inside each group; the
mesh is ('dcn', 'data', 'tensor', 'pipeline') with sizes (k, D/k, T, P) and
data rank r = dcn_index * D/k + data_index. The data-parallel collectives then
run over the tuple ('dcn', 'data') (jcomp.gpt.sharding.data_axes), hop by hop.
Where the groups are:
  - several processes (`jax.process_count() > 1`): every dcn group is one or
    several whole processes, built by `mesh_utils.create_hybrid_device_mesh(...,
    process_is_granule=True)`; k must divide the process count and each group's
    devices must hold whole tensor x pipeline groups (`check_processes`);
  - one process (CPU emulation, one machine): the dcn groups are contiguous
    blocks of the device order above. Nothing about the link differs between
    the hops there: the split only names which collectives would cross nodes,
    so that the meter and the codecs treat them as such.
Within a group devices keep the tensor-fastest order above.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import jax
import numpy as np
from jax.experimental import mesh_utils

AXES = ("data", "tensor", "pipeline")
DCN = "dcn"  # the slow hop's factor of the data axis (mesh.dcn_data > 1)


def _sizes_from(shape) -> tuple:
    """Returns the three requested sizes (data, tensor, pipeline), unchecked."""
    if isinstance(shape, Mapping):
        unknown = sorted(str(k) for k in shape if k not in AXES)
        if unknown:
            raise ValueError(f"mesh shape has unknown axes {unknown}; allowed axes are {AXES}")
        # An axis left out of a mapping has size 1: {"data": -1} is pure data parallelism.
        return tuple(shape.get(a, 1) for a in AXES)
    if isinstance(shape, Sequence) and not isinstance(shape, (str, bytes)):
        if len(shape) != len(AXES):
            raise ValueError(
                f"mesh shape must give {len(AXES)} sizes for {AXES}; got {len(shape)}: {tuple(shape)}"
            )
        return tuple(shape)
    raise TypeError(
        f"mesh shape must be a mapping from {AXES} to sizes or a 3-tuple; got {type(shape).__name__}"
    )


def _describe(sizes) -> str:
    return " x ".join(f"{a}={s}" for a, s in zip(AXES, sizes))


def resolve_shape(shape, n_devices: int) -> tuple[int, int, int]:
    """Sizes (data, tensor, pipeline) for `n_devices` devices.

    `shape` is a mapping {axis: size} (missing axes have size 1) or a 3-tuple
    in AXES order. At most one size may be -1, meaning "all remaining devices".
    Raises ValueError when the sizes cannot use exactly `n_devices` devices.
    """
    if isinstance(n_devices, bool) or not isinstance(n_devices, (int, np.integer)):
        raise TypeError(f"n_devices must be an int; got {type(n_devices).__name__}")
    if n_devices < 1:
        raise ValueError(f"n_devices must be >= 1; got {n_devices}")
    sizes = _sizes_from(shape)
    for axis, size in zip(AXES, sizes):
        if isinstance(size, bool) or not isinstance(size, (int, np.integer)):
            raise TypeError(f"mesh size of axis {axis!r} must be an int; got {size!r}")
        if size == 0 or size < -1:
            raise ValueError(
                f"mesh size of axis {axis!r} must be >= 1 or -1 (the remaining devices); "
                f"got {_describe(sizes)}"
            )
    free = [i for i, s in enumerate(sizes) if s == -1]
    if len(free) > 1:
        raise ValueError(
            f"at most one mesh axis may be -1; got {_describe(sizes)} for {n_devices} devices"
        )
    known = math.prod(s for s in sizes if s != -1)
    if free:
        if n_devices % known:
            raise ValueError(
                f"mesh {_describe(sizes)}: the fixed axes use {known} devices, which does not "
                f"divide the {n_devices} devices available"
            )
        sizes = tuple(n_devices // known if s == -1 else s for s in sizes)
    if math.prod(sizes) != n_devices:
        raise ValueError(
            f"mesh {_describe(sizes)} = {math.prod(sizes)} devices, "
            f"but {n_devices} devices are available"
        )
    return tuple(int(s) for s in sizes)


def _device_grid_DxPxT(sizes, devices) -> np.ndarray:
    """Devices as an array [data, pipeline, tensor], tensor varying fastest."""
    d, t, p = sizes
    try:
        # Its last axis is the one it keeps on the fastest links.
        return np.asarray(mesh_utils.create_device_mesh((d, p, t), devices))
    except (ValueError, NotImplementedError, AssertionError):
        # Topologies it cannot fit this shape to fall back to the given order.
        return np.asarray(devices, dtype=object).reshape(d, p, t)


def _check_dcn_data(dcn_data):
    if isinstance(dcn_data, bool) or not isinstance(dcn_data, (int, np.integer)):
        raise TypeError(f"mesh.dcn_data must be an int; got {dcn_data!r}")
    if dcn_data < 1:
        raise ValueError(f"mesh.dcn_data must be >= 1; got {dcn_data}")


def axis_sizes(sizes, dcn_data: int = 1) -> dict:
    """The mesh's axes and sizes: {'data': D, 'tensor': T, 'pipeline': P} from
    resolved sizes (D, T, P), or with dcn_data = k > 1 {'dcn': k, 'data': D/k,
    'tensor': T, 'pipeline': P}. ValueError naming mesh.dcn_data if k does not
    divide D."""
    _check_dcn_data(dcn_data)
    d, t, p = (int(s) for s in sizes)
    if dcn_data == 1:
        return dict(zip(AXES, (d, t, p)))
    if d % dcn_data:
        raise ValueError(f"mesh.dcn_data={dcn_data} does not divide mesh.data={d}: the data "
                         "axis is split into dcn_data slow-hop groups of equal size")
    return {DCN: int(dcn_data), "data": d // dcn_data, "tensor": t, "pipeline": p}


def check_processes(sizes, dcn_data: int, n_processes: int) -> None:
    """ValueError naming mesh.dcn_data when, in a run of `n_processes` > 1
    processes, the dcn groups cannot be whole processes: dcn_data must divide
    the process count and each process's devices must hold whole tensor x
    pipeline groups of one dcn group."""
    sizes = axis_sizes(sizes, dcn_data)
    if dcn_data == 1 or n_processes <= 1:
        return
    if n_processes % dcn_data:
        raise ValueError(f"mesh.dcn_data={dcn_data} does not divide the {n_processes} "
                         "processes: every slow-hop group must be one or several whole "
                         "processes")
    per_group = n_processes // dcn_data
    if sizes["data"] % per_group:
        raise ValueError(f"mesh.dcn_data={dcn_data}: each slow-hop group spans {per_group} "
                         f"processes, which do not split its data={sizes['data']} ranks "
                         "evenly (each process must hold whole tensor x pipeline groups)")


def _hybrid_grid(sizes: dict, devices) -> np.ndarray:
    """Devices as [dcn, data, pipeline, tensor] with every dcn group made of whole
    processes (`create_hybrid_device_mesh`, processes as granules; where it cannot
    fit the shape to the topology, each process's devices in the given order,
    processes by index)."""
    k, d, t, p = (sizes[a] for a in (DCN, "data", "tensor", "pipeline"))
    procs = sorted({dev.process_index for dev in devices})
    per_group = len(procs) // k
    try:
        return np.asarray(mesh_utils.create_hybrid_device_mesh(
            (1, d // per_group, p, t), (k, per_group, 1, 1), devices, process_is_granule=True))
    except (ValueError, NotImplementedError, AssertionError):
        by_proc = [[dev for dev in devices if dev.process_index == i] for i in procs]
        if len({len(g) for g in by_proc}) > 1:
            raise ValueError(f"mesh.dcn_data={k}: the processes hold different numbers of "
                             "devices, so the slow-hop groups cannot be whole processes "
                             "of equal size") from None
        ordered = [dev for g in by_proc for dev in g]
        return np.asarray(ordered, dtype=object).reshape(k, d, p, t)


def make_mesh(shape, devices=None, *, dcn_data: int = 1) -> jax.sharding.Mesh:
    """The ('data', 'tensor', 'pipeline') mesh with Auto axes, or with dcn_data
    = k > 1 the ('dcn', 'data', 'tensor', 'pipeline') one (`axis_sizes`).

    shape: see `resolve_shape` (its data size is the whole data axis, both
    hops). devices: defaults to `jax.devices()` (every process's devices in a
    multi-process run). See the module docstring for how devices are placed.
    """
    devices = list(jax.devices() if devices is None else devices)
    if not devices:
        raise ValueError("devices must hold at least one device; got an empty sequence")
    sizes = resolve_shape(shape, len(devices))
    axes = axis_sizes(sizes, dcn_data)
    names = tuple(axes)
    if dcn_data == 1:
        grid = _device_grid_DxPxT(sizes, devices).transpose(0, 2, 1)
    else:
        n_proc = len({getattr(dev, "process_index", 0) for dev in devices})
        check_processes(sizes, dcn_data, n_proc)
        if n_proc > 1:
            grid_KxDxPxT = _hybrid_grid(axes, devices)
        else:  # one process: the dcn groups are contiguous blocks of the device order
            k, (d, t, p) = dcn_data, sizes
            grid_KxDxPxT = _device_grid_DxPxT(sizes, devices).reshape(k, d // k, p, t)
        grid = grid_KxDxPxT.transpose(0, 1, 3, 2)
    return jax.sharding.Mesh(
        grid, names, axis_types=(jax.sharding.AxisType.Auto,) * len(names)
    )
