"""jcomp.tune.choose: the codec of least predicted time per (axis, kind), within
the allowed ladder; predictions checked against the formula written out here."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jcomp import collectives as cc
from jcomp import tune
from jcomp.meter import wire
from jcomp.meter.scope import message_scope
from jcomp.tune import CodecCost, Link, Profile, Traffic

# Bytes per float32 byte on rows of 4096 elements, counted by hand: int8 and
# int4 code blocks of 256 elements (16 per row), each with a float32 scale.
RATIO = {"none": 1.0, "bf16": 0.5, "int8": (4096 + 16 * 4) / 16384,
         "int4": (2048 + 16 * 4) / 16384, "int4:rot": (2048 + 16 * 4) / 16384,
         "int2": (1024 + 16 * 4) / 16384}
COST = {"bf16": (1e-12, 2e-12), "int8": (2e-12, 2e-12), "int4": (5e-12, 4e-12),
        "int4:rot": (4e-12, 3e-12), "int2": (3e-12, 3e-12)}
FAST, SLOW = Link(1e-5, 1e12), Link(1e-4, 1e8)


def _profile(**links):
    return Profile(links=links, codecs={c: CodecCost(*v) for c, v in COST.items()}, device="made up")


# Bytes a coded collective over 2 devices encodes and decodes per raw wire byte,
# counted by hand (wire: an all-reduce 2(n-1)/n of its buffer B = B, an
# all-gather (n-1)/n of its output = half of it): the all-reduce encodes B and
# its sum's half, and decodes the 2 chunks it sums and the 2 sums it gathers;
# the all-gather encodes its own half and decodes both.
WORK = {"all-reduce": (1.5, 2.0), "all-gather": (1.0, 2.0)}


def _expected(link, codec, raw, n, overlap=0.0, coded_n=2, op="all-reduce"):
    """Exposed link time + codec time, the model of the module doc, by hand."""
    if codec == "none":
        return (1 - overlap) * (n * link.latency_s + raw / link.bytes_per_s)
    enc, dec = COST[codec]
    e, d = WORK[op]
    return ((1 - overlap) * (coded_n * n * link.latency_s + RATIO[codec] * raw / link.bytes_per_s)
            + (enc * e + dec * d) * raw)


def test_a_fast_link_sends_raw_and_a_slow_one_the_most_compressed_allowed():
    d = tune.choose(_profile(ici=FAST, dcn=SLOW),
                    {("ici", "grad"): (64e6, 1), ("dcn", "grad"): (64e6, 1),
                     ("dcn", "act"): (8e6, 10)})
    assert d.codec("ici", "grad") == "none"
    assert d.codec("dcn", "grad") == tune.DEFAULT_LADDERS["grad"][-1] == "int4:rot"
    assert d.codec("dcn", "act") == tune.DEFAULT_LADDERS["act"][-1] == "int8"
    assert d.codec_dict("grad") == {"ici": "none", "dcn": "int4:rot"}
    assert d.codec_dict("grad", axes="dcn") == {"dcn": "int4:rot"}


def test_by_bytes_takes_the_most_compressed_codec_allowed_even_on_a_fast_link():
    msgs = {("ici", "grad"): (64e6, 1), ("ici", "act"): (8e6, 10), ("ici", "param"): (1e6, 1)}
    fast = _profile(ici=FAST)
    assert set(tune.choose(fast, msgs).codec_dict("grad").values()) == {"none"}
    most = tune.choose(fast, msgs, by="bytes")
    # int4 and int4:rot send the same bytes: the first of equals, int4, is taken.
    assert [most.codec("ici", k) for k in ("grad", "act", "param")] == [
        "int4", tune.DEFAULT_LADDERS["act"][-1], tune.DEFAULT_LADDERS["param"][-1]]
    assert tune.DEFAULT_LADDERS["grad"][-2:] == ("int4", "int4:rot")
    # Each choice keeps its predicted time, which is slower than raw here.
    assert most.seconds > most.raw_seconds
    assert tune.choose(fast, msgs, budget={"grad": "bf16"}, by="bytes").codec("ici", "grad") \
        == "bf16"
    # On rows of one element int8's and int4:rot's scales outweigh what they save:
    # the fewest bytes are bf16's, and a param ladder cut at int8 sends raw.
    short = Traffic(raw_bytes=64.0, collectives=1, row=1)
    assert tune.choose(fast, {("ici", "grad"): short}, by="bytes").codec("ici", "grad") \
        == "bf16"
    assert tune.choose(fast, {("ici", "param"): short}, budget={"param": "int8"},
                       ladder={"param": ("none", "int8")}, by="bytes").codec("ici", "param") \
        == "none"
    with pytest.raises(ValueError, match="by must be one of 'time', 'bytes'; got 'size'"):
        tune.choose(fast, msgs, by="size")


@pytest.mark.parametrize("overlap", [0.0, 0.5, 0.9])
def test_predicted_times_are_the_formula(overlap):
    raw, n = 32e6, 3
    d = tune.choose(_profile(dcn=SLOW), {("dcn", "grad"): (raw, n)}, overlap=overlap)
    (choice,) = d.choices
    weighed = dict(choice.candidates)
    assert list(weighed) == ["none", "bf16", "int8", "int4", "int4:rot"]
    for codec, seconds in weighed.items():
        assert seconds == pytest.approx(_expected(SLOW, codec, raw, n, overlap), rel=1e-12), codec
    best = min(weighed, key=weighed.get)
    assert choice.codec == best
    assert choice.seconds == pytest.approx(_expected(SLOW, best, raw, n, overlap), rel=1e-12)
    assert d.raw_seconds == pytest.approx(_expected(SLOW, "none", raw, n, overlap), rel=1e-12)
    assert d.seconds == pytest.approx(choice.seconds) and d.overlap == overlap
    assert choice.coded_bytes == pytest.approx(RATIO[best] * raw)


def test_ops_other_than_all_reduce_code_in_one_collective():
    link = Link(1e-3, 1e9)
    t = Traffic(raw_bytes=4e6, collectives=5, op="all-gather")
    d = tune.choose(_profile(data=link), {("data", "param"): t})
    for codec, seconds in d.choices[0].candidates:
        assert seconds == pytest.approx(_expected(link, codec, 4e6, 5, coded_n=1, op="all-gather"),
                                        rel=1e-12)


def test_codec_work_per_wire_byte_shrinks_with_the_devices_spanned():
    """Over n devices an all-reduce puts 2(n-1)/n of its buffer B on the wire and
    codes (1 + 1/n) B and 2 B: per wire byte (n+1)/(2(n-1)) and n/(n-1)."""
    for n, expect in ((2, (1.5, 2.0)), (4, (5 / 6, 4 / 3)), (8, (9 / 14, 8 / 7))):
        got = Traffic(raw_bytes=1.0, collectives=1, n=n).codec_work()
        assert got == pytest.approx(expect), n
    assert Traffic(1.0, 1, op="permute").codec_work() == (1.0, 1.0)
    assert Traffic(1.0, 1, op="reduce-scatter", n=4).codec_work() == pytest.approx((4 / 3, 4 / 3))
    with pytest.raises(ValueError, match="Traffic.n must be an int >= 2"):
        Traffic(1.0, 1, n=1)


def test_when_the_link_is_hidden_behind_compute_raw_wins():
    d = tune.choose(_profile(dcn=SLOW), {("dcn", "grad"): (64e6, 1)}, overlap=1.0)
    assert d.codec("dcn", "grad") == "none" and d.seconds == 0.0


def test_many_small_collectives_stay_raw_where_coding_doubles_their_latency():
    # 1 kB each on a high-latency link: bytes are nothing, latency everything.
    link = Link(1e-2, 1e8)
    d = tune.choose(_profile(tensor=link), {("tensor", "act"): (1e3 * 500, 500)})
    assert d.codec("tensor", "act") == "none"


@pytest.mark.parametrize("budget, expect", [
    ({"grad": "int8"}, "int8"), ({"grad": "bf16"}, "bf16"), ({"grad": "none"}, "none"),
    ({"grad": " INT8 "}, "int8"), ({"act": "none"}, "int4:rot"),
])
def test_the_budget_caps_the_codec_of_its_kind(budget, expect):
    d = tune.choose(_profile(dcn=SLOW), {("dcn", "grad"): (64e6, 1)}, budget=budget)
    assert d.codec("dcn", "grad") == expect
    capped = tune.ladders(budget=budget)
    assert capped["grad"][-1] == expect


def test_a_wider_ladder_allows_what_the_defaults_leave_out():
    d = tune.choose(_profile(dcn=SLOW), {("dcn", "grad"): (64e6, 1)},
                    ladder={"grad": ("none", "int8", "int4:rot", "int2")})
    assert d.codec("dcn", "grad") == "int2"
    one = tune.choose(_profile(dcn=SLOW), {("dcn", "act"): (64e6, 1)}, ladder=("none", "int8"))
    assert one.codec("dcn", "act") == "int8"


@pytest.mark.parametrize("budget, named", [
    ({"gradient": "int8"}, "budget: unknown kind 'gradient'"),
    ({"grad": "int2"}, r"budget\['grad'\]: 'int2' is not on the ladder"),
    ({"grad": "int3"}, r"budget\['grad'\]"),
    ({"grad": "powersgd:rank=2"}, r"budget\['grad'\]"),
])
def test_a_bad_budget_is_named(budget, named):
    with pytest.raises(ValueError, match=named):
        tune.choose(_profile(dcn=SLOW), {("dcn", "grad"): (1e6, 1)}, budget=budget)


@pytest.mark.parametrize("ladder, named", [
    ({"grad": ("int8", "int4:rot")}, r"ladder\['grad'\] must start at 'none'"),
    ({"grad": ("none", "int4:rot", "int8")}, "'int8' sends more bytes than 'int4:rot'"),
    ({"grad": ("none", "int8", "INT8")}, "'int8' twice"),
    ({"grad": ("none", "int9")}, r"ladder\['grad'\]\[1\]"),
    (("none", "topk:2"), r"ladder\[1\]"),
])
def test_a_bad_ladder_is_named(ladder, named):
    with pytest.raises(ValueError, match=named):
        tune.choose(_profile(dcn=SLOW), {("dcn", "grad"): (1e6, 1)}, ladder=ladder)


def test_bad_messages_and_overlap_are_named():
    prof = _profile(dcn=SLOW)
    with pytest.raises(ValueError, match="overlap"):
        tune.choose(prof, {("dcn", "grad"): (1e6, 1)}, overlap=1.5)
    with pytest.raises(ValueError, match="overlap"):
        tune.choose(prof, {("dcn", "grad"): (1e6, 1)}, overlap=math.nan)
    with pytest.raises(ValueError, match=r"Traffic.raw_bytes.*nan"):
        tune.choose(prof, {("dcn", "grad"): (math.nan, 1)})
    with pytest.raises(ValueError, match="no ladder for kind 'logits'"):
        tune.choose(prof, {("dcn", "logits"): (1e6, 1)})
    with pytest.raises(ValueError, match="no link for mesh axis 'tensor'"):
        tune.choose(prof, {("tensor", "grad"): (1e6, 1)})
    with pytest.raises(ValueError, match="(axis, kind)"):
        tune.choose(prof, {"dcn": (1e6, 1)})
    missing = Profile(links={"dcn": SLOW}, codecs={"int8": CodecCost(1e-12, 1e-12)}, device="d")
    with pytest.raises(ValueError, match="no cost for codec 'bf16'"):
        tune.choose(missing, {("dcn", "grad"): (1e6, 1)}, ladder={"grad": ("none", "bf16")})
    with pytest.raises(ValueError, match="Traffic.dtype"):
        Traffic(1e6, 1, dtype="int32")


def test_a_codec_that_saves_no_bytes_is_never_chosen():
    # bf16 on bfloat16 data sends what raw sends; however slow the link, and at
    # no codec cost, it is not a candidate.
    free = Profile(links={"dcn": SLOW}, codecs={"bf16": CodecCost(0.0, 0.0)}, device="d")
    t = Traffic(64e6, 1, dtype="bfloat16")
    d = tune.choose(free, {("dcn", "grad"): t}, ladder=("none", "bf16"))
    assert d.codec("dcn", "grad") == "none"
    assert [c for c, _ in d.choices[0].candidates] == ["none"]


def test_never_predicted_slower_than_raw():
    rng = np.random.default_rng(0)
    for _ in range(200):
        link = Link(float(10 ** rng.uniform(-6, -2)), float(10 ** rng.uniform(7, 12)))
        costs = {c: CodecCost(float(10 ** rng.uniform(-13, -9)), float(10 ** rng.uniform(-13, -9)))
                 for c in COST}
        prof = Profile(links={"x": link}, codecs=costs, device="d")
        msgs = {("x", k): (float(10 ** rng.uniform(3, 9)), float(rng.integers(1, 200)))
                for k in ("grad", "act")}
        d = tune.choose(prof, msgs, overlap=float(rng.uniform(0, 1)))
        for c in d.choices:
            assert c.seconds <= c.raw_seconds
            assert c.seconds == min(s for _, s in c.candidates)
        assert d.seconds <= d.raw_seconds


def test_the_table_names_every_choice_and_the_totals():
    d = tune.choose(_profile(ici=FAST, dcn=SLOW),
                    {("ici", "grad"): (64e6, 1), ("dcn", "grad"): (64e6, 1)})
    text = d.table()
    assert "ici" in text and "dcn" in text and "int4:rot" in text and "none" in text
    assert f"{d.seconds * 1e3:.4g} ms predicted" in text
    assert f"{d.raw_seconds * 1e3:.4g} ms raw" in text
    with pytest.raises(ValueError, match="'act'"):
        d.codec_dict("act")


def _mesh():
    return jax.make_mesh((4, 2), ("dcn", "ici"), axis_types=(AxisType.Explicit,) * 2)


def test_codec_dict_is_what_cc_psum_takes():
    """The decision's dict codes the slow axis in a real cc.psum and leaves the fast
    one raw: the compiled program sends int4 bytes over dcn only."""
    mesh = _mesh()
    d = tune.choose(_profile(ici=FAST, dcn=SLOW),
                    {("ici", "grad"): (64e6, 1), ("dcn", "grad"): (64e6, 1)})
    codec = d.codec_dict("grad")
    every = P(mesh.axis_names)
    f = jax.jit(jax.shard_map(lambda a: cc.psum(a[0], ("dcn", "ici"), codec=codec)[None],
                              mesh=mesh, in_specs=every, out_specs=every))
    x_np = np.random.default_rng(0).standard_normal((8, 16, 4096)).astype(np.float32)
    x = jax.device_put(x_np, NamedSharding(mesh, every))
    got = np.asarray(f(x))
    exact = x_np.sum(0)
    assert np.max(np.abs(got[0] - exact)) / np.max(np.abs(exact)) < 0.2  # int4's error
    assert np.max(np.abs(got[0] - exact)) > 0  # and it was coded
    raw = wire.measure(jax.jit(jax.shard_map(
        lambda a: jax.lax.psum(a[0], ("dcn", "ici"))[None], mesh=mesh, in_specs=every,
        out_specs=every)), x, mesh=mesh).by_mesh_axis()
    coded = wire.measure(f, x, mesh=mesh).by_mesh_axis()
    assert coded["dcn"] < 0.25 * raw["dcn"]


def test_messages_from_a_wire_report_give_bytes_and_collectives_per_axis_and_kind():
    mesh = _mesh()
    every = P(mesh.axis_names)
    rows, cols = 8, 1024

    def step(a):
        with message_scope("grad_reduce"):
            g = jax.lax.psum(a[0], "dcn")
        with message_scope("block_exit"):
            h = jax.lax.psum(g, "ici")
            h = jax.lax.psum(h * 2, "ici")
        return (h + jax.lax.psum(jnp.sum(a), ("dcn", "ici")))[None]  # outside any message

    f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=every, out_specs=every))
    x = jax.device_put(np.ones((8, rows, cols), np.float32), NamedSharding(mesh, every))
    report = wire.measure(f, x, mesh=mesh)
    msgs = tune.messages_from(report, {"grad_reduce": "grad", "block_exit": "act"})
    buf = rows * cols * 4
    assert set(msgs) == {("dcn", "grad"), ("ici", "act")}
    # An all-reduce over n devices moves 2(n-1)/n of its buffer per device.
    assert msgs["dcn", "grad"].raw_bytes == pytest.approx(2 * 3 / 4 * buf)
    assert msgs["dcn", "grad"].collectives == 1
    assert msgs["ici", "act"].raw_bytes == pytest.approx(2 * 2 * 1 / 2 * buf)
    assert msgs["ici", "act"].collectives == 2
    assert msgs["ici", "act"].op == "all-reduce" and msgs["ici", "act"].dtype == "float32"
    by_name = tune.messages_from(report)
    assert set(by_name) == {("dcn", "grad_reduce"), ("ici", "block_exit")}
    with pytest.raises(ValueError, match="block_exit"):
        tune.messages_from(report, {"grad_reduce": "grad"})


def test_a_default_ladders_codec_without_a_cost_is_left_out_and_named():
    # A profile probed before int4 joined the grad ladder: int4 is not weighed
    # (its cost is unknown), int4:rot still is, and the decision says so.
    old = {c: CodecCost(*v) for c, v in COST.items() if c != "int4"}
    prof = Profile(links={"dcn": SLOW}, codecs=old, device="d")
    msgs = {("dcn", "grad"): (64e6, 1), ("dcn", "act"): (8e6, 10)}
    d = tune.choose(prof, msgs, by="bytes")
    assert d.codec("dcn", "grad") == "int4:rot"
    assert "int4" not in dict(d.choices[0].candidates)
    assert d.unpriced == (("grad", "int4"),)
    assert "not weighed" in d.table() and "int4 (grad)" in d.table()
    # With the cost, int4 is weighed: by bytes it is taken (first of equals).
    full = tune.choose(_profile(dcn=SLOW), msgs, by="bytes")
    assert full.codec("dcn", "grad") == "int4" and full.unpriced == ()
    # A kind with no message names nothing; a budget at int4 cuts int4:rot.
    assert tune.choose(prof, {("dcn", "act"): (8e6, 10)}).unpriced == ()
    assert tune.choose(_profile(dcn=SLOW), msgs, budget={"grad": "int4"}).codec(
        "dcn", "grad") == "int4"
