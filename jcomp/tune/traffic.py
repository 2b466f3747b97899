"""What one message kind sends over one mesh axis per step, and what a codec
makes of it.

    Traffic(raw_bytes=64e6, collectives=1)                # a float32 gradient reduce
    Traffic(raw_bytes=8e6, collectives=96, op="all-reduce", row=4096)   # activations
    messages_from(report, kinds={"grad_reduce": "grad", "block_exit": "act"})
    messages_from_grads(params, specs, mesh=mesh, data_axes="data")   # a jax.jit step

`raw_bytes` counts as jcomp.meter.wire does: bytes per device per step of the
uncompressed program (an all-reduce's 2(n-1)/n x its buffer), so that one
`Link.bytes_per_s` prices every collective kind. `row` is the length of the
rows a codec codes each on its own (a token's features for activations; a
long flat bucket for gradients and parameters): a block codec's bytes depend
on it through padding and block scales.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Mapping

import jax
import jax.numpy as jnp

from jcomp import codecs as _codecs
from jcomp.collectives import arguments
from jcomp.collectives.jit import specs as jitspecs
from jcomp.collectives.buckets import DEFAULT_BUCKET_BYTES

# Collectives a coded message needs per raw one. A coded all-reduce is an
# all_to_all of coded chunks and an all_gather of the coded sums (kernels'
# "owners" form; over 2 devices a single all_gather, so 2 errs towards raw).
CODED_COLLECTIVES = {"all-reduce": 2, "reduce-scatter": 1, "all-gather": 1, "all-to-all": 1,
                     "permute": 1}
# The meter's names for the element types a message may carry.
_HLO_DTYPES = {"f32": "float32", "bf16": "bfloat16", "f16": "float16", "f64": "float64"}
DEFAULT_ROW = 4096


@dataclasses.dataclass(frozen=True)
class Traffic:
    """Per step and device: uncompressed bytes and collectives of one (axis, kind)."""

    raw_bytes: float
    collectives: float
    dtype: str = "float32"
    op: str = "all-reduce"
    row: int = DEFAULT_ROW
    n: int = 2  # devices the collective spans; 2 codes the most per wire byte (errs to raw)

    def __post_init__(self):
        for name in ("raw_bytes", "collectives"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise TypeError(f"Traffic.{name} must be a finite number >= 0; got {v!r}")
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"Traffic.{name} must be a finite number >= 0; got {v!r}")
        try:
            floating = jnp.issubdtype(jnp.dtype(self.dtype), jnp.floating)
        except TypeError:
            floating = False
        if not floating:
            raise ValueError(f"Traffic.dtype must name a floating-point type (float32, "
                             f"bfloat16, float16); got {self.dtype!r}")
        if self.op not in CODED_COLLECTIVES:
            raise ValueError(f"Traffic.op must be one of {', '.join(CODED_COLLECTIVES)}; "
                             f"got {self.op!r}")
        if isinstance(self.row, bool) or not isinstance(self.row, int) or self.row < 1:
            raise ValueError(f"Traffic.row must be an int >= 1 (elements); got {self.row!r}")
        if isinstance(self.n, bool) or not isinstance(self.n, int) or self.n < 2:
            raise ValueError(f"Traffic.n must be an int >= 2 (devices the collective spans); "
                             f"got {self.n!r}")

    def codec_work(self) -> tuple[float, float]:
        """(bytes encoded, bytes decoded) per raw wire byte of a coded `op` over n
        devices, counting every piece a device codes: an all-reduce encodes its
        buffer B and then its sum's 1/n, and decodes the n chunks it sums and the
        n sums it gathers (2B), against 2(n-1)/n B on the wire; a reduce-scatter
        encodes B and decodes the n chunks of its own piece; an all-gather
        encodes its own piece (B/n) and decodes all n; a permute or all_to_all
        codes what it sends once and decodes what it gets."""
        n = self.n
        decode = n / (n - 1)
        return {"all-reduce": ((n + 1) / (2 * (n - 1)), decode),
                "reduce-scatter": (n / (n - 1), decode),
                "all-gather": (1 / (n - 1), decode)}.get(self.op, (1.0, 1.0))

    def coded_bytes(self, codec) -> float:
        """Bytes per device per step with `codec`: raw bytes times the codec's byte
        ratio on one row (a ratio, so that padding and scales count as sent)."""
        c = arguments.parse(codec)
        if c.kind == "identity":
            return float(self.raw_bytes)
        fitted = _codecs.fit_row(c, self.row)
        itemsize = jnp.dtype(self.dtype).itemsize
        return self.raw_bytes * fitted.wire_bytes((1, self.row), self.dtype) / (self.row * itemsize)

    def coded_collectives(self, codec) -> float:
        c = arguments.parse(codec)
        return self.collectives * (1 if c.kind == "identity" else CODED_COLLECTIVES[self.op])


def as_traffic(value, where: str) -> Traffic:
    """A Traffic, or a tuple (raw bytes per step, collectives per step)."""
    if isinstance(value, Traffic):
        return value
    if isinstance(value, tuple) and len(value) == 2:
        try:
            return Traffic(*value)
        except (ValueError, TypeError) as e:
            raise type(e)(f"{where}: {e}") from None
    raise TypeError(f"{where} must be a Traffic or a tuple (raw bytes per step, collectives "
                    f"per step); got {value!r}")


def messages_from(report, kinds: Mapping[str, str] | None = None) -> dict:
    """{(mesh axis, kind): Traffic} from a jcomp.meter.wire.WireReport of the
    *uncompressed* step (a compressed one would count coded bytes as raw).

    kinds maps the report's message names (jcomp.meter.scope.message_scope; the
    trainer's plan: {m.name: m.entry's kind}) to kinds; None uses each name as
    its kind. Collectives outside any message scope (the exact scalars: loss,
    norms) are left out: no codec is meant for them. A collective over several
    axes counts on each, as by_mesh_axis does. Per (axis, kind): the bytes and
    executions summed, the element type and op of the collective carrying most."""
    if kinds is not None and not isinstance(kinds, Mapping):
        raise TypeError(f"kinds must map message names to kinds; got {kinds!r}")
    named = {c.message for c in report.collectives if c.message}
    if kinds is not None:
        missing = sorted(named - set(kinds))
        if missing:
            raise ValueError(f"kinds: the report's messages {missing} have no kind; "
                             f"map every one of {sorted(named)}")
    totals: dict = {}
    for c in report.collectives:
        if not c.message:
            continue
        kind = kinds[c.message] if kinds is not None else c.message
        op = "permute" if c.kind == "collective-permute" else c.kind
        for axis in c.axes:
            t = totals.setdefault((axis, kind), {"bytes": 0.0, "n": 0.0, "heavy": (-1.0, "", "")})
            t["bytes"] += c.total_bytes
            t["n"] += c.count * c.share
            if c.total_bytes > t["heavy"][0]:
                t["heavy"] = (c.total_bytes, _HLO_DTYPES.get(c.dtype, c.dtype), op)
    out = {}
    for key, t in totals.items():
        _, dtype, op = t["heavy"]
        if dtype not in _HLO_DTYPES.values():
            raise ValueError(f"message {key}: its collectives carry {dtype!r}, not a "
                             "floating-point type a codec can code")
        out[key] = Traffic(raw_bytes=t["bytes"], collectives=t["n"], dtype=dtype, op=op)
    return out


def messages_from_grads(params, param_specs=None, *, mesh, data_axes="data", rules=None) -> dict:
    """{(data axis, "grad" or "param"): Traffic} of a `jax.jit` step's gradient
    reduction over its batch axes, computed from the parameters' shapes, dtypes
    and specs: what `cc.value_and_grad(..., data_axes=data_axes)` codes, and what
    the plain program's reduction (the one XLA inserts) moves over those axes.

    params: arrays or jax.ShapeDtypeStructs (flax boxes and NNX Variables as
    cc.value_and_grad takes them); param_specs, rules: as cc.value_and_grad's,
    None reading boxes, NNX metadata or the arrays' own NamedShardings. Per leaf,
    with G its bytes per device over the other axes: split over batch axes S
    (FSDP), a reduce-scatter of G over S ("grad") and a gather of it ("param"),
    (n_S - 1)/n_S x G each; replicated over batch axes F, an all-reduce of
    G / n_S over F, 2(n_F - 1)/n_F of it. A collective over several axes counts
    on each, as jcomp.meter.wire's by_mesh_axis does. Collectives: leaves
    reduced over the same axes share buckets of cc.value_and_grad's size.
    The scalar loss's reduction is left out (no codec is meant for it)."""
    data_axes = arguments.axes_of(data_axes)
    if not hasattr(mesh, "axis_names") or not hasattr(mesh, "devices"):
        raise TypeError(f"mesh must be a jax.sharding.Mesh; got {type(mesh).__name__}")
    for a in data_axes:
        if a not in mesh.axis_names:
            raise ValueError(f"data_axes: {a!r} is not an axis of the mesh {mesh.axis_names}")
    sizes = dict(zip(mesh.axis_names, mesh.devices.shape))
    specs = jitspecs.check(mesh, data_axes, params, param_specs, rules)
    groups: dict = {}  # (kind, op, axes, dtype) -> [bytes a device sends, buffer bytes]
    for leaf, spec in zip(jax.tree.leaves(params), specs):
        dtype = jnp.dtype(leaf.dtype)
        if not jnp.issubdtype(dtype, jnp.floating):
            continue
        held = jitspecs.axes_in(spec)
        other = math.prod(sizes[a] for a in held if a not in data_axes)
        local = math.prod(leaf.shape) * dtype.itemsize / other
        split = tuple(a for a in data_axes if a in held and sizes[a] > 1)
        free = tuple(a for a in data_axes if a not in held and sizes[a] > 1)
        n_s, n_f = math.prod(sizes[a] for a in split), math.prod(sizes[a] for a in free)
        sends = []
        if split:
            sends += [("grad", "reduce-scatter", split, (n_s - 1) / n_s * local),
                      ("param", "all-gather", split, (n_s - 1) / n_s * local)]
        if free:
            sends.append(("grad", "all-reduce", free, 2 * (n_f - 1) / n_f * local / n_s))
        for kind, op, axes, b in sends:
            g = groups.setdefault((kind, op, axes, dtype.name), [0.0, 0.0])
            g[0] += b
            g[1] += local / (n_s if op == "all-reduce" else 1)
    totals: dict = {}
    for (kind, op, axes, dtype), (sent, buffer) in groups.items():
        n = math.prod(sizes[a] for a in axes)
        calls = max(1, math.ceil(buffer / DEFAULT_BUCKET_BYTES))
        for axis in axes:
            t = totals.setdefault((axis, kind), {"bytes": 0.0, "n": 0, "heavy": (-1.0,)})
            t["bytes"] += sent
            t["n"] += calls
            if sent > t["heavy"][0]:
                t["heavy"] = (sent, dtype, op, n)
    return {key: Traffic(raw_bytes=t["bytes"], collectives=t["n"], dtype=t["heavy"][1],
                         op=t["heavy"][2], n=t["heavy"][3]) for key, t in totals.items()}
