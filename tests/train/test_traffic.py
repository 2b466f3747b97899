"""Tests for jcomp.train.run.traffic: the compiled step's bytes by axis and kind,
the estimate for a plan that was not compiled, and the text the trainer prints.
Reports are written by hand here; the figures of a real run are checked against
its metrics file in tests/train/test_train.py."""
import dataclasses

import jax.numpy as jnp
import pytest

from jcomp.gpt import messages
from jcomp.gpt import policy as policy_lib
from jcomp.meter import wire
from jcomp.train.run import traffic

MESH = {"data": 2, "tensor": 2, "pipeline": 2}
BASELINE = messages.plan(policy_lib.preset("baseline"), 4, MESH)
HYBRID = messages.plan(policy_lib.preset("hybrid"), 4, MESH)
D = 128  # d_model: the row a token's activations are coded in


def _c(axes, message, total, name="c"):
    return wire.Collective(kind="all-reduce", dtype="f32", shape=(4, 128, D), group_size=2,
                           axes=axes, bytes_per_device=total, count=1, name=name,
                           message=message)


def _baseline_report():
    return wire.WireReport([
        _c(("data",), "grad_reduce", 4_000_000.0),
        _c(("data",), "param_gather", 4_000_000.0),
        _c(("data",), "", 8.0),                       # the mean loss
        _c(("tensor",), "block_exit", 2_097_152.0),
        _c(("tensor",), "block_entry_grad", 2_097_152.0),
        _c(("tensor",), "", 8192.0),                  # cross-entropy's reductions
        _c(("pipeline",), "stage_send", 262_144.0),
        _c(("pipeline",), "stage_send_grad", 262_144.0),
        _c(("data", "tensor", "pipeline"), "", 7.0),  # squared gradient norms
        _c(("data", "pipeline"), "", 6.0),
    ])


# ---------------------------------------------------------------- read

def test_read_sums_by_axis_and_kind_and_keeps_the_reports_axis_totals():
    report = _baseline_report()
    t = traffic.read(report, BASELINE)
    assert not t.estimated
    assert t.cells[("data", "grad")] == 4_000_000.0 and t.cells[("data", "other")] == 8.0
    assert t.cells[("tensor", "act")] == t.cells[("tensor", "act_grad")] == 2_097_152.0
    assert t.cells[("pipeline", "act")] == 262_144.0
    by_axis = report.by_axis()
    for axis in ("data", "tensor", "pipeline"):
        assert t.row(axis) == by_axis[axis]  # what metrics.jsonl's wire_bytes_<axis> holds
    assert t.row(traffic.SEVERAL) == by_axis["data+tensor+pipeline"] + by_axis["data+pipeline"]
    assert t.total() == report.total()
    assert t.rows() == ["data", "tensor", "pipeline", traffic.SEVERAL]
    assert t.column("act") + t.column("act_grad") == 2 * 2_097_152.0 + 2 * 262_144.0


def test_a_split_data_axis_gets_a_dcn_row_with_the_slow_hops_messages():
    """Two hops: the slow hop's collectives (over 'dcn') make a row of their own,
    first, with the kinds of their messages; the estimate scales each hop by
    its own codec."""
    split = {"dcn": 2, "data": 2, "tensor": 2, "pipeline": 2}
    plan = messages.plan(policy_lib.preset("baseline").replace({"dcn.grad": "int8"}), 4, split)
    report = wire.WireReport([
        _c(("data",), "grad_reduce", 3_000_000.0), _c(("dcn",), "grad_reduce_dcn", 1_000_000.0),
        _c(("dcn",), "param_gather_dcn", 4_000_000.0), _c(("dcn", "data"), "", 8.0)])
    t = traffic.read(report, plan)
    assert t.rows() == ["dcn", "data", traffic.SEVERAL]
    assert t.cells[("dcn", "grad")] == 1_000_000.0 and t.cells[("dcn", "param")] == 4_000_000.0
    assert t.row("dcn") == report.by_axis()["dcn"]  # metrics.jsonl's wire_bytes_dcn
    raw = traffic.estimate(report, plan, messages.plan(policy_lib.preset("baseline"), 4, split),
                           D, jnp.float32)
    assert raw.cells[("dcn", "grad")] == pytest.approx(1_000_000.0 / traffic.codec_ratio(
        "int8", "flat", D, jnp.float32))
    assert raw.cells[("data", "grad")] == 3_000_000.0
    text = traffic.start_table(t, None, compressed=True, other_name="x", footnote=[])
    assert text.splitlines()[2].split()[0] == "dcn"


# ---------------------------------------------------------------- codec ratios

@pytest.mark.parametrize("codec,rows,row,ratio", [
    ("none", "independent", D, 1.0),
    ("int8", "independent", D, (D + 4) / (4 * D)),      # one block per row, one f32 scale
    ("int4:rot", "independent", D, (D // 2 + 4) / (4 * D)),
    ("int4:rot", "flat", D, (128 + 4) / 1024),          # long buffers: 256-element blocks
    ("int8", "flat", D, (256 + 4) / 1024),
    ("bf16", "independent", D, 0.5),
    ("topk:0.01", "flat", D, None),                     # 2F: value and index per kept element
])
def test_codec_ratio_is_the_codecs_bytes_over_the_raw_bytes(codec, rows, row, ratio):
    got = traffic.codec_ratio(codec, rows, row, jnp.float32)
    if ratio is None:
        assert got == pytest.approx(0.02, rel=1e-3)
    else:
        assert got == pytest.approx(ratio)


def test_codec_ratio_never_passes_the_raw_bytes_and_skips_structured_codecs():
    # A row of 1 element: an int8 code and a 4-byte scale pass its 4 raw bytes;
    # the collective sends such rows raw.
    assert traffic.codec_ratio("int8", "independent", 1, jnp.float32) == 1.0
    assert traffic.codec_ratio("int8", "independent", 2, jnp.float32) == 6 / 8
    assert traffic.codec_ratio("powersgd:rank=4", "flat", D, jnp.float32) is None


# ---------------------------------------------------------------- estimates

def test_estimate_scales_each_message_by_its_codecs_ratio_and_leaves_the_rest():
    report = _baseline_report()
    est = traffic.estimate(report, BASELINE, HYBRID, D, jnp.float32)
    assert est.estimated
    int4_rows, int8_rows = (D // 2 + 4) / (4 * D), (D + 4) / (4 * D)
    assert est.cells[("tensor", "act")] == pytest.approx(2_097_152.0 * int4_rows)
    assert est.cells[("pipeline", "act")] == pytest.approx(262_144.0 * int8_rows)
    assert est.cells[("data", "grad")] == pytest.approx(4_000_000.0 * 132 / 1024)
    assert est.cells[("data", "param")] == pytest.approx(4_000_000.0 * 260 / 1024)
    # what no message sends stays as measured
    assert est.cells[("tensor", "other")] == 8192.0
    assert est.row(traffic.SEVERAL) == 13.0


def test_estimate_there_and_back_gives_the_measured_bytes():
    report = _baseline_report()
    est = traffic.estimate(report, BASELINE, HYBRID, D, jnp.float32)
    # the step as the estimate has it: each collective scaled by its message's ratio
    ratio = {m.name: traffic.codec_ratio(m.codec if len(m.codecs) == 1 else m.codecs[0], m.rows,
                                         D, jnp.float32) for m in HYBRID.messages()}
    coded = wire.WireReport([_c(c.axes, c.message, c.total_bytes * ratio.get(c.message, 1.0))
                             for c in report.collectives])
    assert traffic.read(coded, HYBRID).cells == pytest.approx(est.cells)
    back = traffic.estimate(coded, HYBRID, BASELINE, D, jnp.float32)
    assert back.cells == pytest.approx(traffic.read(report, BASELINE).cells)


def test_estimate_averages_a_message_over_its_places():
    # int8 on the later two of four layers: half of block_exit's bytes coded
    half = messages.plan(policy_lib.preset("baseline").replace({"tensor.act": "int8"})
                         .restrict({"tensor.act": "2-3"}), 4, MESH)
    est = traffic.estimate(_baseline_report(), BASELINE, half, D, jnp.float32)
    assert est.cells[("tensor", "act")] == pytest.approx(
        2_097_152.0 * (1 + (D + 4) / (4 * D)) / 2)


def test_no_estimate_for_codecs_whose_bytes_are_not_a_ratio():
    psgd = messages.plan(policy_lib.preset("baseline").replace({"data.grad": "powersgd:rank=4"}),
                         4, MESH)
    assert traffic.estimate(_baseline_report(), BASELINE, psgd, D, jnp.float32) is None


# ---------------------------------------------------------------- text

@pytest.mark.parametrize("n,text", [(0, "0 B"), (8, "8 B"), (999.4, "999 B"), (999.6, "1.00 kB"),
                                    (34_120, "34.1 kB"), (132_608, "133 kB"),
                                    (9_787_000, "9.79 MB"), (999_999_999, "1.00 GB")])
def test_human_is_decimal_with_three_significant_digits(n, text):
    assert traffic.human(n) == text


def _table(text):
    """-> ({row name: its line}, the lines after the table)."""
    lines = text.splitlines()
    end = next(i for i, l in enumerate(lines) if l.startswith("  total"))
    return {l.split()[0]: l for l in lines[2:end + 1]}, lines[end + 1:]


def test_start_table_of_an_uncompressed_step_shows_the_hybrid_estimate():
    report = _baseline_report()
    text = traffic.start_text(report, BASELINE, n_layers=4, mesh_shape=MESH, row=D,
                              act_dtype="float32")
    lines = text.splitlines()
    assert lines[0].startswith("Bytes sent per device per step")
    assert lines[1].split() == ["axis", "grad", "param", "act", "act_grad", "other", "total",
                                "|", "hybrid", "preset*"]
    rows, foot = _table(text)
    assert list(rows) == ["data", "tensor", "pipeline", traffic.SEVERAL.split()[0], "total"]
    est = traffic.estimate(report, BASELINE, HYBRID, D, "float32")
    for axis in ("data", "tensor", "pipeline"):
        mine, theirs = rows[axis].split("|")
        assert mine.split()[-2:] == traffic.human(report.by_axis()[axis]).split()
        assert theirs.strip() == "~" + traffic.human(est.row(axis))
    ratio = est.total() / report.total()
    assert rows["total"].split("|")[1].strip() == f"~{traffic.human(est.total())} ({ratio:.2f}x)"
    assert rows["data"].split()[1:3] == ["4.00", "MB"]  # data.grad
    assert rows["data"].split()[5:7] == ["-", "-"]  # no activations over data
    foot = " ".join(l.strip() for l in foot)
    assert foot.startswith("* estimated from the message plan, not compiled")
    assert foot.endswith("To measure it: python train.py --config=configs/hybrid.py")
    assert max(len(l) for l in lines if "|" not in l) <= traffic.WIDTH


def test_start_table_of_a_compressed_step_shows_the_uncompressed_estimate():
    int8 = messages.plan(policy_lib.preset("baseline").replace({"data.grad": "int8"}), 4, MESH)
    report = _baseline_report()
    text = traffic.start_text(report, int8, n_layers=4, mesh_shape=MESH, row=D,
                              act_dtype="float32")
    assert "| uncompressed*" in text.splitlines()[1]
    total = _table(text)[0]["total"].split("|")[1].strip()
    raw = report.total() + 4_000_000.0 * (1024 / 260 - 1)
    assert total == f"~{traffic.human(raw)} ({report.total() / raw:.2f}x)"
    assert "divided by its" in text and "configs/hybrid.py" not in text


def test_start_table_of_a_powersgd_step_says_why_it_has_no_estimate():
    psgd = messages.plan(policy_lib.preset("baseline").replace({"data.grad": "powersgd:rank=4"}),
                         4, MESH)
    text = traffic.start_text(_baseline_report(), psgd, n_layers=4, mesh_shape=MESH, row=D,
                              act_dtype="float32")
    assert "|" not in text and "~" not in text
    assert " ".join(l.strip() for l in text.splitlines()[-2:]) == (
        "The uncompressed step is not estimated: a learned (ae) or low-rank (powersgd) codec "
        "sends no fixed share of the raw bytes.")


@pytest.mark.parametrize("args,text", [
    ((9_787_000.0, None, False), "9.79 MB/step sent per device"),
    ((1_560_000.0, 9_800_000.0, False), "1.56 MB/step sent per device, ~0.16x the uncompressed "
                                        "9.80 MB (estimated from the message plan)"),
    ((46_059.0, 235_000.0, True), "46.1 kB/step sent per device, 0.20x the uncompressed "
                                  "235 kB (measured)"),
])
def test_closing_names_the_bytes_and_how_the_uncompressed_ones_are_known(args, text):
    assert traffic.closing(*args) == text


def test_codecs_line_groups_the_entries_by_codec():
    assert traffic.codecs_line(HYBRID) == ("int4:rot on data.grad, tensor.act, tensor.act_grad; "
                                           "int8 on data.param, pipeline.act, pipeline.act_grad")
    assert traffic.codecs_line(BASELINE) == "none"


def test_a_message_only_one_plan_sends():
    """The autoencoder's gradient sum exists only where a learned codec does."""
    ae = messages.plan(policy_lib.preset("baseline").replace({"tensor.act": "ae:dim=8"}), 4, MESH)
    extra = {m.name for m in ae.messages()} - {m.name for m in BASELINE.messages()}
    assert extra == {"ae_grad_sum"}
    # From a step that sends it (its blocks' learned codec set aside: its bytes
    # are no ratio): the other plan's step sends none of it.
    with_sum = dataclasses.replace(ae, block_exit=BASELINE.block_exit)
    report = wire.WireReport([_c(("tensor",), "ae_grad_sum", 1000.0),
                              _c(("tensor",), "block_exit", 500.0)])
    est = traffic.estimate(report, with_sum, BASELINE, D, jnp.float32)
    assert est.cells == {("tensor", "grad"): 0.0, ("tensor", "act"): 500.0}
    # To a step that sends it: nothing measured to scale, so no estimate.
    assert traffic.estimate(_baseline_report(), BASELINE, ae, D, jnp.float32) is None
