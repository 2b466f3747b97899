"""jcomp.tune.compiled: codec costs from the kernels of a compiled coded psum."""
import json
import os

import pytest

from jcomp import tune
from jcomp.tune import compiled

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
AOT = os.path.join(ROOT, "benchmarks", "results", "aot_h100_psum64.json")
SHIPPED = os.path.join(ROOT, "configs", "profiles", "h100_8x_nvlink_400g.json")
ELEMENTS = 1 << 24  # 64 MiB of float32


def row(codec, kernels, elements=ELEMENTS, devices=8):
    return dict(op="psum", codec=codec, elements=elements, devices=devices,
                kernel_list=[[f"k{i}", op, None, io] for i, (op, io) in enumerate(kernels)])


PLAIN = row("none", [("copy", 8 * ELEMENTS), ("all-reduce-start", 8 * ELEMENTS)])
# Three codec kernels moving 2 B per operand byte beyond plain's copy; its
# collectives (smaller than plain's all-reduce) are the link's, not the codec's.
INT8 = row("int8", [("copy", 8 * ELEMENTS), ("fusion", 4 * ELEMENTS), ("fusion", 2 * ELEMENTS),
                    ("fusion", 2 * ELEMENTS), ("all-to-all-start", 2 * ELEMENTS),
                    ("all-gather-start", ELEMENTS)])


def test_codec_time_is_kernel_io_over_hbm_plus_launches_split_over_the_bytes_coded():
    cost = compiled.codec_cost(INT8, PLAIN, hbm_bytes_per_s=1e12, efficiency=0.5,
                               launch_s=1e-6)
    operand = 4 * ELEMENTS
    seconds = 8 * ELEMENTS / 5e11 + 3 * 1e-6
    assert cost.encode_s_per_byte == pytest.approx(seconds / (25 / 8 * operand))
    assert cost.decode_s_per_byte == cost.encode_s_per_byte
    # tune.predict gives the compiled psum's codec time back for that psum.
    traffic = tune.Traffic(raw_bytes=operand * 2 * 7 / 8, collectives=1, op="all-reduce", n=8)
    prof = tune.Profile(links={"x": tune.Link(0.0, 1e15)}, codecs={"int8": cost}, device="d")
    wire = prof.link("x").seconds(traffic.coded_bytes("int8"), traffic.coded_collectives("int8"))
    assert tune.predict(prof, "x", traffic, "int8", 0.0) - wire == pytest.approx(seconds)


def test_a_codec_moving_no_more_than_plain_costs_its_launches_only():
    lean = row("int4", [("fusion", 4 * ELEMENTS), ("all-to-all-start", ELEMENTS)])
    cost = compiled.codec_cost(lean, PLAIN, launch_s=2e-6)
    assert cost.s_per_byte == 0.0
    more = row("int4", [("fusion", 4 * ELEMENTS), ("fusion", 4 * ELEMENTS),
                        ("all-to-all-start", ELEMENTS)])
    assert compiled.codec_cost(more, PLAIN, launch_s=2e-6).encode_s_per_byte == pytest.approx(
        2e-6 / (25 / 8 * 4 * ELEMENTS))


def test_codec_costs_takes_every_coded_psum_of_the_largest_size():
    small_plain = row("none", [("copy", 8)], elements=256)
    costs = compiled.codec_costs([PLAIN, INT8, small_plain, row("bf16", [], elements=256),
                                  dict(op="all_gather", codec="int8")])
    assert set(costs) == {"int8"}
    assert set(compiled.codec_costs([PLAIN, INT8, small_plain, row("bf16", [], elements=256)],
                                    mib=256 * 4 / 2**20)) == {"bf16"}


@pytest.mark.parametrize("call, named", [
    (lambda: compiled.codec_cost(INT8, PLAIN, efficiency=1.5), "efficiency"),
    (lambda: compiled.codec_cost(INT8, PLAIN, efficiency=0), "efficiency"),
    (lambda: compiled.codec_cost(INT8, PLAIN, launch_s=-1), "launch_s"),
    (lambda: compiled.codec_cost(INT8, PLAIN, hbm_bytes_per_s=float("nan")), "hbm_bytes_per_s"),
    (lambda: compiled.codec_cost(INT8, INT8), "plain"),
    (lambda: compiled.codec_cost(INT8, row("none", [], elements=256)), "same elements"),
    (lambda: compiled.codec_cost({**INT8, "kernel_list": None}, PLAIN), "--kernels"),
    (lambda: compiled.codec_costs([INT8]), "plain psum"),
    (lambda: compiled.codec_costs([PLAIN, INT8], mib=3), "mib=3"),
    (lambda: compiled.codec_costs([dict(op="ppermute")]), "no psum"),
])
def test_bad_input_raises_naming_the_argument(call, named):
    with pytest.raises(ValueError, match=named):
        call()


def test_codec_costs_refuses_a_mapping_for_rows():
    with pytest.raises(TypeError, match="rows"):
        compiled.codec_costs({"rows": []})


def test_the_shipped_profile_carries_the_costs_of_the_committed_compile():
    with open(AOT) as f:
        rows = json.load(f)["rows"]
    expected = compiled.codec_costs(rows)
    shipped = tune.load(SHIPPED)
    assert set(shipped.codecs) == set(expected)
    for name, cost in expected.items():
        assert shipped.codecs[name].encode_s_per_byte == pytest.approx(cost.encode_s_per_byte)
        assert shipped.codecs[name].decode_s_per_byte == pytest.approx(cost.decode_s_per_byte)
    assert "benchmarks.aot_profile" in shipped.comment
