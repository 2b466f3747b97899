"""The byte meter: what a compiled JAX program really sends over the wire.

Compression only counts if the compiled program moves fewer bytes, so every
traffic number jcomp reports comes from reading the optimised HLO text
(`jax.jit(f).lower(*args).compile().as_text()`), never from what the Python
code meant to send.

Every number a report gives is bytes per device per call, averaged over all
devices of the mesh. One execution of a collective costs each device taking
part `bytes_per_device`, the way NCCL-tests count bus traffic; with `buf` the
bytes of the collective's result and `n` its group size:

  all-reduce          2(n-1)/n * buf
  all-gather           (n-1)/n * buf      (buf is the gathered output)
  reduce-scatter       (n-1)   * buf      (the input is n * buf)
  all-to-all           (n-1)/n * buf
  collective-permute         1 * buf      (only its source devices send)

`count` is how often it runs per call and `share` the fraction of the mesh's
devices that take part in a run, so `total_bytes = bytes_per_device * count *
share`. Collectives inside while loops are counted once per iteration, using
the trip count XLA records in the loop's backend_config. A collective-permute
is shared by the devices that send in its source_target_pairs (not to
themselves). A conditional's branch is shared by the devices that take it when
its selector is a function of partition-id that the meter can evaluate
exactly; otherwise the branch is counted as if it always runs, with a caveat.

The byte model per collective kind, the message it belongs to
(`message_scope`) and the mesh axes it spans are one reading of an
instruction; the replica groups behind those axes are read by
jcomp.meter.groups, the HLO text itself (call graph, loops, branch selectors)
by jcomp.meter.hlo.

Just past 400 lines, on purpose: the byte model, the report it fills and the
doors that compile a program and read it (`measure`, `measure_compiled`) are
one reading of a program, each step's output the next one's input.
"""
from __future__ import annotations

import dataclasses
import math
import re
from typing import Mapping, Sequence

import jax
import numpy as np

from jcomp.meter.scope import MESSAGE_SCOPE, RAW_SCOPE, message_scope  # noqa: F401
from jcomp.meter import groups, hlo

KINDS = hlo.COLLECTIVE_KINDS

# Ops that move bytes but whose traffic this meter does not model; each one
# found becomes a note so a report never looks complete when it is not.
UNMEASURED = ("send", "recv", "ragged-all-to-all", "collective-broadcast")

# The scopes the collectives write (jcomp.meter.scope), read back from the compiled
# program's op_name metadata. A collective of the backward pass has a
# transpose( in its path, one that remat recomputes for the backward pass a
# rematted_computation.
_RAW_RE = re.compile(r'op_name="[^"]*' + re.escape(RAW_SCOPE.split("(")[0]) + r'\(([^)]*)\)')
_OP_NAME_RE = re.compile(r'op_name="([^"]*)"')
_MSG_RE = re.compile(re.escape(MESSAGE_SCOPE.split("(")[0]) + r"\(([^,()]*),([^,()]*)\)")


def _message_of(line: str) -> str:
    """The message a collective's op_name attributes it to; "" if none."""
    m = _OP_NAME_RE.search(line)
    scopes = _MSG_RE.findall(m.group(1)) if m else []
    if not scopes:
        return ""
    forward, backward = scopes[-1]
    path = m.group(1)
    backward_pass = "transpose(" in path and "rematted_computation" not in path
    return backward if backward_pass else forward


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective instruction of a compiled program.

    `shape` is the result shape, or a tuple of shapes for a tuple result;
    `parts` lists (dtype, dims, bytes) for every array the collective
    outputs. `bytes_per_device` is what one taking part sends per execution;
    `share` is the fraction of the mesh's devices that take part (averaged
    over executions). `caveat` is non-empty when `count` could not be known
    exactly.
    """

    kind: str
    dtype: str
    shape: tuple
    group_size: int
    axes: tuple[str, ...]
    bytes_per_device: float
    count: int
    name: str
    parts: tuple[tuple[str, tuple[int, ...], float], ...] = ()
    caveat: str = ""
    share: float = 1.0
    message: str = ""  # the plan's message it belongs to (see message_scope); "" if none

    @property
    def total_bytes(self) -> float:
        """Bytes per device per call, averaged over the mesh."""
        return self.bytes_per_device * self.count * self.share


@dataclasses.dataclass
class WireReport:
    """The collectives of one compiled program and what to know about them."""

    collectives: list[Collective]
    notes: list[str] = dataclasses.field(default_factory=list)

    def by_axis(self) -> dict[str, float]:
        """Bytes per device per call (mesh average), keyed by "+".join(axes) ("none" if no axis)."""
        out: dict[str, float] = {}
        for c in self.collectives:
            key = "+".join(c.axes) or "none"
            out[key] = out.get(key, 0.0) + c.total_bytes
        return out

    def by_mesh_axis(self) -> dict[str, float]:
        """Bytes per device per call (mesh average) of the collectives that cross
        each mesh axis: one over several axes counts for each, as its links may
        carry all of it (what `jcomp.meter.compare` weighs axis by axis)."""
        out: dict[str, float] = {}
        for key, b in self.by_axis().items():
            for axis in key.split("+"):
                out[axis] = out.get(axis, 0.0) + b
        return out

    def by_message(self) -> dict[str, float]:
        """Bytes per device per call (mesh average), keyed by the plan's message
        ("" for collectives sent outside any message scope)."""
        out: dict[str, float] = {}
        for c in self.collectives:
            out[c.message] = out.get(c.message, 0.0) + c.total_bytes
        return out

    def by_dtype(self) -> dict[str, float]:
        """Bytes per device per call (mesh average), keyed by element dtype of what is sent."""
        out: dict[str, float] = {}
        for c in self.collectives:
            buf = sum(b for _, _, b in c.parts)
            for dt, _, b in c.parts:
                if buf:  # every byte model is linear in buf, so split by share
                    out[dt] = out.get(dt, 0.0) + c.total_bytes * b / buf
        return out

    def total(self) -> float:
        """All bytes a device sends per call, averaged over the mesh."""
        return float(sum(c.total_bytes for c in self.collectives))

    def table(self) -> str:
        """A fixed-width table of collectives, a per-axis summary, then the notes."""
        shared = any(c.share != 1 for c in self.collectives)  # the column only when it says something
        named = any(c.message for c in self.collectives)
        head = ("kind", "dtype", "shape", "axes", "n", "count") + ("share",) * shared + (
            "bytes/dev/exec", "bytes/dev/call") + ("message",) * named
        rows = [head] + [
            (c.kind, c.dtype, _shape_str(c.shape), "+".join(c.axes) or "none", str(c.group_size),
             f"{c.count}{'?' if c.caveat else ''}") + (f"{c.share:.4g}",) * shared +
            (_fmt(c.bytes_per_device), _fmt(c.total_bytes)) + (c.message or "-",) * named
            for c in self.collectives
        ]
        widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
        lines = ["  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows]
        lines.append("")
        lines.append("per axis (bytes per device per call, mesh average):")
        for axis, b in sorted(self.by_axis().items()):
            lines.append(f"  {axis:<24} {_fmt(b)}")
        lines.append(f"  {'total':<24} {_fmt(self.total())}")
        if self.notes:
            lines.append("")
            lines.append("NOTES:")
            lines.extend(f"  ! {n}" for n in self.notes)
        return "\n".join(lines)


def _fmt(b: float) -> str:
    return f"{int(b):,}" if float(b).is_integer() else f"{b:,.1f}"


def _shape_str(shape: tuple) -> str:
    if shape and isinstance(shape[0], tuple):
        return "(" + ", ".join(_shape_str(s) for s in shape) + ")"
    return "[" + ",".join(map(str, shape)) + "]"



# ---------------------------------------------------------------- shapes

def _array_bytes(dtype: str, dims: Sequence[int], bits: int | None = None) -> float:
    """Bytes of one array; sub-byte types take a byte each unless packed (E(n) layout)."""
    if bits is None:
        bits = max(8, hlo.DTYPE_BITS[dtype]) if hlo.DTYPE_BITS[dtype] else 0
    return math.ceil(math.prod(dims) * bits / 8)


# ---------------------------------------------------------------- collectives

def _kind_of(opcode: str) -> str | None:
    base = opcode[: -len("-start")] if opcode.endswith("-start") else opcode
    return base if base in KINDS else None


def _sent_tree(instr: hlo.Instr, kind: str):
    """The part of the result that is the collective's output (async starts carry more)."""
    if not instr.opcode.endswith("-start") or kind in ("all-reduce", "all-to-all", "reduce-scatter"):
        return instr.shape
    # all-gather-start: (operands, outputs); collective-permute-start: (operand, output[, context])
    if not isinstance(instr.shape, list) or len(instr.shape) < 2:
        raise ValueError(f"hlo_text: unexpected {instr.opcode} result in line: {instr.line.strip()}")
    return instr.shape[1]


def _collective(instr: hlo.Instr, count: int, runs: np.ndarray, caveat: str, mesh_shape,
                axis_names) -> Collective:
    """`count` runs per call; `runs` holds the runs per call on each partition id."""
    kind = _kind_of(instr.opcode)
    sent = _sent_tree(instr, kind)
    leaves = hlo.leaves(sent)
    part_bytes = [_array_bytes(dt, dims, bits) for dt, dims, bits in leaves]
    buf = sum(part_bytes)
    if kind == "collective-permute":
        m = re.search(r"source_target_pairs=\{((?:\s*\{\d+,\d+\}\s*,?)*)\}", instr.attrs)
        if not m:
            raise ValueError(f"hlo_text: unrecognised source_target_pairs in line: {instr.line.strip()}")
        pairs = [tuple(map(int, p)) for p in re.findall(r"\{(\d+),(\d+)\}", m.group(1))]
        axes = groups.axes_spanned(pairs, mesh_shape, axis_names, instr.line)
        n = math.prod(mesh_shape[axis_names.index(a)] for a in axes)
        per_device = float(buf)
        sends = np.zeros(len(runs))  # a device whose pairs all stay on it sends nothing
        sends[[s for s, t in pairs if s != t]] = 1.0
        runs = runs * sends
    else:
        try:
            sets = groups.parse_replica_groups(groups.groups_text(instr) or "{}",
                                               math.prod(mesh_shape))
        except ValueError as e:
            raise ValueError(f"hlo_text: {e}; in line: {instr.line.strip()}") from None
        if len({len(g) for g in sets}) != 1:
            raise ValueError(f"hlo_text: replica groups of unequal size in line: {instr.line.strip()}")
        axes = groups.axes_spanned(sets, mesh_shape, axis_names, instr.line)
        n = len(sets[0])
        factor = {"all-reduce": 2 * (n - 1) / n, "all-gather": (n - 1) / n,
                  "reduce-scatter": float(n - 1), "all-to-all": (n - 1) / n}[kind]
        per_device = factor * buf
    dtypes = list(dict.fromkeys(dt for dt, _, _ in leaves))
    shape = tuple(dims for _, dims, _ in leaves) if isinstance(sent, list) else sent[1]
    return Collective(kind=kind, dtype="+".join(dtypes), shape=shape, group_size=n, axes=axes,
                      bytes_per_device=per_device, count=count, name=instr.name,
                      parts=tuple((dt, dims, b) for (dt, dims, _), b in zip(leaves, part_bytes)),
                      caveat=caveat, share=float(runs.sum() / (len(runs) * count)))


def _mesh_args(mesh_shape, axis_names) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """Normalise (mesh_shape, axis_names); raises on anything malformed."""
    if isinstance(mesh_shape, Mapping):
        if axis_names is not None and tuple(axis_names) != tuple(mesh_shape):
            raise ValueError(f"axis_names {axis_names!r} disagree with mesh_shape keys {tuple(mesh_shape)}")
        axis_names, mesh_shape = tuple(mesh_shape), tuple(mesh_shape.values())
    if not isinstance(mesh_shape, (tuple, list)) or not mesh_shape:
        raise TypeError(f"mesh_shape must be a non-empty tuple of ints or a mapping name->size; "
                        f"got {mesh_shape!r}")
    if any(isinstance(s, bool) or not isinstance(s, (int, np.integer)) or s < 1 for s in mesh_shape):
        raise ValueError(f"mesh_shape sizes must be positive ints; got {mesh_shape!r}")
    names = tuple(axis_names) if axis_names is not None else tuple(f"axis{i}" for i in range(len(mesh_shape)))
    if len(names) != len(mesh_shape) or len(set(names)) != len(names) or \
            not all(isinstance(a, str) for a in names):
        raise ValueError(f"axis_names must be {len(mesh_shape)} distinct strings; got {axis_names!r}")
    return tuple(int(s) for s in mesh_shape), names


def _parse(hlo_text: str, mesh_shape, axis_names) -> tuple[list[Collective], list[str]]:
    """Collectives of `hlo_text` with their run counts, and notes on what could not be known."""
    if not isinstance(hlo_text, str):
        raise TypeError(f"hlo_text must be str; got {type(hlo_text).__name__}")
    shape, names = _mesh_args(mesh_shape, axis_names)
    comps, entry = hlo.computations(hlo_text)
    if entry is None:
        raise ValueError("hlo_text: no ENTRY computation found")
    counts, runs, caveats = hlo.multiplicities(comps, entry, math.prod(shape))
    found, notes, unmeasured, lines = [], [], {}, []
    for comp in (c for c in comps if c in counts):  # text order
        for instr in comps[comp]:
            if instr.opcode in UNMEASURED or instr.opcode.removesuffix("-start") in UNMEASURED:
                unmeasured[instr.opcode] = unmeasured.get(instr.opcode, 0) + 1
            if _kind_of(instr.opcode) and counts[comp]:
                caveat = "; ".join(sorted(caveats[comp]))
                found.append(_collective(instr, counts[comp], runs[comp], caveat, shape, names))
                lines.append(instr.line)
    for caveat in dict.fromkeys(c.caveat for c in found if c.caveat):
        which = [c.name for c in found if c.caveat == caveat]
        notes.append(f"{len(which)} collective(s) ({', '.join(which)}): {caveat}")
    for op, k in unmeasured.items():
        notes.append(f"{k} {op} instruction(s) move bytes this meter does not count")
    found = [dataclasses.replace(c, message=_message_of(line)) if "jcomp_msg(" in line else c
             for c, line in zip(found, lines)]
    raw: dict[str, list[str]] = {}
    for c, line in zip(found, lines):
        m = _RAW_RE.search(line)
        if m:
            raw.setdefault(m.group(1), []).append(c.name)
    for codec, which in raw.items():
        notes.append(f"{len(which)} collective(s) ({', '.join(which)}) send raw: codec {codec} "
                     "cannot send fewer bytes than the uncompressed operand at that size")
    return found, notes


def parse_collectives(hlo_text: str, mesh_shape: tuple[int, ...] | Mapping[str, int],
                      axis_names: Sequence[str] | None = None) -> list[Collective]:
    """Collectives of compiled HLO text; a count that could not be known has a `caveat`."""
    return _parse(hlo_text, mesh_shape, axis_names)[0]


# ---------------------------------------------------------------- measuring programs

def _mesh_shape(mesh) -> dict[str, int]:
    if not hasattr(mesh, "devices") or not hasattr(mesh, "axis_names"):
        raise TypeError(f"mesh must be a jax.sharding.Mesh; got {type(mesh).__name__}")
    return dict(zip(mesh.axis_names, mesh.devices.shape))


def from_text(text: str, mesh) -> WireReport:
    """WireReport of compiled HLO text on `mesh` (a jax.sharding.Mesh)."""
    collectives, notes = _parse(text, _mesh_shape(mesh), None)
    return WireReport(collectives, notes)


def _jax_stage(stage, cls, attr: str, what: str):
    """The jax.stages object behind `stage`: Equinox's filter_jit gives its own
    Lowered and Compiled, each holding jax's in an attribute (`lowered`,
    `compiled`), with an `as_text` that takes no dialect or none at all."""
    if isinstance(stage, cls):
        return stage
    inner = getattr(stage, attr, None)
    if isinstance(inner, cls):
        return inner
    if hasattr(stage, "as_text"):  # a stand-in that prints HLO text
        return stage
    raise TypeError(f"{what} must be a jax.stages.{cls.__name__} (jax.jit(f).lower(...)"
                    f"{'.compile()' if attr == 'compiled' else ''}) or hold one as "
                    f".{attr}; got {type(stage).__name__}")


def measure_compiled(compiled, mesh) -> WireReport:
    """WireReport of an already compiled program (`jax.jit(f).lower(...).compile()`,
    or Equinox's `eqx.filter_jit(f).lower(...).compile()`)."""
    compiled = _jax_stage(compiled, jax.stages.Compiled, "compiled", "compiled")
    return from_text(compiled.as_text(), mesh)


def _elements_by_kind(text: str, dtype: str) -> dict[str, tuple[int, int]]:
    """{kind: (collectives sending `dtype`, their `dtype` elements)} of HLO text."""
    out: dict[str, tuple[int, int]] = {}
    for line in text.splitlines():
        instr = hlo.read_instr(line)
        kind = _kind_of(instr.opcode) if instr is not None else None
        if kind is None:
            continue
        elems = [math.prod(dims) for dt, dims, _ in hlo.leaves(_sent_tree(instr, kind)) if dt == dtype]
        n_instr, n_elem = out.get(kind, (0, 0))
        out[kind] = (n_instr + bool(elems), n_elem + sum(elems))
    return out


def widening_note(pre_text: str, compiled_text: str, platform: str) -> str | None:
    """A note if bf16 collectives of `pre_text` became f32 ones in `compiled_text`.

    Compares, for every collective kind, the bf16 elements sent before and after
    optimisation (elements, not instructions: XLA may combine several
    collectives into one). XLA on CPU widens bf16 collectives of every kind.
    """
    pre, post = _elements_by_kind(pre_text, "bf16"), _elements_by_kind(compiled_text, "bf16")
    f32 = _elements_by_kind(compiled_text, "f32")
    parts, whole = [], True
    for kind in KINDS:
        n_pre, elems_pre = pre.get(kind, (0, 0))
        n_post, elems_post = post.get(kind, (0, 0))
        if elems_post >= elems_pre or not f32.get(kind, (0, 0))[0]:
            continue
        if n_post == 0:
            parts.append(f"{n_pre} bf16 {kind}(s)")
        else:
            whole = False
            parts.append(f"{elems_pre - elems_post:,} of {elems_pre:,} bf16 {kind} elements")
    if not parts:
        return None
    sends = "f32" if whole else "those as f32"
    return (f"XLA widened {' and '.join(parts)} to f32 on this backend ({platform}): "
            f"the compiled program sends {sends}")


def measure(fn, *args, mesh, **kwargs) -> WireReport:
    """Compile `fn(*args, **kwargs)` (jitting it unless it has `.lower`: a
    `jax.jit` or `eqx.filter_jit` function) and meter its traffic."""
    _mesh_shape(mesh)  # reject a bad mesh before compiling
    jitted = fn if hasattr(fn, "lower") else jax.jit(fn)
    lowered = _jax_stage(jitted.lower(*args, **kwargs), jax.stages.Lowered, "lowered",
                         "fn.lower(...)")
    compiled = lowered.compile()
    report = measure_compiled(compiled, mesh)
    platform = mesh.devices.flat[0].platform
    note = widening_note(lowered.as_text(dialect="hlo"), compiled.as_text(), platform)
    if note:
        report.notes.insert(0, note)
    return report
