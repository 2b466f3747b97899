"""Tests for jcomp.meter.wire: bytes read from compiled programs and from hand-written HLO.
How often each computation runs, and the branch selectors, are read by jcomp.meter.hlo:
tests/meter/test_hlo.py."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from jcomp.meter import wire

AXES = ("data", "tensor", "pipeline")
ALL = P(AXES)  # each device holds its own slice of a 1-D array
D = 1024  # float32 elements per device: 4096 bytes


def _mesh(shape):
    return jax.make_mesh(shape, AXES, axis_types=(jax.sharding.AxisType.Explicit,) * 3)


def _slices(m):
    return jax.device_put(jnp.arange(8 * D, dtype=jnp.float32), NamedSharding(m, ALL))


@pytest.fixture(scope="module")
def mesh():
    return _mesh((2, 2, 2))


@pytest.fixture(scope="module")
def x_8D(mesh):
    return _slices(mesh)


def _meter(mesh, x, f_D, jit=True):
    """Report of `f_D` applied per device to a (D,) float32 slice, under shard_map."""
    smap = jax.shard_map(f_D, mesh=mesh, in_specs=ALL, out_specs=ALL, check_vma=True)
    return wire.measure(jax.jit(smap) if jit else smap, x, mesh=mesh)


def _only(report):
    assert len(report.collectives) == 1, report.table()
    return report.collectives[0]


# ---------------------------------------------------------------- compiled programs

def test_psum_over_data(mesh, x_8D):
    r = _meter(mesh, x_8D, lambda x: lax.psum(x, "data"))
    c = _only(r)
    assert (c.kind, c.dtype, c.shape, c.axes, c.group_size, c.count) == (
        "all-reduce", "f32", (D,), ("data",), 2, 1)
    assert c.bytes_per_device == 2 * (1 / 2) * 4 * D
    assert r.by_axis() == {"data": 4096.0}
    assert r.total() == 4096.0
    assert r.by_dtype() == {"f32": 4096.0}
    assert not r.notes
    lines = r.table().splitlines()
    assert lines[0].split() == ["kind", "dtype", "shape", "axes", "n", "count",
                                "bytes/dev/exec", "bytes/dev/call"]
    assert lines[1].split() == ["all-reduce", "f32", "[1024]", "data", "2", "1", "4,096", "4,096"]
    assert "  data " in r.table() and r.table().rstrip().endswith("total                    4,096")


def test_psum_over_two_axes(mesh, x_8D):
    c = _only(_meter(mesh, x_8D, lambda x: lax.psum(x, ("data", "tensor"))))
    assert (c.axes, c.group_size) == (("data", "tensor"), 4)
    assert c.bytes_per_device == 2 * (3 / 4) * 4 * D


def test_all_gather_tiled_over_tensor(mesh, x_8D):
    c = _only(_meter(mesh, x_8D, lambda x: lax.all_gather(x, "tensor", tiled=True)[:D]))
    assert (c.kind, c.shape, c.axes, c.group_size) == ("all-gather", (2 * D,), ("tensor",), 2)
    assert c.bytes_per_device == (1 / 2) * (4 * 2 * D)  # buf is the gathered output


def test_reduce_scatter_over_pipeline(mesh, x_8D):
    def f(x_D):
        return jnp.tile(lax.psum_scatter(x_D, "pipeline", tiled=True), 2)

    c = _only(_meter(mesh, x_8D, f))
    assert (c.kind, c.shape, c.axes, c.group_size) == ("reduce-scatter", (D // 2,), ("pipeline",), 2)
    assert c.bytes_per_device == (2 - 1) * 4 * (D // 2)  # the input is n times the result


def _a2a(dtype):
    def f(x_D):
        x_2xH = x_D.astype(dtype).reshape(2, D // 2)
        return lax.all_to_all(x_2xH, "data", 0, 0, tiled=True).reshape(D).astype(jnp.float32)
    return f


def test_all_to_all_over_data_and_int8_is_a_quarter(mesh, x_8D):
    c32 = _only(_meter(mesh, x_8D, _a2a(jnp.float32)))
    c8 = _only(_meter(mesh, x_8D, _a2a(jnp.int8)))
    assert (c32.kind, c32.dtype, c32.axes, c32.group_size) == ("all-to-all", "f32", ("data",), 2)
    assert c32.bytes_per_device == (1 / 2) * 4 * D
    assert (c8.kind, c8.dtype, c8.axes) == ("all-to-all", "s8", ("data",))
    assert c8.bytes_per_device == (1 / 2) * D
    assert c8.bytes_per_device == c32.bytes_per_device / 4


def test_ppermute_over_pipeline(mesh, x_8D):
    c = _only(_meter(mesh, x_8D, lambda x: lax.ppermute(x, "pipeline", [(0, 1), (1, 0)])))
    assert (c.kind, c.axes, c.group_size) == ("collective-permute", ("pipeline",), 2)
    assert c.bytes_per_device == 4 * D


@pytest.mark.parametrize("loop,trips", [("fori", 5), ("scan", 7)])
def test_psum_in_loop_counts_every_trip(mesh, x_8D, loop, trips):
    def step(c_D):
        # pcast back to varying so the carry keeps the type it entered the loop with
        return lax.pcast(lax.psum(c_D, "data") * 0.5, "data", to="varying")

    def f(x_D):
        if loop == "fori":
            return lax.fori_loop(0, trips, lambda i, c: step(c), x_D)
        return lax.scan(lambda c, _: (step(c), None), x_D, None, length=trips)[0]

    smap = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=ALL, out_specs=ALL, check_vma=True))
    compiled = smap.lower(x_8D).compile()
    assert " while(" in compiled.as_text()  # the loop survived compilation, not unrolled
    r = wire.measure_compiled(compiled, mesh)
    c = _only(r)
    assert c.count == trips and not c.caveat
    assert r.total() == trips * 4096.0


@pytest.fixture(scope="module")
def mesh4():
    """A pipeline of 4 stages, for selectors with more than two outcomes."""
    return _mesh((1, 2, 4))


@pytest.fixture(scope="module")
def x4_8D(mesh4):
    return _slices(mesh4)


# two branches that cannot be merged: an s32[256] psum (1,024 bytes on a tensor pair) and
# an f32[512] psum (2,048 bytes); the third only computes
BYTES_A, BYTES_B = 2 * (1 / 2) * 4 * 256, 2 * (1 / 2) * 4 * 512


def _branch_a(c_D):
    return c_D + jnp.tile(lax.psum(c_D[:256].astype(jnp.int32), "tensor").astype(jnp.float32), 4)


def _branch_b(c_D):
    return c_D + jnp.tile(lax.psum(c_D[:512] * 2.0, "tensor"), 2)


def _branch_c(c_D):
    return c_D * 3.0


T = 3


@pytest.mark.parametrize("case,frac_a,frac_b", [
    ("eq", 4 / 8, 4 / 8),  # pipeline stage 0 takes a
    ("or", 6 / 8, 2 / 8),  # stage 0 or data row 1: 4 + 4 - 2 devices take a
    ("or_hoisted", 6 / 8, 2 / 8),  # the same, computed before the loop: a loop-invariant element
    ("switch", 2 / 4, 1 / 4),  # 4 stages: stages 0 and 1 (clamped) take a, 2 takes b, 3 takes c
])
def test_cond_on_pipeline_stage_charges_each_branch_its_devices(mesh, x_8D, mesh4, x4_8D,
                                                                 case, frac_a, frac_b):
    def f(x_D):
        def pred():
            if case == "eq":
                return lax.axis_index("pipeline") == 0
            return (lax.axis_index("pipeline") == 0) | (lax.axis_index("data") == 1)

        hoisted = pred() if case == "or_hoisted" else None
        stage = lax.axis_index("pipeline")

        def step(c_D, _):
            if case == "switch":
                return lax.switch(stage - 1, [_branch_a, _branch_b, _branch_c], c_D), None
            return lax.cond(pred() if hoisted is None else hoisted, _branch_a, _branch_b, c_D), None

        return lax.scan(step, x_D, None, length=T)[0]

    m, x = (mesh4, x4_8D) if case == "switch" else (mesh, x_8D)
    smap = jax.jit(jax.shard_map(f, mesh=m, in_specs=ALL, out_specs=ALL, check_vma=True))
    compiled = smap.lower(x).compile()
    text = compiled.as_text()
    assert " while(" in text and " conditional(" in text
    if case in ("or_hoisted", "switch"):  # the selector is read from the loop state
        assert " conditional(%get-tuple-element" in text
    r = wire.measure_compiled(compiled, m)
    assert not r.notes and not any(c.caveat for c in r.collectives), r.table()
    shares = sorted((c.dtype, c.count, c.share) for c in r.collectives)
    assert shares == [("f32", T, frac_b), ("s32", T, frac_a)], r.table()
    assert r.by_axis() == {"tensor": T * (frac_a * BYTES_A + frac_b * BYTES_B)}


def test_data_dependent_cond_is_counted_as_always_running(mesh, x_8D):
    r = _meter(mesh, x_8D, lambda x: lax.cond(x.sum() > 0, _branch_a, _branch_b, x))
    assert sorted((c.dtype, c.count, c.share) for c in r.collectives) == [("f32", 1, 1.0), ("s32", 1, 1.0)]
    assert all("in a branch of conditional" in c.caveat for c in r.collectives)
    assert len(r.notes) == 1 and "counted as if it always runs" in r.notes[0]
    assert r.by_axis() == {"tensor": BYTES_A + BYTES_B}


def test_ppermute_with_partial_pairs_charges_its_senders(mesh, x_8D):
    r = _meter(mesh, x_8D, lambda x: lax.ppermute(x, "pipeline", [(0, 1)]))
    c = _only(r)
    assert (c.axes, c.bytes_per_device, c.share) == (("pipeline",), 4 * D, 4 / 8)  # stage 0 sends
    assert r.by_axis() == {"pipeline": 4 / 8 * 4 * D}


def test_disjoint_ppermutes_add_up_to_the_whole_shift(mesh4, x4_8D):
    def split(x_D):  # one shift 0->1->2->3 in two parts, as when only some stages compress
        return (lax.ppermute(x_D, "pipeline", [(0, 1)])
                + lax.ppermute(x_D * 2, "pipeline", [(1, 2), (2, 3)]))

    def whole(x_D):
        return lax.ppermute(x_D, "pipeline", [(0, 1), (1, 2), (2, 3)])

    r_split, r_whole = _meter(mesh4, x4_8D, split), _meter(mesh4, x4_8D, whole)
    assert sorted(c.share for c in r_split.collectives) == [1 / 4, 2 / 4]
    assert _only(r_whole).share == 3 / 4
    assert r_split.by_axis() == r_whole.by_axis() == {"pipeline": 3 / 4 * 4 * D}


def test_bf16_psum_widening_is_noted(mesh, x_8D):
    r = _meter(mesh, x_8D, lambda x: lax.psum(x.astype(jnp.bfloat16), "data").astype(jnp.float32))
    c = _only(r)
    platform = mesh.devices.flat[0].platform
    assert platform == "cpu"  # the widening is a property of XLA's CPU backend
    assert c.dtype == "f32" and c.bytes_per_device == 4 * D  # what is really sent
    assert len(r.notes) == 1
    assert "widened 1 bf16 all-reduce(s) to f32" in r.notes[0] and "(cpu)" in r.notes[0]
    assert r.notes[0] in r.table()


@pytest.mark.parametrize("kind,op", [
    ("all-gather", lambda x: lax.all_gather(x, "data", tiled=True)[:D]),
    ("collective-permute", lambda x: lax.ppermute(x, "pipeline", [(0, 1), (1, 0)])),
    ("all-to-all", lambda x: lax.all_to_all(x.reshape(2, D // 2), "data", 0, 0, tiled=True)
     .reshape(D)),
    ("reduce-scatter", lambda x: jnp.tile(lax.psum_scatter(x, "tensor", tiled=True), 2)),
])
def test_bf16_widening_is_noted_for_every_collective_kind(mesh, x_8D, kind, op):
    r = _meter(mesh, x_8D, lambda x: op(x.astype(jnp.bfloat16)).astype(jnp.float32))
    c = _only(r)
    assert c.kind == kind and c.dtype == "f32", r.table()  # bf16 in, f32 on the wire
    assert r.notes == [f"XLA widened 1 bf16 {kind}(s) to f32 on this backend (cpu): "
                       "the compiled program sends f32"]


def test_bf16_that_stays_bf16_is_not_noted(mesh, x_8D):
    # integers ride through the meter unwidened; only a bf16 -> f32 change is a note
    r = _meter(mesh, x_8D, lambda x: lax.all_gather(x.astype(jnp.int8), "data", tiled=True)[:D]
               .astype(jnp.float32))
    assert _only(r).dtype == "s8" and not r.notes


@pytest.mark.parametrize("spec,axes", [
    (P("tensor"), [("tensor",)]),
    (P(("data", "pipeline")), [("data", "pipeline")]),
    (P("tensor", "data"), [("data",), ("tensor",)]),
])
def test_partitioner_collectives_in_mesh_form(mesh, spec, axes):
    """A plain jitted sum of a sharded array: XLA writes its groups in the mesh form."""
    x_8x64 = jax.device_put(jnp.ones((8, 64), jnp.float32), NamedSharding(mesh, spec))
    compiled = jax.jit(lambda a: (a * a).sum()).lower(x_8x64).compile()
    assert "replica_groups=mesh[" in compiled.as_text()  # the form this test is about
    r = wire.measure_compiled(compiled, mesh)
    assert sorted(c.axes for c in r.collectives) == axes
    for c in r.collectives:
        n = np.prod([dict(zip(AXES, (2, 2, 2)))[a] for a in c.axes])
        assert (c.kind, c.shape, c.group_size, c.bytes_per_device) == ("all-reduce", (), n, 2 * (n - 1) / n * 4)


def test_unjitted_function_is_jitted(mesh, x_8D):
    f = lambda x: lax.psum(x, "tensor")  # noqa: E731
    assert _meter(mesh, x_8D, f, jit=False).collectives == _meter(mesh, x_8D, f).collectives


def test_measure_rejects_non_mesh(x_8D):
    with pytest.raises(TypeError, match="mesh"):
        wire.measure(jax.jit(lambda x: x), x_8D, mesh=(2, 2, 2))


# ---------------------------------------------------------------- hand-written HLO

MESH = {"data": 2, "tensor": 2, "pipeline": 2}


def _module(body: str, extra: str = "") -> str:
    return f"HloModule m, num_partitions=8\n\n{extra}\nENTRY %main (p: f32[64]) -> f32[64] {{\n{body}\n}}\n"


def test_iota_groups_in_an_instruction_name_their_axes():
    line = ("  ROOT %ar = f32[64]{0} all-reduce(%p), channel_id=1, "
            "replica_groups=[2,4]<=[2,2,2]T(2,1,0), use_global_device_ids=true, to_apply=%add")
    c = _only(wire.WireReport(wire.parse_collectives(_module(line), MESH)))
    # groups {0,4,2,6}: devices differ in 'data' (id bit 4) and 'tensor' (id bit 2)
    assert (c.axes, c.group_size, c.bytes_per_device) == (("data", "tensor"), 4, 2 * 3 / 4 * 256)


def test_unreadable_groups_raise_quoting_the_line():
    line = "  ROOT %ar.7 = f32[64]{0} all-reduce(%p), replica_groups=mesh['axis_0'=8] {'axis_0':(1)2}"
    with pytest.raises(ValueError, match=r"ar\.7 = f32\[64\]"):
        wire.parse_collectives(_module(line), MESH)


ASYNC = """
%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

%wrapped_rs (q: f32[64]) -> f32[16] {
  %q = f32[64]{0} parameter(0)
  ROOT %rs = f32[16]{0} reduce-scatter(%q), replica_groups=[2,4]<=[8], dimensions={0}, to_apply=%add
}
"""


def test_async_starts_count_once_and_dones_are_ignored():
    body = "\n".join([
        "  %p = f32[64]{0} parameter(0)",
        "  %ars = f32[64]{0} all-reduce-start(%p), replica_groups={{0,1},{2,3},{4,5},{6,7}}, to_apply=%add",
        "  %ard = f32[64]{0} all-reduce-done(%ars)",
        "  %ags = (f32[64]{0}, f32[128]{0}) all-gather-start(%p), replica_groups={{0,2},{1,3},{4,6},{5,7}}, dimensions={0}",
        "  %agd = f32[128]{0} all-gather-done(%ags)",
        "  %cps = (f32[64]{0}, f32[64]{0}, u32[], u32[]) collective-permute-start(%p), source_target_pairs={{0,4},{4,0}}",
        "  %cpd = f32[64]{0} collective-permute-done(%cps)",
        "  %rss = ((f32[64]{0}), f32[16]{0}) async-start(%p), calls=%wrapped_rs",
        "  %rsd = f32[16]{0} async-done(%rss), calls=%wrapped_rs",
        "  ROOT %t = (f32[64]{0}) tuple(%ard)",
    ])
    cs = {c.name: c for c in wire.parse_collectives(_module(body, ASYNC), MESH)}
    assert sorted(cs) == ["ags", "ars", "cps", "rs"]
    assert (cs["ars"].axes, cs["ars"].bytes_per_device) == (("pipeline",), 256.0)
    assert (cs["ags"].shape, cs["ags"].axes, cs["ags"].bytes_per_device) == ((128,), ("tensor",), 256.0)
    assert (cs["cps"].shape, cs["cps"].axes, cs["cps"].bytes_per_device) == ((64,), ("data",), 256.0)
    assert (cs["rs"].axes, cs["rs"].group_size, cs["rs"].bytes_per_device) == (
        ("tensor", "pipeline"), 4, 3 * 64.0)
    assert all(c.count == 1 for c in cs.values())


def test_raw_sends_are_named_in_the_notes():
    line = ('  ROOT %ar = f32[7]{0} all-reduce(%p), replica_groups={{0,1},{2,3},{4,5},{6,7}}, '
            'to_apply=%add, metadata={op_name="jit(f)/shard_map/jcomp_raw(int8)/psum"}')
    report = wire.WireReport(*wire._parse(_module(line, ASYNC), MESH, None))
    assert [n for n in report.notes if "send raw" in n and "int8" in n and "ar" in n], report.notes


def test_mixed_tuple_splits_bytes_by_dtype_and_int4_sizes():
    body = ("  %p = f32[64]{0} parameter(0)\n"
            "  %ar = (f32[64]{0}, s8[64]{0}) all-reduce(%p, %p), replica_groups={{0,1,2,3,4,5,6,7}}\n"
            "  %a2a = s4[64]{0:E(4)} all-to-all(%p), replica_groups={{0,4},{1,5},{2,6},{3,7}}\n"
            "  ROOT %wide = s4[64]{0} all-to-all(%p), replica_groups={{0,4},{1,5},{2,6},{3,7}}")
    r = wire.WireReport(wire.parse_collectives(_module(body), (2, 2, 2), AXES))
    ar, a2a, wide = r.collectives
    assert (ar.dtype, ar.shape, ar.axes, ar.group_size) == ("f32+s8", ((64,), (64,)), AXES, 8)
    assert ar.bytes_per_device == 2 * 7 / 8 * (256 + 64)
    assert a2a.bytes_per_device == 1 / 2 * 32  # 64 packed 4-bit values are 32 bytes
    assert wide.bytes_per_device == 1 / 2 * 64  # without E(4), XLA stores one per byte
    assert r.by_dtype() == {"f32": 2 * 7 / 8 * 256, "s8": 2 * 7 / 8 * 64, "s4": 16.0 + 32.0}
    assert r.total() == pytest.approx(sum(r.by_dtype().values()))


def test_permute_across_two_axes_and_on_device_permute():
    body = ("  %p = f32[64]{0} parameter(0)\n"
            "  %cp = f32[64]{0} collective-permute(%p), source_target_pairs={{0,6},{6,0}}\n"
            "  ROOT %self = f32[64]{0} collective-permute(%p), source_target_pairs={{3,3}}")
    r = wire.WireReport(wire.parse_collectives(_module(body), MESH))
    cp, self_cp = r.collectives
    assert (cp.axes, cp.group_size, cp.bytes_per_device, cp.share) == (("data", "tensor"), 4, 256.0, 2 / 8)
    assert (self_cp.axes, self_cp.share, self_cp.total_bytes) == ((), 0.0, 0.0)  # nothing leaves
    # devices 0 and 6 send 256 bytes each; averaged over the 8 devices of the mesh
    assert r.by_axis() == {"data+tensor": 2 / 8 * 256, "none": 0.0}
    lines = r.table().splitlines()
    assert lines[0].split()[6] == "share"
    assert lines[1].split() == ["collective-permute", "f32", "[64]", "data+tensor", "4", "1", "0.25",
                                "256", "64"]


def test_unmeasured_ops_are_noted():
    body = ("  %p = f32[64]{0} parameter(0)\n"
            "  %tok = token[] after-all()\n"
            "  ROOT %snd = (f32[64]{0}, u32[], token[]) send(%p, %tok), channel_id=2")
    r = wire.from_text(_module(body), _FakeMesh())
    assert r.collectives == [] and r.notes == ["1 send instruction(s) move bytes this meter does not count"]


def _ar(name, shape):
    return f"  %{name} = {shape} all-reduce(%p), replica_groups={{{{0,4}},{{1,5}},{{2,6}},{{3,7}}}}"


def test_widening_note_counts_elements_not_instructions():
    pre = _module("\n".join([_ar("a", "bf16[64]{0}"), _ar("b", "bf16[32]{0}"), _ar("c", "f32[8]{0}")]))
    combined = _module("\n".join([_ar("ab", "(bf16[64]{0}, bf16[32]{0})"), _ar("c", "f32[8]{0}")]))
    widened = _module("\n".join([_ar("ab", "f32[96]{0}"), _ar("c", "f32[8]{0}")]))
    partly = _module("\n".join([_ar("a", "bf16[64]{0}"), _ar("b", "f32[32]{0}"), _ar("c", "f32[8]{0}")]))
    # a combiner merging two bf16 all-reduces into one tuple widens nothing
    assert wire.widening_note(pre, combined, "gpu") is None
    assert wire.widening_note(pre, widened, "cpu") == (
        "XLA widened 2 bf16 all-reduce(s) to f32 on this backend (cpu): the compiled program sends f32")
    assert "widened 32 of 96 bf16 all-reduce elements" in wire.widening_note(pre, partly, "cpu")
    assert wire.widening_note(pre, pre, "cpu") is None


def _coll(name, kind, shape):
    return (f"  %{name} = {shape} {kind}(%p), replica_groups={{{{0,4}},{{1,5}},{{2,6}},{{3,7}}}}, "
            "dimensions={0}")


def test_widening_note_names_each_kind_it_saw_widened():
    pre = _module("\n".join([_ar("a", "bf16[64]{0}"), _coll("g", "all-gather", "bf16[128]{0}"),
                             _coll("t", "all-to-all", "(bf16[32]{0}, bf16[32]{0})")]))
    # all-reduce and all-gather widened; the all-to-all kept bf16
    post = _module("\n".join([_ar("a", "f32[64]{0}"), _coll("g", "all-gather", "f32[128]{0}"),
                              _coll("t", "all-to-all", "(bf16[32]{0}, bf16[32]{0})")]))
    assert wire.widening_note(pre, post, "cpu") == (
        "XLA widened 1 bf16 all-reduce(s) and 1 bf16 all-gather(s) to f32 on this backend "
        "(cpu): the compiled program sends f32")
    # one of two bf16 all-gathers widened: counted in elements, next to a whole kind
    pre2 = _module("\n".join([_ar("a", "bf16[64]{0}"), _coll("g", "all-gather", "bf16[128]{0}"),
                              _coll("h", "all-gather", "bf16[16]{0}")]))
    post2 = _module("\n".join([_ar("a", "f32[64]{0}"), _coll("g", "all-gather", "f32[128]{0}"),
                               _coll("h", "all-gather", "bf16[16]{0}")]))
    assert wire.widening_note(pre2, post2, "cpu") == (
        "XLA widened 1 bf16 all-reduce(s) and 128 of 144 bf16 all-gather elements to f32 on "
        "this backend (cpu): the compiled program sends those as f32")
    # a kind whose bf16 vanished without any f32 collective of that kind was not widened
    gone = _module("\n".join([_ar("a", "bf16[64]{0}")]))
    assert wire.widening_note(pre, gone, "cpu") is None


# ---------------------------------------------------------------- bad input

class _FakeMesh:
    """Stands in for a Mesh where only its shape and names matter."""
    devices = np.empty((2, 2, 2))
    axis_names = AXES


@pytest.mark.parametrize("shape,names,err", [
    ((2, 0, 2), None, ValueError), ("222", None, TypeError), ((), None, TypeError),
    ((2, 2, 2), ("a", "b"), ValueError), ((2, 2, 2), ("a", "a", "b"), ValueError),
    ({"data": 2, "tensor": 4}, ("tensor", "data"), ValueError),
])
def test_bad_mesh_arguments_raise(shape, names, err):
    with pytest.raises(err, match="mesh_shape|axis_names"):
        wire.parse_collectives(_module("  ROOT %p = f32[64]{0} parameter(0)"), shape, names)


def test_device_outside_mesh_raises():
    line = "  ROOT %ar = f32[64]{0} all-reduce(%p), replica_groups={{0,9}}"
    with pytest.raises(ValueError, match="outside the mesh"):
        wire.parse_collectives(_module(line), MESH)


def test_text_must_be_str_and_have_entry():
    with pytest.raises(TypeError, match="hlo_text"):
        wire.parse_collectives(b"HloModule m", MESH)
    with pytest.raises(ValueError, match="ENTRY"):
        wire.parse_collectives("%f (a: f32[]) -> f32[] {\n  ROOT %a = f32[] parameter(0)\n}\n", MESH)


class _Lowered:
    """Equinox's filter_jit stages, as they are shaped: jax's object in an
    attribute, an as_text() that takes no dialect, a Compiled without as_text."""

    def __init__(self, lowered):
        self.lowered = lowered

    def as_text(self):
        return self.lowered.as_text()

    def compile(self):
        return _Compiled(self.lowered.compile())


class _Compiled:
    def __init__(self, compiled):
        self.compiled = compiled


class _Wrapped:
    def __init__(self, jitted):
        self.jitted = jitted

    def lower(self, *args):
        return _Lowered(self.jitted.lower(*args))


def test_a_wrapper_holding_jax_stages_is_metered(mesh, x_8D):
    """eqx.filter_jit's lower() gave an object whose as_text takes no dialect and
    whose compile() has no as_text (AttributeError: 'Compiled' object has no
    attribute 'as_text'); the jax stages they hold are read instead."""
    f = jax.jit(jax.shard_map(lambda a: lax.psum(a, "data"), mesh=mesh, in_specs=ALL,
                              out_specs=ALL))
    want = wire.measure(f, x_8D, mesh=mesh).by_axis()
    assert wire.measure(_Wrapped(f), x_8D, mesh=mesh).by_axis() == want == {"data": 4096.0}
    compiled = _Wrapped(f).lower(x_8D).compile()
    assert wire.measure_compiled(compiled, mesh).by_axis() == want
    with pytest.raises(TypeError, match=r"compiled must be a jax.stages.Compiled .* \.compiled"):
        wire.measure_compiled(object(), mesh)
