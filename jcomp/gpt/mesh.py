"""The ('data', 'tensor', 'pipeline') device mesh.

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
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import jax
import numpy as np
from jax.experimental import mesh_utils

AXES = ("data", "tensor", "pipeline")


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


def make_mesh(shape, devices=None) -> jax.sharding.Mesh:
    """The ('data', 'tensor', 'pipeline') mesh with Auto axes.

    shape: see `resolve_shape`. devices: defaults to `jax.devices()` (every
    process's devices in a multi-process run). See the module docstring for
    how devices are placed.
    """
    devices = list(jax.devices() if devices is None else devices)
    if not devices:
        raise ValueError("devices must hold at least one device; got an empty sequence")
    sizes = resolve_shape(shape, len(devices))
    grid_DxTxP = _device_grid_DxPxT(sizes, devices).transpose(0, 2, 1)
    return jax.sharding.Mesh(
        grid_DxTxP, AXES, axis_types=(jax.sharding.AxisType.Auto,) * len(AXES)
    )
