"""Tests for jcomp.meter.hlo: reading compiled HLO text (shapes, instructions,
computations), how often each computation runs per call and per partition id,
and the exact values of the selectors that pick a conditional's branch. Some
cases read their counts through jcomp.meter.wire's report, which is built on it."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from jcomp.meter import hlo, wire

AXES = ("data", "tensor", "pipeline")
MESH = {"data": 2, "tensor": 2, "pipeline": 2}


def _module(body: str, extra: str = "") -> str:
    return f"HloModule m, num_partitions=8\n\n{extra}\nENTRY %main (p: f32[64]) -> f32[64] {{\n{body}\n}}\n"


class _FakeMesh:
    """Stands in for a Mesh where only its shape and names matter."""
    devices = np.empty((2, 2, 2))
    axis_names = AXES


ADD = """
%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

"""


def _instr(line: str) -> hlo.Instr:
    instr = hlo.read_instr(line)
    assert instr is not None, line
    return instr


def _called(instr: hlo.Instr, key: str) -> str:
    return re.search(rf"\b{key}=%?([\w.\-]+)", instr.attrs).group(1)


# ---------------------------------------------------------------- shapes

def test_parse_shape_reads_an_array_and_returns_the_rest():
    tree, rest = hlo.parse_shape("f32[2,3]{1,0} add(%a, %b)", "line")
    assert tree == ("f32", (2, 3), None)
    assert rest == " add(%a, %b)"


def test_parse_shape_reads_scalars_and_nested_tuples():
    tree, rest = hlo.parse_shape("(f32[4]{0}, (s8[2]{0}, pred[]), u32[]) tuple(%a)", "line")
    assert tree == [("f32", (4,), None), [("s8", (2,), None), ("pred", (), None)],
                    ("u32", (), None)]
    assert rest == " tuple(%a)"
    assert hlo.leaves(tree) == [("f32", (4,), None), ("s8", (2,), None), ("pred", (), None),
                                ("u32", (), None)]
    assert hlo.parse_shape("()", "line") == ([], "")


def test_parse_shape_reads_packed_bits_and_dynamic_bounds():
    assert hlo.parse_shape("s4[64]{0:E(4)}", "line")[0] == ("s4", (64,), 4)  # packed 2 per byte
    assert hlo.parse_shape("s4[64]{0}", "line")[0] == ("s4", (64,), None)  # one per byte
    assert hlo.parse_shape("f32[<=8,3]{1,0}", "line")[0] == ("f32", (8, 3), None)  # the bound


@pytest.mark.parametrize("text,why", [
    ("f32[?]{0}", "unbounded dynamic shape"),
    ("q7[4]{0}", "unknown shape or dtype"),
    ("(f32[4]{0} f32[4]{0})", "cannot read tuple shape"),
])
def test_parse_shape_refuses_what_it_cannot_size_quoting_the_line(text, why):
    with pytest.raises(ValueError, match=why) as e:
        hlo.parse_shape(text, "  %x = THE LINE  ")
    assert str(e.value).endswith("%x = THE LINE")


# ---------------------------------------------------------------- instructions

def test_read_instr_splits_name_shape_opcode_and_attributes():
    instr = _instr("  ROOT %ar.1 = f32[8]{0} all-reduce(%p), channel_id=1, to_apply=%add")
    assert (instr.name, instr.shape, instr.opcode) == ("ar.1", ("f32", (8,), None), "all-reduce")
    assert instr.attrs == "%p), channel_id=1, to_apply=%add"
    # long tuples carry /*index=N*/ markers between their elements
    t = _instr("  %t = (f32[], f32[], /*index=2*/s8[4]{0}) tuple(%a, %b, /*index=2*/%c)")
    assert t.shape == [("f32", (), None), ("f32", (), None), ("s8", (4,), None)]


@pytest.mark.parametrize("line", [
    "HloModule m, num_partitions=8",
    "ENTRY %main (p: f32[4]) -> f32[4] {",
    "}",
    "",
    "1 {file_location_id=1 parent_frame_id=1}",  # the stack-frame tables of compiled text
    '1 "/tmp/x.py"',
])
def test_lines_that_are_not_instructions_read_as_none(line):
    assert hlo.read_instr(line) is None


def test_an_unreadable_shape_skips_an_instruction_but_not_a_collective():
    assert hlo.read_instr("  %x = q7[4]{0} negate(%p)") is None
    for op in ("all-gather", "collective-permute-start"):
        with pytest.raises(ValueError, match="q7"):
            hlo.read_instr(f"  %x = q7[4]{{0}} {op}(%p), replica_groups={{{{0,1}}}}")


# ---------------------------------------------------------------- computations and callees

MODULE = """HloModule m, num_partitions=8
""" + ADD + """%unused (u: f32[]) -> f32[] {
  ROOT %u = f32[] parameter(0)
}

ENTRY %main (p: f32[4]) -> f32[] {
  %p = f32[4]{0} parameter(0)
  %z = f32[] constant(0)
  ROOT %r = f32[] reduce(%p, %z), dimensions={0}, to_apply=%add
}
"""


def test_computations_split_a_module_and_find_its_entry():
    comps, entry = hlo.computations(MODULE)
    assert entry == "main"
    assert list(comps) == ["add", "unused", "main"]
    assert [i.name for i in comps["add"]] == ["x", "y", "s"]
    assert [i.opcode for i in comps["main"]] == ["parameter", "constant", "reduce"]


def test_bare_instruction_lines_are_one_computation_run_once():
    comps, entry = hlo.computations("%p = f32[4]{0} parameter(0)\n%n = f32[4]{0} negate(%p)\n")
    assert entry == "entry"
    assert [i.name for i in comps["entry"]] == ["p", "n"]
    counts, runs, _ = hlo.multiplicities(comps, entry, 2)
    assert counts == {"entry": 1} and list(runs["entry"]) == [1.0, 1.0]


def test_multiplicities_cover_what_the_entry_reaches():
    comps, entry = hlo.computations(MODULE)
    counts, runs, caveats = hlo.multiplicities(comps, entry, 4)
    assert counts == {"main": 1, "add": 1}  # %unused is never called
    assert all(list(r) == [1.0] * 4 for r in runs.values())
    assert caveats == {"main": set(), "add": set()}


def test_a_while_runs_its_body_trip_count_times_and_its_condition_once_more():
    w = _instr('  %w = f32[4]{0} while(%p), condition=%c, body=%b, '
               'backend_config={"known_trip_count":{"n":"3"}}')
    assert sorted(hlo.callees(w)) == [("b", 3, "", None), ("c", 4, "", None)]


def test_a_while_without_a_trip_count_is_counted_once_with_a_caveat():
    out = hlo.callees(_instr("  %w.2 = f32[4]{0} while(%p), condition=%c, body=%b"))
    assert sorted((name, factor, branch) for name, factor, _, branch in out) == [
        ("b", 1, None), ("c", 1, None)]
    assert {caveat for _, _, caveat, _ in out} == {
        "while w.2 has no known trip count: counted once per call"}


def test_conditional_branches_are_numbered_and_true_is_branch_zero():
    out = hlo.callees(_instr("  %c = f32[4]{0} conditional(%i, %p, %p, %p), "
                             "branch_computations={%b0, %b1, %b2}"))
    assert [(name, factor, branch) for name, factor, _, branch in out] == [
        ("b0", 1, 0), ("b1", 1, 1), ("b2", 1, 2)]
    assert all("in a branch of conditional c" in caveat for _, _, caveat, _ in out)
    pred = hlo.callees(_instr("  %c = f32[4]{0} conditional(%t, %p, %p), "
                              "true_computation=%yes, false_computation=%no"))
    assert sorted((name, branch) for name, _, _, branch in pred) == [("no", 1), ("yes", 0)]


def test_calls_run_once_and_the_done_half_of_an_async_pair_calls_nothing():
    assert hlo.callees(_instr("  %f = f32[4]{0} fusion(%p), kind=kLoop, calls=%fused")) == [
        ("fused", 1, "", None)]
    assert hlo.callees(_instr("  %r = f32[] reduce(%p, %z), dimensions={0}, to_apply=%add")) == [
        ("add", 1, "", None)]
    start = _instr("  %s = ((f32[64]{0}), f32[16]{0}) async-start(%p), calls=%wrapped")
    done = _instr("  %d = f32[16]{0} async-done(%s), calls=%wrapped")
    assert hlo.callees(start) == [("wrapped", 1, "", None)] and hlo.callees(done) == []


def test_computation_names_inside_strings_are_not_calls():
    line = ('  %k = f32[4]{0} call(%p), to_apply=%real, '
            'metadata={op_name="jit(f)/body=%fake/calls=%fake2"}')
    assert hlo.callees(_instr(line)) == [("real", 1, "", None)]


# ---------------------------------------------------------------- branch selectors

YES_NO = """
%yes (a: f32[4]) -> f32[4] {
  ROOT %a = f32[4]{0} parameter(0)
}

%no (b: f32[4]) -> f32[4] {
  %b = f32[4]{0} parameter(0)
  ROOT %n = f32[4]{0} negate(%b)
}
"""

LOOPED_BRANCH = "HloModule m, num_partitions=8\n" + YES_NO + """
%body (s: f32[4]) -> f32[4] {
  %s = f32[4]{0} parameter(0)
  %pid = u32[] partition-id()
  %two = u32[] constant(2)
  %low = pred[] compare(%pid, %two), direction=LT
  ROOT %c = f32[4]{0} conditional(%low, %s, %s), true_computation=%yes, false_computation=%no
}

%cond (q: f32[4]) -> pred[] {
  %q = f32[4]{0} parameter(0)
  ROOT %t = pred[] constant(true)
}

ENTRY %main (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  ROOT %w = f32[4]{0} while(%p), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
}
"""


def test_multiplicities_multiply_trips_and_split_branches_by_partition_id():
    comps, entry = hlo.computations(LOOPED_BRANCH)
    counts, runs, caveats = hlo.multiplicities(comps, entry, 8)
    # counts are per call whichever branch runs; runs say where: ids 0 and 1 are below 2
    assert counts == {"main": 1, "body": 3, "cond": 4, "yes": 3, "no": 3}
    low = np.array([1, 1, 0, 0, 0, 0, 0, 0])
    np.testing.assert_array_equal(runs["yes"], 3 * low)
    np.testing.assert_array_equal(runs["no"], 3 * (1 - low))
    np.testing.assert_array_equal(runs["body"], np.full(8, 3.0))
    assert not any(caveats.values())


def test_a_selector_it_cannot_know_runs_every_branch_with_a_caveat():
    text = "HloModule m\n" + YES_NO + """
ENTRY %main (p: f32[4], k: pred[]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  %k = pred[] parameter(1)
  ROOT %c = f32[4]{0} conditional(%k, %p, %p), true_computation=%yes, false_computation=%no
}
"""
    comps, entry = hlo.computations(text)
    counts, runs, caveats = hlo.multiplicities(comps, entry, 8)
    for name in ("yes", "no"):
        np.testing.assert_array_equal(runs[name], np.ones(8))
        assert caveats[name] == {"in a branch of conditional c: counted as if it always runs"}


THREE = """
%b0 (a: f32[4]) -> f32[4] {
  ROOT %a = f32[4]{0} parameter(0)
}

%b1 (b: f32[4]) -> f32[4] {
  ROOT %b = f32[4]{0} parameter(0)
}

%b2 (c: f32[4]) -> f32[4] {
  ROOT %c = f32[4]{0} parameter(0)
}
"""


@pytest.mark.parametrize("expr,branch", [
    # branch index per partition id 0..7; below 0 or above 2: the last branch (2)
    ("clamp(%one, %v, %two)", [1, 1, 2, 2, 2, 2, 2, 2]),  # clamp(min, operand, max)
    ("minimum(%v, %two)", [0, 1, 2, 2, 2, 2, 2, 2]),
    ("select(%odd, %one, %zero)", [0, 1, 0, 1, 0, 1, 0, 1]),
    ("subtract(%two, %v)", [2, 1, 0, 2, 2, 2, 2, 2]),  # -1 .. -5 are out of range
    ("shift-left(%v, %one)", [0, 2, 2, 2, 2, 2, 2, 2]),  # 2 x id: 4 and up are out of range
    ("xor(%v, %one)", [1, 0, 2, 2, 2, 2, 2, 2]),  # swaps 0 and 1, 2 and 3, ...
    ("convert(%rid)", [0] * 8),  # the replica id is 0 everywhere
])
def test_selector_values_per_partition_id(expr, branch):
    body = "\n".join([
        "  %p = f32[4]{0} parameter(0)",
        "  %pid = u32[] partition-id()",
        "  %rid = u32[] replica-id()",
        "  %v = s32[] convert(%pid)",
        "  %zero = s32[] constant(0)",
        "  %one = s32[] constant(1)",
        "  %two = s32[] constant(2)",
        "  %lsb = s32[] and(%v, %one)",
        "  %odd = pred[] compare(%lsb, %one), direction=EQ",
        f"  %idx = s32[] {expr}",
        "  ROOT %c = f32[4]{0} conditional(%idx, %p, %p, %p), branch_computations={%b0, %b1, %b2}",
    ])
    text = "HloModule m\n" + THREE + "\nENTRY %main (p: f32[4]) -> f32[4] {\n" + body + "\n}\n"
    comps, entry = hlo.computations(text)
    counts, runs, caveats = hlo.multiplicities(comps, entry, 8)
    for k in range(3):
        np.testing.assert_array_equal(runs[f"b{k}"], [float(b == k) for b in branch], err_msg=f"b{k}")
        assert counts[f"b{k}"] == 1 and not caveats[f"b{k}"]


# ---------------------------------------------------------------- compiled programs

def test_compiled_fori_loop_runs_its_body_its_trip_count():
    trips = 7

    def f(x):
        return lax.fori_loop(0, trips, lambda i, c: jnp.sin(c) * i.astype(c.dtype) + c, x)

    text = jax.jit(f).lower(jnp.ones(16)).compile().as_text()
    comps, entry = hlo.computations(text)
    assert entry in comps and comps[entry]
    (loop,) = [i for instrs in comps.values() for i in instrs if i.opcode == "while"]
    body, cond = _called(loop, "body"), _called(loop, "condition")
    assert {name: factor for name, factor, _, _ in hlo.callees(loop)} == {
        body: trips, cond: trips + 1}
    counts, runs, caveats = hlo.multiplicities(comps, entry, 1)
    assert (counts[body], counts[cond]) == (trips, trips + 1)
    # the loop's work (the sine, wherever XLA fused it) runs once per trip
    sines = [name for name, instrs in comps.items() if any(i.opcode == "sine" for i in instrs)]
    assert sines and all(counts[name] == trips for name in sines)
    assert not any(caveats.values())


def test_compiled_cond_on_a_mesh_axis_index_runs_where_that_index_says():
    """lax.cond(axis_index('data') == 0) under shard_map: XLA computes the branch
    index from partition-id; on a (2, 2, 2) mesh partition id i is data row i // 4."""
    mesh = jax.make_mesh((2, 2, 2), AXES, axis_types=(jax.sharding.AxisType.Explicit,) * 3)
    spec = P(AXES)

    def g(x):
        return lax.cond(lax.axis_index("data") == 0, jnp.sin, jnp.cos, x)

    x = jax.device_put(jnp.arange(64.0), NamedSharding(mesh, spec))
    fn = jax.jit(jax.shard_map(g, mesh=mesh, in_specs=spec, out_specs=spec))
    text = fn.lower(x).compile().as_text()
    assert " conditional(" in text
    comps, entry = hlo.computations(text)
    counts, runs, caveats = hlo.multiplicities(comps, entry, 8)

    def runs_of(opcode):
        (name,) = [n for n, instrs in comps.items() if any(i.opcode == opcode for i in instrs)]
        return counts[name], list(runs[name]), caveats[name]

    assert runs_of("sine") == (1, [1.0] * 4 + [0.0] * 4, set())
    assert runs_of("cosine") == (1, [0.0] * 4 + [1.0] * 4, set())


# ---------------------------------------------------------------- through the byte meter

def test_collective_with_unknown_dtype_raises():
    line = "  ROOT %ar = q7[64]{0} all-reduce(%p), replica_groups={{0,1}}"
    with pytest.raises(ValueError, match="q7"):
        wire.parse_collectives(_module(line), MESH)


NESTED = """
%inner_body (a: f32[64]) -> f32[64] {
  %a = f32[64]{0} parameter(0)
  ROOT %ar.in = f32[64]{0} all-reduce(%a), replica_groups={{0,4},{1,5},{2,6},{3,7}}, to_apply=%add
}

%inner_cond (b: f32[64]) -> pred[] {
  %b = f32[64]{0} parameter(0)
  ROOT %cp.cond = f32[64]{0} collective-permute(%b), source_target_pairs={{0,1},{1,0}}
}

%outer_body (c: f32[64]) -> f32[64] {
  %c = f32[64]{0} parameter(0)
  ROOT %w.in = f32[64]{0} while(%c), condition=%inner_cond, body=%inner_body, metadata={op_name="x/body=%inner_body"}, backend_config={"known_trip_count":{"n":"4"}}
}

%outer_cond (d: f32[64]) -> pred[] {
  ROOT %d = pred[] parameter(0)
}
"""


def test_nested_loops_multiply_and_conditions_run_once_more():
    body = ("  %p = f32[64]{0} parameter(0)\n"
            "  ROOT %w.out = f32[64]{0} while(%p), condition=%outer_cond, body=%outer_body, "
            'backend_config={"known_trip_count":{"n":"3"}}')
    r = wire.from_text(_module(body, NESTED), _FakeMesh())
    counts = {c.name: c.count for c in r.collectives}
    assert counts == {"ar.in": 3 * 4, "cp.cond": 3 * (4 + 1)}
    # only devices 0 and 1 of 8 send in cp.cond's pairs
    assert r.by_axis() == {"data": 12 * 256.0, "pipeline": 15 * 256.0 * 2 / 8}
    assert not r.notes


def test_unknown_trip_count_and_branches_are_loud():
    body = ("  %p = f32[64]{0} parameter(0)\n"
            "  %w.out = f32[64]{0} while(%p), condition=%outer_cond, body=%outer_body\n"
            "  ROOT %cond.1 = f32[64]{0} conditional(%p, %p, %p), "
            "branch_computations={%inner_body, %outer_cond}")
    r = wire.from_text(_module(body, NESTED), _FakeMesh())
    counts = {c.name: c.count for c in r.collectives}
    # %inner_body runs once as a branch and 1 * 4 times inside the unknown loop
    assert counts == {"ar.in": 1 + 4, "cp.cond": 1 * 5}
    ar = next(c for c in r.collectives if c.name == "ar.in")
    assert "while w.out has no known trip count" in ar.caveat
    assert "in a branch of conditional cond.1" in ar.caveat
    table = r.table()
    assert "5?" in table
    assert all(f"({c.name}): " in table for c in r.collectives)


def test_computation_of_another_execution_thread_ends_where_it_closes():
    """XLA prints an async thread's computation as `}, execution_thread="..."`: it
    ends there, and the ENTRY's collectives after it are still read (and the
    thread's own collective, called from ENTRY, is counted under its caller)."""
    thread = "\n".join([
        "%wrapped_ar (q: f32[64]) -> f32[64] {",
        "  %q = f32[64]{0} parameter(0)",
        "  ROOT %ar_t = f32[64]{0} all-reduce(%q), replica_groups={{0,1},{2,3},{4,5},{6,7}}, "
        "to_apply=%add",
        '}, execution_thread="parallel"',
    ])
    body = "\n".join([
        "  %p = f32[64]{0} parameter(0)",
        "  %s = ((f32[64]{0}), f32[64]{0}) async-start(%p), calls=%wrapped_ar",
        "  %d = f32[64]{0} async-done(%s), calls=%wrapped_ar",
        "  ROOT %ag = f32[128]{0} all-gather(%d), replica_groups={{0,2},{1,3},{4,6},{5,7}}, "
        "dimensions={0}",
    ])
    add = ADD
    cs = {c.name: c for c in wire.parse_collectives(_module(body, add + thread), MESH)}
    assert sorted(cs) == ["ag", "ar_t"]
    assert (cs["ag"].axes, cs["ag"].bytes_per_device) == (("tensor",), 256.0)
    assert (cs["ar_t"].axes, cs["ar_t"].count) == (("pipeline",), 1)


# one all-reduce per branch, each over its own axis, so by_axis tells the branches apart
BRANCHES = """
%b0 (a: f32[64]) -> f32[64] {
  %a = f32[64]{0} parameter(0)
  ROOT %ar.data = f32[64]{0} all-reduce(%a), replica_groups={{0,4},{1,5},{2,6},{3,7}}, to_apply=%add
}

%b1 (b: f32[64]) -> f32[64] {
  %b = f32[64]{0} parameter(0)
  ROOT %ar.tensor = f32[64]{0} all-reduce(%b), replica_groups={{0,2},{1,3},{4,6},{5,7}}, to_apply=%add
}

%b2 (c: f32[64]) -> f32[64] {
  %c = f32[64]{0} parameter(0)
  ROOT %ar.pipe = f32[64]{0} all-reduce(%c), replica_groups={{0,1},{2,3},{4,5},{6,7}}, to_apply=%add
}
"""
AR = 2 * (1 / 2) * 256  # bytes of one f32[64] all-reduce over a pair

# partition id minus 3, in u32: it wraps below zero, so only ids 3 and 4 are below 2
OFFSET = ("  %p = f32[64]{0} parameter(0)\n"
          "  %pid = u32[] partition-id()\n"
          "  %three = u32[] constant(3)\n"
          "  %off = u32[] subtract(%pid, %three)\n")


def test_branch_index_out_of_range_takes_the_last_branch():
    body = OFFSET + (
        "  %idx = s32[] convert(%off)\n"  # ids 0..7 give -3..4: only 3, 4, 5 are in range
        "  %cond = f32[64]{0} conditional(%idx, %p, %p, %p), branch_computations={%b0, %b1, %b2}\n"
        "  ROOT %again = f32[64]{0} call(%p), to_apply=%b2")
    r = wire.from_text(_module(body, BRANCHES), _FakeMesh())
    shares = {c.name: (c.count, c.share) for c in r.collectives}
    # b2 runs on 6 of 8 devices in the conditional and on all 8 in the call: 14 of 16 runs
    assert shares == {"ar.data": (1, 1 / 8), "ar.tensor": (1, 1 / 8), "ar.pipe": (2, 14 / 16)}
    assert r.by_axis() == {"data": AR / 8, "tensor": AR / 8, "pipeline": AR * (6 / 8 + 1)}
    assert not r.notes


def test_pred_selector_picks_true_then_false_computation():
    body = OFFSET + (
        "  %two = u32[] constant(2)\n"
        "  %lt = pred[] compare(%off, %two), direction=LT\n"
        "  ROOT %cond = f32[64]{0} conditional(%lt, %p, %p), true_computation=%b0, "
        "false_computation=%b1")
    r = wire.from_text(_module(body, BRANCHES), _FakeMesh())
    assert r.by_axis() == {"data": AR * 2 / 8, "tensor": AR * 6 / 8} and not r.notes


@pytest.mark.parametrize("expr,k,ids", [
    ("divide(%m7, %v1)", -1, {3, 4, 5, 6}),  # rounds toward zero: -7 / 4 is -1, not -2
    ("remainder(%m7, %v1)", -1, {1, 2, 5}),  # has the dividend's sign
    ("shift-right-arithmetic(%neg, %one)", -2, {3, 4}),  # sign fills: -3 >> 1 is -2
    ("add(%max, %v)", -2**31, {1}),  # wraps at 32 bits
    ("not(%v)", -8, {7}),  # bitwise: -1 - id
])
def test_selector_arithmetic_is_exact(expr, k, ids):
    body = ("  %p = f32[64]{0} parameter(0)\n"
            "  %pid = u32[] partition-id()\n"
            "  %v = s32[] convert(%pid)\n"
            "  %one = s32[] constant(1)\n"
            "  %v1 = s32[] add(%v, %one)\n"
            "  %m7 = s32[] constant(-7)\n"
            "  %neg = s32[] negate(%v)\n"
            "  %max = s32[] constant(2147483647)\n"
            f"  %r = s32[] {expr}\n"
            f"  %k = s32[] constant({k})\n"
            "  %eq = pred[] compare(%r, %k), direction=EQ\n"
            "  ROOT %cond = f32[64]{0} conditional(%eq, %p, %p), true_computation=%b0, "
            "false_computation=%b1")
    r = wire.from_text(_module(body, BRANCHES), _FakeMesh())
    assert r.by_axis() == {"data": AR * len(ids) / 8, "tensor": AR * (8 - len(ids)) / 8}
    assert not r.notes


LOOP = """
%body (s: (s32[], f32[64], s32[])) -> (s32[], f32[64], s32[]) {
  %s = (s32[], f32[64]{0}, s32[]) parameter(0)
  %i = s32[] get-tuple-element(%s), index=0
  %x = f32[64]{0} get-tuple-element(%s), index=1
  %sel = s32[] get-tuple-element(%s), index=2
  %one = s32[] constant(1)
  %i.next = s32[] add(%i, %one)
  %y = f32[64]{0} conditional(%sel, %x, %x), branch_computations={%b0, %b1}
  %sel.next = s32[] SEL_NEXT
  ROOT %t = (s32[], f32[64]{0}, s32[]) tuple(%i.next, %y, %sel.next)
}

%loop_cond (q: (s32[], f32[64], s32[])) -> pred[] {
  %q = (s32[], f32[64]{0}, s32[]) parameter(0)
  %j = s32[] get-tuple-element(%q), index=0
  %five = s32[] constant(5)
  ROOT %more = pred[] compare(%j, %five), direction=LT
}
"""


@pytest.mark.parametrize("invariant", [True, False])
def test_selector_hoisted_out_of_a_loop(invariant):
    # ids 6 and 7 (id >> 1 == 3) take b1; the selector enters the loop as element 2
    body = ("  %p = f32[64]{0} parameter(0)\n"
            "  %pid = u32[] partition-id()\n"
            "  %one = u32[] constant(1)\n"
            "  %half = u32[] shift-right-logical(%pid, %one)\n"
            "  %three = u32[] constant(3)\n"
            "  %top = pred[] compare(%half, %three), direction=EQ\n"
            "  %sel = s32[] convert(%top)\n"
            "  %zero = s32[] constant(0)\n"
            "  %init = (s32[], f32[64]{0}, s32[]) tuple(%zero, %p, %sel)\n"
            "  %w = (s32[], f32[64]{0}, s32[]) while(%init), condition=%loop_cond, body=%body, "
            'backend_config={"known_trip_count":{"n":"5"}}\n'
            "  ROOT %out = f32[64]{0} get-tuple-element(%w), index=1")
    # an element the body rewrites is not the value that entered the loop
    loop = LOOP.replace("SEL_NEXT", "get-tuple-element(%s), index=2" if invariant else "add(%sel, %one)")
    r = wire.from_text(_module(body, BRANCHES + loop), _FakeMesh())
    assert {c.name: c.count for c in r.collectives} == {"ar.data": 5, "ar.tensor": 5}
    if invariant:
        assert r.by_axis() == {"data": 5 * AR * 6 / 8, "tensor": 5 * AR * 2 / 8} and not r.notes
    else:
        assert r.by_axis() == {"data": 5 * AR, "tensor": 5 * AR}
        assert r.notes == ["2 collective(s) (ar.data, ar.tensor): in a branch of conditional y: "
                           "counted as if it always runs"]
