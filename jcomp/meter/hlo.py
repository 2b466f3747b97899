"""Reading compiled HLO text: shapes, instructions, computations, how often
each computation runs on each device, and the exact values of the scalar
selectors that pick a conditional's branch.

The byte meter (`jcomp.meter.wire`) is built on it; nothing here knows about bytes.
"""
from __future__ import annotations

import dataclasses
import math
import operator
import re

import numpy as np

# The collective opcodes: a line holding one that cannot be read is an error,
# never a silently skipped instruction.
COLLECTIVE_KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all",
                    "collective-permute")

DTYPE_BITS = {
    "pred": 8, "s1": 1, "u1": 1, "s2": 2, "u2": 2, "s4": 4, "u4": 4,
    "s8": 8, "u8": 8, "s16": 16, "u16": 16, "s32": 32, "u32": 32, "s64": 64, "u64": 64,
    "f16": 16, "bf16": 16, "f32": 32, "f64": 64, "c64": 64, "c128": 128,
    "f4e2m1fn": 4, "f6e2m3fn": 6, "f6e3m2fn": 6, "f8e3m4": 8, "f8e4m3": 8,
    "f8e4m3fn": 8, "f8e4m3fnuz": 8, "f8e4m3b11fnuz": 8, "f8e5m2": 8, "f8e5m2fnuz": 8,
    "f8e8m0fnu": 8, "token": 0,
}

_ARRAY_RE = re.compile(r"([a-z][a-z0-9]*)\[([^\]]*)\](\{[^}]*\})?")


def parse_shape(text: str, line: str):
    """HLO shape text -> nested lists of (dtype, dims, bits) leaves; returns (tree, rest)."""
    text = text.lstrip()
    if text.startswith("("):
        items, text = [], text[1:].lstrip()
        while not text.startswith(")"):
            item, text = parse_shape(text, line)
            items.append(item)
            text = text.lstrip()
            if text.startswith(","):
                text = text[1:].lstrip()
            elif not text.startswith(")"):
                raise ValueError(f"hlo_text: cannot read tuple shape in line: {line.strip()}")
        return items, text[1:]
    m = _ARRAY_RE.match(text)
    if not m or m.group(1) not in DTYPE_BITS:
        raise ValueError(f"hlo_text: unknown shape or dtype in line: {line.strip()}")
    dtype, dims_text, layout = m.groups()
    if "?" in dims_text:
        raise ValueError(f"hlo_text: unbounded dynamic shape in line: {line.strip()}")
    dims = tuple(int(d.replace("<=", "")) for d in dims_text.split(",") if d.strip())
    packed = re.search(r"E\((\d+)\)", layout or "")
    bits = int(packed.group(1)) if packed else None
    return (dtype, dims, bits), text[m.end():]


def leaves(tree) -> list:
    return [tree] if isinstance(tree, tuple) else [x for t in tree for x in leaves(t)]


# ---------------------------------------------------------------- instructions and computations

_INSTR_RE = re.compile(r"^\s*(?:ROOT\s+)?%?([^\s=(){}]+)\s*=\s*(.*)$")
_HEADER_RE = re.compile(r"^\s*(ENTRY\s+)?%?([^\s(){}=]+)\s*(?:\(.*\)\s*->\s*.*)?\{\s*$")
_COLLECTIVE_OP_RE = re.compile(r"\s(?:" + "|".join(COLLECTIVE_KINDS) + r")(?:-start)?\(")


@dataclasses.dataclass(frozen=True)
class Instr:
    name: str
    shape: object  # nested tree from parse_shape
    opcode: str
    attrs: str
    line: str


_COMMENT_RE = re.compile(r"/\*.*?\*/")


def read_instr(line: str) -> Instr | None:
    """One HLO instruction line, or None if the line is not an instruction."""
    line = _COMMENT_RE.sub("", line)  # long tuples carry /*index=N*/ markers
    m = _INSTR_RE.match(line)
    if not m or line.lstrip().startswith(("HloModule", "ENTRY")):
        return None
    try:
        shape, rest = parse_shape(m.group(2), line)
    except ValueError:
        if _COLLECTIVE_OP_RE.search(line):
            raise  # a collective we cannot size must not vanish from the count
        return None  # not an instruction line (e.g. module-level attributes)
    op = re.match(r"\s*([a-z][\w\-]*)\(", rest)
    if not op:
        return None
    return Instr(m.group(1), shape, op.group(1), rest[op.end():], line)


def computations(text: str) -> tuple[dict[str, list[Instr]], str | None]:
    """Split HLO text into computations: {name: instructions}, and the ENTRY name."""
    comps: dict[str, list[Instr]] = {}
    entry, current = None, None
    for line in text.splitlines():
        if current is None:
            h = _HEADER_RE.match(line)
            if h:
                current = h.group(2)
                comps[current] = []
                entry = current if h.group(1) else entry
        elif line.strip() == "}" or line.strip().startswith("}, execution_thread="):
            current = None  # a computation of another execution thread ends this way
        else:
            instr = read_instr(line)
            if instr is not None:
                comps[current].append(instr)
    if not comps:  # bare instruction lines: treat them as one computation run once
        lines = [i for i in map(read_instr, text.splitlines()) if i is not None]
        return {"entry": lines}, "entry"
    return comps, entry


_REF_RE = re.compile(
    r"\b(calls|to_apply|condition|body|branch_computations|true_computation|"
    r"false_computation|called_computations)=(\{[^}]*\}|%?[\w.\-]+)")


_BRANCH_KEYS = ("branch_computations", "true_computation", "false_computation")


def callees(instr: Instr) -> list[tuple[str, int, str, int | None]]:
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


def multiplicities(comps: dict[str, list[Instr]], entry: str, ndev: int):
    """Runs per call, runs per call on each partition id, and caveats of every
    computation reachable from `entry`."""
    calls = {name: [(instr, callees(instr)) for instr in instrs] for name, instrs in comps.items()}
    order, seen = [], set()

    def visit(name: str):  # post-order DFS; HLO call graphs are acyclic
        seen.add(name)
        for _, edges in calls[name]:
            for callee, _, _, _ in edges:
                if callee in comps and callee not in seen:
                    visit(callee)
        order.append(name)

    visit(entry)
    callers: dict[str, list[tuple[str, Instr, int | None]]] = {}
    for name in order:
        for instr, edges in calls[name]:
            for callee, _, _, branch in edges:
                callers.setdefault(callee, []).append((name, instr, branch))
    selector = _Selector(comps, callers)
    counts = {name: 0 for name in order}
    runs = {name: np.zeros(ndev) for name in order}
    caveats: dict[str, set[str]] = {name: set() for name in order}
    counts[entry], runs[entry][:] = 1, 1.0
    for name in reversed(order):  # callers before callees
        for instr, edges in calls[name]:
            n_branches = sum(branch is not None for _, _, _, branch in edges)
            picks = (selector.picks(name, instr, ndev, n_branches)
                     if instr.opcode == "conditional" else None)
            for callee, factor, caveat, branch in edges:
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


def _split_args(instr: Instr) -> tuple[list[str], str]:
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


def operands(instr: Instr) -> list[str]:
    """The operand names (a constant's literal) of `instr`."""
    return _split_args(instr)[0]


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
        bits = DTYPE_BITS[dtype]
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

    def __init__(self, comps: dict[str, list[Instr]], callers):
        self.instrs = {c: {i.name: i for i in instrs} for c, instrs in comps.items()}
        self.roots = {c: next((i for i in instrs if i.line.lstrip().startswith("ROOT")), None)
                      for c, instrs in comps.items()}
        self.callers = callers  # computation -> [(calling computation, instruction, branch)]
        self.memo: dict = {}  # per partition id: a selector may reuse a value many times

    def picks(self, comp: str, cond: Instr, ndev: int, n: int) -> np.ndarray | None:
        """The branch (of `n`) each partition id takes, or None where that is not
        known exactly."""
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

