"""Which devices an HLO collective runs over, and the mesh axes they span.

XLA writes replica groups in three forms (listed, iota, and its own mesh
form); `parse_replica_groups` reads each into device-id tuples, and
`axes_spanned` names the mesh axes along which the devices of a group
differ: the axes whose links a collective's bytes travel.
"""
from __future__ import annotations

import math
import re
from typing import Sequence

import numpy as np

from jcomp.meter import hlo


_INTS = r"\d+(?:,\d+)*"
_IOTA_RE = re.compile(rf"^\[({_INTS})\]<=\[({_INTS})\](?:T\(({_INTS})\))?$")
# XLA's mesh form: mesh['axis_0'=4,'axis_1'=2], device_ids=([2,4]T(1,0)) {'axis_0'}
_MESH_RE = re.compile(rf"^mesh\[([^\]]*)\](?:, device_ids=\(\[({_INTS})\](?:T\(({_INTS})\))?\))? \{{([^}}]*)\}}$")
_EXPLICIT_RE = re.compile(r"^\{(\s*\{[\d,\s]*\}\s*(,\s*\{[\d,\s]*\}\s*)*)?\}$")


def parse_replica_groups(text: str, num_devices: int | None = None) -> list[tuple[int, ...]]:
    """Replica groups from their HLO text, in one of three forms.

    `{{0,4},{1,5}}` lists them; `{}` is one group of all `num_devices`.
    Iota `[4,2]<=[2,4]T(1,0)`: iota(8) reshaped to [2,4], transposed by T,
    reshaped to [groups, size]. Mesh `mesh['a'=4,'b'=2], device_ids=([2,4]T(1,0)) {'a'}`:
    device ids (iota when absent) laid out on XLA's own mesh; each group is the
    devices that differ only along the braced axes. Anything else raises ValueError.
    """
    text = text.strip()
    if _EXPLICIT_RE.match(text):
        groups = [tuple(int(v) for v in g.split(",") if v.strip())
                  for g in re.findall(r"\{([\d,\s]*)\}", text[1:-1])]
        if groups:
            return groups
        if num_devices is None:
            raise ValueError("replica_groups: '{}' means all devices; num_devices is needed")
        return [tuple(range(num_devices))]
    if text.startswith("mesh["):
        return _mesh_groups(text)
    m = _IOTA_RE.match(text)
    if not m:
        raise ValueError(f"replica_groups: unrecognised form {text!r}; allowed: {{{{0,4}},{{1,5}},...}}, "
                         "[G,S]<=[dims]T(perm), or mesh[...] {axes} over whole axes")
    out_dims, dims = [tuple(map(int, g.split(","))) for g in m.groups()[:2]]
    if len(out_dims) != 2 or math.prod(out_dims) != math.prod(dims):
        raise ValueError(f"replica_groups: inconsistent iota form {text!r}")
    perm = tuple(map(int, m.group(3).split(","))) if m.group(3) else None
    return [tuple(int(v) for v in row) for row in _iota(dims, perm, text).reshape(out_dims)]


def _iota(dims: Sequence[int], perm: Sequence[int] | None, text: str) -> np.ndarray:
    """iota(prod(dims)) reshaped to dims and transposed by perm."""
    perm = tuple(perm) if perm is not None else tuple(range(len(dims)))
    if sorted(perm) != list(range(len(dims))):
        raise ValueError(f"replica_groups: transpose is not a permutation in {text!r}")
    return np.arange(math.prod(dims)).reshape(dims).transpose(perm)


def _mesh_groups(text: str) -> list[tuple[int, ...]]:
    """Groups of XLA's mesh form: devices that differ only along the braced axes."""
    m = _MESH_RE.match(text)
    axis = r"'?([\w.\-]+)'?"
    if not m or not re.fullmatch(rf"{axis}=\d+(?:,{axis}=\d+)*", m.group(1)):
        raise ValueError(f"replica_groups: unrecognised mesh form {text!r} "
                         "(only name=size axes and iota device_ids are read)")
    sizes = dict(re.findall(rf"{axis}=(\d+)", m.group(1)))
    grouped = [g.strip().strip("'") for g in m.group(4).split(",")]
    if any(g not in sizes for g in grouped) or len(set(grouped)) != len(grouped):
        raise ValueError(f"replica_groups: mesh form {text!r} groups over sub-axes or "
                         "unknown axes, which are not read")
    names, shape = list(sizes), [int(v) for v in sizes.values()]
    ids = (np.arange(math.prod(shape)) if m.group(2) is None else
           _iota([int(v) for v in m.group(2).split(",")],
                 [int(v) for v in m.group(3).split(",")] if m.group(3) else None, text))
    if ids.size != math.prod(shape):
        raise ValueError(f"replica_groups: device_ids do not fill the mesh in {text!r}")
    g_axes = [names.index(g) for g in grouped]
    order = [a for a in range(len(names)) if a not in g_axes] + g_axes
    size = math.prod(shape[a] for a in g_axes)
    rows = ids.reshape(shape).transpose(order).reshape(-1, size)
    return [tuple(int(v) for v in row) for row in rows]


def groups_text(instr: hlo.Instr) -> str | None:
    """The text after `replica_groups=`, or None if absent; raises if unreadable."""
    if "replica_groups=" not in instr.attrs:
        return None
    m = re.search(r"replica_groups=(\{(?:[^{}]|\{[^{}]*\})*\}|\[[\d,]+\]<=\[[\d,]+\](?:T\([\d,]+\))?"
                  r"|mesh\[[^\]]*\](?:, device_ids=\((?:[^()]|\([^()]*\))*\))? \{[^}]*\})", instr.attrs)
    if not m:
        raise ValueError(f"hlo_text: unrecognised replica_groups in line: {instr.line.strip()}")
    return m.group(1)


def axes_spanned(device_sets: Sequence[Sequence[int]], mesh_shape: tuple[int, ...],
                  axis_names: tuple[str, ...], line: str) -> tuple[str, ...]:
    """Mesh axes (in mesh order) along which devices within any one set differ."""
    ndev = math.prod(mesh_shape)
    varying = set()
    for ids in device_sets:
        if any(not 0 <= i < ndev for i in ids):
            raise ValueError(f"hlo_text: device id outside the mesh of {ndev} devices in line: "
                             f"{line.strip()}")
        coords_GxA = np.array(np.unravel_index(np.asarray(ids, dtype=int), mesh_shape)).T
        varying |= {a for a in range(len(mesh_shape)) if len(set(coords_GxA[:, a])) > 1}
    return tuple(axis_names[a] for a in sorted(varying))
