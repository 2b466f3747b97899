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
"""
from __future__ import annotations

import dataclasses
import math
import operator
import re
from typing import Mapping, Sequence

import jax
import numpy as np

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")

# Ops that move bytes but whose traffic this meter does not model; each one
# found becomes a note so a report never looks complete when it is not.
UNMEASURED = ("send", "recv", "ragged-all-to-all", "collective-broadcast")

_DTYPE_BITS = {
    "pred": 8, "s1": 1, "u1": 1, "s2": 2, "u2": 2, "s4": 4, "u4": 4,
    "s8": 8, "u8": 8, "s16": 16, "u16": 16, "s32": 32, "u32": 32, "s64": 64, "u64": 64,
    "f16": 16, "bf16": 16, "f32": 32, "f64": 64, "c64": 64, "c128": 128,
    "f4e2m1fn": 4, "f6e2m3fn": 6, "f6e3m2fn": 6, "f8e3m4": 8, "f8e4m3": 8,
    "f8e4m3fn": 8, "f8e4m3fnuz": 8, "f8e4m3b11fnuz": 8, "f8e5m2": 8, "f8e5m2fnuz": 8,
    "f8e8m0fnu": 8, "token": 0,
}


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
        head = ("kind", "dtype", "shape", "axes", "n", "count") + ("share",) * shared + (
            "bytes/dev/exec", "bytes/dev/call")
        rows = [head] + [
            (c.kind, c.dtype, _shape_str(c.shape), "+".join(c.axes) or "none", str(c.group_size),
             f"{c.count}{'?' if c.caveat else ''}") + (f"{c.share:.4g}",) * shared +
            (_fmt(c.bytes_per_device), _fmt(c.total_bytes))
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

_ARRAY_RE = re.compile(r"([a-z][a-z0-9]*)\[([^\]]*)\](\{[^}]*\})?")


def _array_bytes(dtype: str, dims: Sequence[int], bits: int | None = None) -> float:
    """Bytes of one array; sub-byte types take a byte each unless packed (E(n) layout)."""
    if bits is None:
        bits = max(8, _DTYPE_BITS[dtype]) if _DTYPE_BITS[dtype] else 0
    return math.ceil(math.prod(dims) * bits / 8)


def _parse_shape(text: str, line: str):
    """HLO shape text -> nested lists of (dtype, dims, bits) leaves; returns (tree, rest)."""
    text = text.lstrip()
    if text.startswith("("):
        items, text = [], text[1:].lstrip()
        while not text.startswith(")"):
            item, text = _parse_shape(text, line)
            items.append(item)
            text = text.lstrip()
            if text.startswith(","):
                text = text[1:].lstrip()
            elif not text.startswith(")"):
                raise ValueError(f"hlo_text: cannot read tuple shape in line: {line.strip()}")
        return items, text[1:]
    m = _ARRAY_RE.match(text)
    if not m or m.group(1) not in _DTYPE_BITS:
        raise ValueError(f"hlo_text: unknown shape or dtype in line: {line.strip()}")
    dtype, dims_text, layout = m.groups()
    if "?" in dims_text:
        raise ValueError(f"hlo_text: unbounded dynamic shape in line: {line.strip()}")
    dims = tuple(int(d.replace("<=", "")) for d in dims_text.split(",") if d.strip())
    packed = re.search(r"E\((\d+)\)", layout or "")
    bits = int(packed.group(1)) if packed else None
    return (dtype, dims, bits), text[m.end():]


def _leaves(tree) -> list:
    return [tree] if isinstance(tree, tuple) else [x for t in tree for x in _leaves(t)]


# ---------------------------------------------------------------- instructions and computations

_INSTR_RE = re.compile(r"^\s*(?:ROOT\s+)?%?([^\s=(){}]+)\s*=\s*(.*)$")
_HEADER_RE = re.compile(r"^\s*(ENTRY\s+)?%?([^\s(){}=]+)\s*(?:\(.*\)\s*->\s*.*)?\{\s*$")
_COLLECTIVE_OP_RE = re.compile(r"\s(?:" + "|".join(KINDS) + r")(?:-start)?\(")


@dataclasses.dataclass(frozen=True)
class _Instr:
    name: str
    shape: object  # nested tree from _parse_shape
    opcode: str
    attrs: str
    line: str


_COMMENT_RE = re.compile(r"/\*.*?\*/")


def _read_instr(line: str) -> _Instr | None:
    """One HLO instruction line, or None if the line is not an instruction."""
    line = _COMMENT_RE.sub("", line)  # long tuples carry /*index=N*/ markers
    m = _INSTR_RE.match(line)
    if not m or line.lstrip().startswith(("HloModule", "ENTRY")):
        return None
    try:
        shape, rest = _parse_shape(m.group(2), line)
    except ValueError:
        if _COLLECTIVE_OP_RE.search(line):
            raise  # a collective we cannot size must not vanish from the count
        return None  # not an instruction line (e.g. module-level attributes)
    op = re.match(r"\s*([a-z][\w\-]*)\(", rest)
    if not op:
        return None
    return _Instr(m.group(1), shape, op.group(1), rest[op.end():], line)


def _computations(text: str) -> tuple[dict[str, list[_Instr]], str | None]:
    """Split HLO text into computations: {name: instructions}, and the ENTRY name."""
    comps: dict[str, list[_Instr]] = {}
    entry, current = None, None
    for line in text.splitlines():
        if current is None:
            h = _HEADER_RE.match(line)
            if h:
                current = h.group(2)
                comps[current] = []
                entry = current if h.group(1) else entry
        elif line.strip() == "}":
            current = None
        else:
            instr = _read_instr(line)
            if instr is not None:
                comps[current].append(instr)
    if not comps:  # bare instruction lines: treat them as one computation run once
        lines = [i for i in map(_read_instr, text.splitlines()) if i is not None]
        return {"entry": lines}, "entry"
    return comps, entry


_REF_RE = re.compile(
    r"\b(calls|to_apply|condition|body|branch_computations|true_computation|"
    r"false_computation|called_computations)=(\{[^}]*\}|%?[\w.\-]+)")


_BRANCH_KEYS = ("branch_computations", "true_computation", "false_computation")


def _callees(instr: _Instr) -> list[tuple[str, int, str, int | None]]:
    """(computation, runs per run of the caller, caveat, branch index or None) for each
    computation `instr` calls; a pred conditional's true_computation is branch 0."""
    if instr.opcode.endswith("-done") or instr.opcode == "async-update":
        return []  # the matching -start already called it
    trip = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', instr.attrs)
    attrs = re.sub(r'"(?:[^"\\]|\\.)*"', '""', instr.attrs)  # drop strings: op_name may say "body"
    out = []
    for key, value in _REF_RE.findall(attrs):
        for pos, callee in enumerate(re.findall(r"%?([\w.\-]+)", value)):
            factor, caveat, branch = 1, "", None
            if instr.opcode == "while":
                if trip:
                    factor = int(trip.group(1)) + (key == "condition")
                else:
                    caveat = f"while {instr.name} has no known trip count: counted once per call"
            elif key in _BRANCH_KEYS:
                branch = pos if key == "branch_computations" else int(key == "false_computation")
                caveat = f"in a branch of conditional {instr.name}: counted as if it always runs"
            out.append((callee, factor, caveat, branch))
    return out


def _multiplicities(comps: dict[str, list[_Instr]], entry: str, ndev: int):
    """Runs per call, runs per call on each partition id, and caveats of every
    computation reachable from `entry`."""
    order, seen = [], set()

    def visit(name: str):  # post-order DFS; HLO call graphs are acyclic
        seen.add(name)
        for instr in comps[name]:
            for callee, _, _, _ in _callees(instr):
                if callee in comps and callee not in seen:
                    visit(callee)
        order.append(name)

    visit(entry)
    callers: dict[str, list[tuple[str, _Instr, int | None]]] = {}
    for name in order:
        for instr in comps[name]:
            for callee, _, _, branch in _callees(instr):
                callers.setdefault(callee, []).append((name, instr, branch))
    selector = _Selector(comps, callers)
    counts = {name: 0 for name in order}
    runs = {name: np.zeros(ndev) for name in order}
    caveats: dict[str, set[str]] = {name: set() for name in order}
    counts[entry], runs[entry][:] = 1, 1.0
    for name in reversed(order):  # callers before callees
        for instr in comps[name]:
            picks = selector.picks(name, instr, ndev) if instr.opcode == "conditional" else None
            for callee, factor, caveat, branch in _callees(instr):
                if callee in counts:
                    taken = 1.0
                    if branch is not None and picks is not None:
                        taken, caveat = picks == branch, ""
                    counts[callee] += counts[name] * factor
                    runs[callee] += runs[name] * factor * taken
                    caveats[callee] |= caveats[name] | ({caveat} if caveat else set())
    return counts, runs, caveats


# ---------------------------------------------------------------- branch selectors

class _Unknown(Exception):
    """A value the selector interpreter cannot know exactly."""


def _split_args(instr: _Instr) -> tuple[list[str], str]:
    """The operand names (a constant's literal) of `instr`, and the attribute text after them."""
    parts, depth, cur = [], 0, ""
    for i, ch in enumerate(instr.attrs):
        if ch in ")]}" and depth == 0:
            parts.append(cur)
            # operands may be printed with their shapes: the name is the last word
            return [p.split()[-1].lstrip("%") for p in parts if p.strip()], instr.attrs[i + 1:]
        depth += (ch in "([{") - (ch in ")]}")
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    raise _Unknown(f"unbalanced operands of {instr.name}")


def _attr(rest: str, key: str) -> str:
    m = re.search(rf"\b{key}=%?([\w.\-]+)", rest)
    if not m:
        raise _Unknown(f"no {key}=")
    return m.group(1)


def _wrap(v: int, dtype: str) -> int:
    """`v` as a value of integer `dtype`, wrapping as the hardware does."""
    if dtype == "pred":
        return int(v != 0)
    m = re.fullmatch(r"([su])(\d+)", dtype)
    if not m:
        raise _Unknown(f"{dtype} is not an integer type")
    bits = int(m.group(2))
    v &= (1 << bits) - 1
    return v - (1 << bits) if m.group(1) == "s" and v >> (bits - 1) else v


_COMPARE = {"EQ": operator.eq, "NE": operator.ne, "LT": operator.lt, "LE": operator.le,
            "GT": operator.gt, "GE": operator.ge}
_BINARY = {"add": operator.add, "subtract": operator.sub, "multiply": operator.mul,
           "and": operator.and_, "or": operator.or_, "xor": operator.xor,
           "minimum": min, "maximum": max}


def _apply(op: str, a: list[int], rest: str, dtype: str) -> int:
    """One scalar integer op on operand values; the caller wraps the result to `dtype`."""
    if op in _BINARY and len(a) == 2:
        return _BINARY[op](*a)
    if op == "compare":
        return _COMPARE[_attr(rest, "direction")](*a)
    if op in ("convert", "copy", "bitcast", "reshape"):
        return a[0]
    if op == "negate":
        return -a[0]
    if op == "not":
        return 1 - a[0] if dtype == "pred" else ~a[0]
    if op == "select":
        return a[1] if a[0] else a[2]
    if op == "clamp":  # clamp(min, operand, max)
        return min(max(a[1], a[0]), a[2])
    if op in ("divide", "remainder") and a[1] != 0:  # x/0 has no use in a selector: unknown
        x, y = a
        q = abs(x) // abs(y) * (1 if (x < 0) == (y < 0) else -1)  # rounds toward zero
        return q if op == "divide" else x - y * q
    if op.startswith("shift-") and dtype != "pred":
        bits = _DTYPE_BITS[dtype]
        x, n = a[0] & ((1 << bits) - 1), a[1] & ((1 << bits) - 1)  # the amount is unsigned
        if op == "shift-left":
            return x << n if n < bits else 0
        if op == "shift-right-logical":
            return x >> n if n < bits else 0
        if op == "shift-right-arithmetic":
            return _wrap(x, f"s{bits}") >> min(n, bits - 1)
    raise _Unknown(f"{op} is not interpreted")


class _Selector:
    """Exact values of the scalar integer HLO that picks a conditional's branch.

    Partition ids are taken to be the mesh's flattened device positions, as
    for replica groups with use_global_device_ids; the replica id is 0.
    """

    def __init__(self, comps: dict[str, list[_Instr]], callers):
        self.instrs = {c: {i.name: i for i in instrs} for c, instrs in comps.items()}
        self.roots = {c: next((i for i in instrs if i.line.lstrip().startswith("ROOT")), None)
                      for c, instrs in comps.items()}
        self.callers = callers  # computation -> [(calling computation, instruction, branch)]
        self.memo: dict = {}  # per partition id: a selector may reuse a value many times

    def picks(self, comp: str, cond: _Instr, ndev: int) -> np.ndarray | None:
        """The branch each partition id takes, or None where that is not known exactly."""
        n = len([b for _, _, _, b in _callees(cond) if b is not None])
        try:
            sel = self.instrs[comp][_split_args(cond)[0][0]]
            values = []
            for pid in range(ndev):
                self.memo = {}
                values.append(self.value(comp, sel.name, pid))
        except (_Unknown, KeyError, IndexError, ValueError):
            return None
        if sel.shape[0] == "pred":
            return np.array([0 if v else 1 for v in values])  # true_computation is branch 0
        return np.array([v if 0 <= v < n else n - 1 for v in values])  # XLA: else the last

    def value(self, comp: str, name: str, pid: int, args=None, path: tuple[int, ...] = ()) -> int:
        """`name` in `comp` on partition `pid`; `path` indexes into a tuple value.
        `args` binds a fused computation's parameters to (computation, name, args)
        of its operands; without it a parameter is looked up at its one caller."""
        key = (comp, name, args, path)
        if key not in self.memo:
            self.memo[key] = self._value(comp, name, pid, args, path)
        return self.memo[key]

    def _value(self, comp, name, pid, args, path) -> int:
        instr = self.instrs[comp][name]
        ops, rest = _split_args(instr)
        op = instr.opcode
        if op == "get-tuple-element":
            return self.value(comp, ops[0], pid, args, (int(_attr(rest, "index")),) + path)
        if op == "tuple" and path:
            return self.value(comp, ops[path[0]], pid, args, path[1:])
        if op == "parameter":
            return self._parameter(comp, int(ops[0]), pid, args, path)
        if op in ("fusion", "call"):
            callee = _attr(rest, "calls" if op == "fusion" else "to_apply")
            if self.roots.get(callee) is None:
                raise _Unknown(f"{callee} has no ROOT")
            return self.value(callee, self.roots[callee].name, pid,
                              tuple((comp, o, args) for o in ops), path)
        if path or not isinstance(instr.shape, tuple) or math.prod(instr.shape[1]) != 1:
            raise _Unknown(f"{name} is not a scalar")
        dtype = instr.shape[0]
        if op == "partition-id":
            v = pid
        elif op == "replica-id":
            v = 0
        elif op == "constant":
            lit = re.fullmatch(r"\{?\s*(true|false|-?\d+)\s*\}?", ops[0] if ops else "")
            if not lit:
                raise _Unknown(f"constant {name}")
            v = {"true": 1, "false": 0}.get(lit.group(1))
            v = int(lit.group(1)) if v is None else v
        else:
            v = _apply(op, [self.value(comp, o, pid, args) for o in ops], rest, dtype)
        return _wrap(v, dtype)

    def _parameter(self, comp, number, pid, args, path) -> int:
        if args is not None:
            return self.value(*args[number][:2], pid, args[number][2], path)
        if len(self.callers.get(comp, [])) != 1:
            raise _Unknown(f"{comp} has no single caller")
        caller, site, branch = self.callers[comp][0]
        ops = _split_args(site)[0]
        if site.opcode in ("fusion", "call"):
            return self.value(caller, ops[number], pid, None, path)
        if branch is not None:  # branch b's parameter is the conditional's operand b + 1
            return self.value(caller, ops[branch + 1], pid, None, path)
        if site.opcode == "while" and path and self._invariant(_attr(site.attrs, "body"), path[0]):
            return self.value(caller, ops[0], pid, None, path)
        raise _Unknown(f"parameter of {comp}")

    def _invariant(self, body: str, k: int) -> bool:
        """Whether the loop `body` passes element `k` of its state through unchanged."""
        params = [i.name for i in self.instrs[body].values() if i.opcode == "parameter"]
        root = self.roots[body]
        if root is None or root.opcode != "tuple" or len(params) != 1:
            return False
        ops = _split_args(root)[0]
        elem = self.instrs[body].get(ops[k]) if k < len(ops) else None
        return (elem is not None and elem.opcode == "get-tuple-element"
                and _split_args(elem)[0] == params and _attr(_split_args(elem)[1], "index") == str(k))


# ---------------------------------------------------------------- replica groups and axes

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


def _groups_text(instr: _Instr) -> str | None:
    """The text after `replica_groups=`, or None if absent; raises if unreadable."""
    if "replica_groups=" not in instr.attrs:
        return None
    m = re.search(r"replica_groups=(\{(?:[^{}]|\{[^{}]*\})*\}|\[[\d,]+\]<=\[[\d,]+\](?:T\([\d,]+\))?"
                  r"|mesh\[[^\]]*\](?:, device_ids=\((?:[^()]|\([^()]*\))*\))? \{[^}]*\})", instr.attrs)
    if not m:
        raise ValueError(f"hlo_text: unrecognised replica_groups in line: {instr.line.strip()}")
    return m.group(1)


def _axes_spanned(device_sets: Sequence[Sequence[int]], mesh_shape: tuple[int, ...],
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


# ---------------------------------------------------------------- collectives

def _kind_of(opcode: str) -> str | None:
    base = opcode[: -len("-start")] if opcode.endswith("-start") else opcode
    return base if base in KINDS else None


def _sent_tree(instr: _Instr, kind: str):
    """The part of the result that is the collective's output (async starts carry more)."""
    if not instr.opcode.endswith("-start") or kind in ("all-reduce", "all-to-all", "reduce-scatter"):
        return instr.shape
    # all-gather-start: (operands, outputs); collective-permute-start: (operand, output[, context])
    if not isinstance(instr.shape, list) or len(instr.shape) < 2:
        raise ValueError(f"hlo_text: unexpected {instr.opcode} result in line: {instr.line.strip()}")
    return instr.shape[1]


def _collective(instr: _Instr, count: int, runs: np.ndarray, caveat: str, mesh_shape,
                axis_names) -> Collective:
    """`count` runs per call; `runs` holds the runs per call on each partition id."""
    kind = _kind_of(instr.opcode)
    sent = _sent_tree(instr, kind)
    leaves = _leaves(sent)
    part_bytes = [_array_bytes(dt, dims, bits) for dt, dims, bits in leaves]
    buf = sum(part_bytes)
    if kind == "collective-permute":
        m = re.search(r"source_target_pairs=\{((?:\s*\{\d+,\d+\}\s*,?)*)\}", instr.attrs)
        if not m:
            raise ValueError(f"hlo_text: unrecognised source_target_pairs in line: {instr.line.strip()}")
        pairs = [tuple(map(int, p)) for p in re.findall(r"\{(\d+),(\d+)\}", m.group(1))]
        axes = _axes_spanned(pairs, mesh_shape, axis_names, instr.line)
        n = math.prod(mesh_shape[axis_names.index(a)] for a in axes)
        per_device = float(buf)
        sends = np.zeros(len(runs))  # a device whose pairs all stay on it sends nothing
        sends[[s for s, t in pairs if s != t]] = 1.0
        runs = runs * sends
    else:
        try:
            groups = parse_replica_groups(_groups_text(instr) or "{}", math.prod(mesh_shape))
        except ValueError as e:
            raise ValueError(f"hlo_text: {e}; in line: {instr.line.strip()}") from None
        if len({len(g) for g in groups}) != 1:
            raise ValueError(f"hlo_text: replica groups of unequal size in line: {instr.line.strip()}")
        axes = _axes_spanned(groups, mesh_shape, axis_names, instr.line)
        n = len(groups[0])
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
    comps, entry = _computations(hlo_text)
    if entry is None:
        raise ValueError("hlo_text: no ENTRY computation found")
    counts, runs, caveats = _multiplicities(comps, entry, math.prod(shape))
    found, notes, unmeasured = [], [], {}
    for comp in (c for c in comps if c in counts):  # text order
        for instr in comps[comp]:
            if instr.opcode in UNMEASURED or instr.opcode.removesuffix("-start") in UNMEASURED:
                unmeasured[instr.opcode] = unmeasured.get(instr.opcode, 0) + 1
            if _kind_of(instr.opcode) and counts[comp]:
                caveat = "; ".join(sorted(caveats[comp]))
                found.append(_collective(instr, counts[comp], runs[comp], caveat, shape, names))
    for caveat in dict.fromkeys(c.caveat for c in found if c.caveat):
        which = [c.name for c in found if c.caveat == caveat]
        notes.append(f"{len(which)} collective(s) ({', '.join(which)}): {caveat}")
    for op, k in unmeasured.items():
        notes.append(f"{k} {op} instruction(s) move bytes this meter does not count")
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


def measure_compiled(compiled, mesh) -> WireReport:
    """WireReport of an already compiled program (`jax.jit(f).lower(...).compile()`)."""
    return from_text(compiled.as_text(), mesh)


def _elements_by_kind(text: str, dtype: str) -> dict[str, tuple[int, int]]:
    """{kind: (collectives sending `dtype`, their `dtype` elements)} of HLO text."""
    out: dict[str, tuple[int, int]] = {}
    for line in text.splitlines():
        instr = _read_instr(line)
        kind = _kind_of(instr.opcode) if instr is not None else None
        if kind is None:
            continue
        elems = [math.prod(dims) for dt, dims, _ in _leaves(_sent_tree(instr, kind)) if dt == dtype]
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
    """Compile `fn(*args, **kwargs)` (jitting it unless it has `.lower`) and meter its traffic."""
    _mesh_shape(mesh)  # reject a bad mesh before compiling
    jitted = fn if hasattr(fn, "lower") else jax.jit(fn)
    lowered = jitted.lower(*args, **kwargs)
    compiled = lowered.compile()
    report = measure_compiled(compiled, mesh)
    platform = mesh.devices.flat[0].platform
    note = widening_note(lowered.as_text(dialect="hlo"), compiled.as_text(), platform)
    if note:
        report.notes.insert(0, note)
    return report
