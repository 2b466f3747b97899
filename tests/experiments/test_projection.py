"""experiments/projection.py: the alpha-beta model against hand-computed cases."""
import json
import math

import pytest

from experiments import linkprofile as link
from experiments import projection as proj
from experiments import report_projection

MESH1 = {"data": 1, "tensor": 1, "pipeline": 1}
INTRA = {"data": "intra", "tensor": "intra", "pipeline": "intra"}


def _cluster(**kw):
    base = dict(name="test", gpus_per_node=4, peak_flops=100e12, efficiency=0.5, intra_bw=10e9,
                intra_latency=5e-6, inter_bw_node=8e9, inter_latency=20e-6, codec_bw=100e9)
    return proj.Cluster(**dict(base, **kw))


def test_ring_all_reduce_of_1gb_over_4_gpus():
    t = proj.collective_time("all-reduce", 4, 1e9, 10e9, 5e-6)
    assert t == pytest.approx(2 * 3 / 4 * 1e9 / 1e10 + 6 * 5e-6, rel=1e-12)


def test_gather_scatter_and_p2p_by_hand():
    assert proj.collective_time("all-gather", 8, 8e6, 1e9, 1e-5) == pytest.approx(
        7 / 8 * 8e6 / 1e9 + 7 * 1e-5, rel=1e-12)
    assert proj.collective_time("reduce-scatter", 2, 4e6, 2e9, 3e-6) == pytest.approx(
        1 / 2 * 4e6 / 2e9 + 1 * 3e-6, rel=1e-12)
    assert proj.collective_time("p2p", 4, 1e6, 1e9, 2e-6) == pytest.approx(1e-3 + 2e-6, rel=1e-12)


def test_an_axis_of_one_gpu_costs_nothing():
    for kind in proj.COLLECTIVES:
        assert proj.collective_time(kind, 1, 1e9, 1e9, 1e-5) == 0.0


def test_inter_node_bandwidth_is_shared_by_the_gpus_of_a_node():
    c = _cluster(gpus_per_node=4, inter_bw_node=8e9)
    assert c.link("inter") == (20e-6, 2e9)
    assert c.link("intra") == (5e-6, 10e9)


def test_compute_only_step():
    """No messages: the step is FLOPs / GPUs / (peak * efficiency), times GPipe's bubble."""
    c = _cluster()
    mesh = {"data": 2, "tensor": 1, "pipeline": 4}
    t = proj.step_time(c, mesh, INTRA, [], {}, hw_flops=8e15, microbatches=4)
    expected = 8e15 / 8 / (100e12 * 0.5) * (4 + 4 - 1) / 4
    assert t["compute_s"] == pytest.approx(expected, rel=1e-12)
    assert t["total_s"] == pytest.approx(expected, rel=1e-12)
    assert t["codec_s"] == 0 and sum(t["comm_s"].values()) == 0


def test_one_compressed_all_reduce_by_hand():
    """int8-like ratio 0.254 on a bf16 model: 4 * 0.254 bytes per element on the
    wire, and the uncompressed bf16 bytes coded twice."""
    c = _cluster()
    mesh = {"data": 4, "tensor": 1, "pipeline": 1}
    msg = [dict(axis="data", kind="grad", collective="all-reduce", elements=1e8, count=3)]
    plain = proj.step_time(c, mesh, INTRA, msg, {"data": 1.0}, 0.0, 1)
    coded = proj.step_time(c, mesh, INTRA, msg, {"data": 0.254}, 0.0, 1)
    assert plain["comm_s"]["data"] == pytest.approx(3 * (6 * 5e-6 + 1.5 * 2e8 / 10e9), rel=1e-12)
    assert coded["comm_s"]["data"] == pytest.approx(
        3 * (6 * 5e-6 + 1.5 * 1e8 * 4 * 0.254 / 10e9), rel=1e-12)
    assert coded["codec_s"] == pytest.approx(3 * 2 * 2e8 / 100e9, rel=1e-12)
    assert plain["codec_s"] == 0


def test_gains_are_computed_from_times():
    assert proj.gain_pct(1.2, 1.0) == pytest.approx(20.0)
    assert proj.gain_pct(1.0, 1.25) == pytest.approx(-20.0)
    with pytest.raises(ValueError, match="step times"):
        proj.gain_pct(0.0, 1.0)


def test_neox20b_parameter_count_matches_the_published_one():
    """GPT-NeoX-20B has 20,554,567,680 parameters (its model card)."""
    shape = proj.neox20b(192)
    assert proj.param_count(shape["model"]) == pytest.approx(20_554_567_680, rel=1e-3)
    assert shape["mesh"] == {"data": 12, "tensor": 4, "pipeline": 4}


def test_step_flops_six_n_plus_attention_and_recompute():
    m = dict(d_model=4, d_ff=16, n_layers=2, vocab_size=10, tie_embeddings=True, seq_len=8)
    n = proj.param_count(m)
    model, hw = proj.step_flops(m, tokens=100, remat=True)
    assert model == (6 * n + 12 * 2 * 8 * 4) * 100
    assert hw == pytest.approx(model * 4 / 3)


def test_project_end_to_end_compression_shortens_only_communication():
    shape = proj.neox20b(192)
    ratios = {"baseline": {a: 1.0 for a in proj.AXES},
              "hybrid": {"data": 0.2, "tensor": 0.254, "pipeline": 0.254}}
    res = proj.project(proj.CLUSTERS["lassen"], shape, proj.parse_placement(None), ratios)
    b, h = res["policies"]["baseline"], res["policies"]["hybrid"]
    assert h["compute_s"] == b["compute_s"]
    for axis in proj.AXES:
        assert h["comm_s"][axis] < b["comm_s"][axis]
    assert h["gain_pct"] == pytest.approx(100 * (b["total_s"] / h["total_s"] - 1))
    assert h["tflops_per_gpu"] == pytest.approx(
        res["model_flops_per_step"] / 192 / h["total_s"] / 1e12)
    assert h["samples_per_s"] == pytest.approx(shape["batch"] / h["total_s"])
    assert h["paper"] == {"tflops_gain_pct": 17.3, "samples_gain_pct": 12.7}
    json.dumps(res, allow_nan=False)


def test_bad_inputs_name_the_argument():
    with pytest.raises(ValueError, match="Cluster.intra_bw"):
        _cluster(intra_bw=-1.0)
    with pytest.raises(ValueError, match="Cluster.efficiency"):
        _cluster(efficiency=1.5)
    with pytest.raises(ValueError, match="Cluster.peak_flops"):
        _cluster(peak_flops=math.nan)
    with pytest.raises(ValueError, match="kind"):
        proj.collective_time("broadcast", 4, 1.0, 1.0, 0.0)
    with pytest.raises(ValueError, match="bandwidth"):
        proj.collective_time("p2p", 4, 1.0, 0.0, 0.0)
    with pytest.raises(ValueError, match="--placement"):
        proj.parse_placement(["tensor=rack"])
    with pytest.raises(ValueError, match="ratio_by_axis"):
        proj.step_time(_cluster(), MESH1, INTRA,
                       [dict(axis="data", kind="grad", collective="all-reduce", elements=1,
                             count=1)], {"data": math.nan}, 0.0, 1)
    with pytest.raises(ValueError, match="--gpus"):
        proj.neox20b(100)


def test_measured_ratios_need_baseline_and_a_compressed_run(tmp_path):
    path = tmp_path / "summary.json"
    path.write_text(json.dumps({"runs": [{"name": "hybrid", "byte_ratio_by_axis": {}}]}))
    with pytest.raises(ValueError, match="baseline"):
        proj.measured_ratios(str(path))
    path.write_text(json.dumps({"runs": [
        {"name": "baseline", "byte_ratio_by_axis": {"data": 1.0, "tensor": 1.0, "pipeline": 1.0}},
        {"name": "naive", "byte_ratio_by_axis": {"data": 0.13, "tensor": None, "pipeline": 0.2}}]}))
    assert proj.measured_ratios(str(path)) == {
        "baseline": {"data": 1.0, "tensor": 1.0, "pipeline": 1.0},
        "naive": {"data": 0.13, "tensor": 1.0, "pipeline": 0.2}}


# ---------------------------------------------------------------- the throttled link

RATES = {"unthrottled": None, "1gbit": 1e9, "300mbit": 3e8, "100mbit": 1e8}


def _world(compute, kbytes, msgs, alpha):
    """network.json rows of a link that is exactly the overlapped model."""
    rows = []
    for rate, bits in RATES.items():
        for p in compute:
            t = compute[p] if bits is None else max(compute[p], kbytes[p] * 8 / bits + alpha * msgs[p])
            rows.append(dict(settings=dict(kind="sweep", rate=rate, policy=p), commit="abc",
                             median_step_s=t, kernel_bytes_per_step=kbytes[p],
                             collectives_per_step=msgs[p]))
    return rows


COMPUTE = {"baseline": 0.6, "hybrid": 0.8}
KBYTES = {"baseline": 80e6, "hybrid": 20e6}
MSGS = {"baseline": 400.0, "hybrid": 900.0}


def test_link_profile_calibrates_alpha_from_one_throttled_run_by_hand():
    prof = link.calibrate(_world(COMPUTE, KBYTES, MSGS, 1e-4), "100mbit")
    assert prof["beta_bytes_per_s"] == 12.5e6
    t_cal = 80e6 / 12.5e6 + 1e-4 * 400  # 6.44 s
    assert prof["calibration_step_s"] == pytest.approx(t_cal)
    assert prof["alpha_s"]["overlapped"] == pytest.approx(1e-4)
    # Overlap is what the additive model cannot explain: it would need a negative latency.
    assert prof["alpha_calibrated_s"]["additive"] == pytest.approx((t_cal - 0.6 - 6.4) / 400)
    assert prof["alpha_calibrated_s"]["additive"] < 0 and prof["alpha_s"]["additive"] == 0


def test_overlapped_model_predicts_its_own_world_and_additive_does_not():
    rows = _world(COMPUTE, KBYTES, MSGS, 1e-4)
    compared = link.link_report({"rows": rows})["rows"]
    assert len(compared) == 8
    for r in compared:
        assert r["ratio"]["overlapped"] == pytest.approx(1.0), r
    # At 300 Mbit/s hybrid computes for 0.8 s and its link needs 0.53 + 0.09 s: overlapped
    # 0.8 s. Additive adds the two (its latency is 0: see the calibration test).
    one = next(r for r in compared if (r["rate"], r["policy"]) == ("300mbit", "hybrid"))
    assert one["predicted_s"]["additive"] == pytest.approx(0.8 + 20e6 * 8 / 3e8)
    assert one["ratio"]["additive"] > 1.15 and one["role"] == "predicted"
    assert {r["role"] for r in compared if r["rate"] == "unthrottled"} == {"compute"}


def test_a_row_is_the_median_of_its_repeated_runs():
    """Repeated runs of one rate and policy count once, as the median of their step
    times and kernel bytes; a slow outlier run moves neither."""
    rows = _world(COMPUTE, KBYTES, MSGS, 1e-4)
    repeated = []
    for r in rows:
        for i, (slow, extra) in enumerate(((1.0, 0.0), (1.5, 2e6), (0.98, -1e6))):
            repeated.append(dict(r, settings=dict(r["settings"], repeat=i), meter_bytes_per_step=1e6,
                                 median_step_s=r["median_step_s"] * slow,
                                 kernel_bytes_per_step=r["kernel_bytes_per_step"] + extra))
    combined = link.sweep_rows({"rows": repeated})
    assert len(combined) == len(rows)
    by = {(r["settings"]["rate"], r["settings"]["policy"]): r for r in combined}
    for r in rows:
        c = by[r["settings"]["rate"], r["settings"]["policy"]]
        assert "repeat" not in c["settings"] and c["repeats"] == 3
        assert c["median_step_s"] == pytest.approx(r["median_step_s"])
        assert c["repeat_step_s"] == pytest.approx([r["median_step_s"] * f for f in (1.0, 1.5, 0.98)])
        assert c["kernel_bytes_per_step"] == r["kernel_bytes_per_step"]
        assert c["kernel_over_meter"] == pytest.approx(r["kernel_bytes_per_step"] / 1e6)
    compared = link.link_report({"rows": repeated})["rows"]
    assert all(x["ratio"]["overlapped"] == pytest.approx(1.0) for x in compared)


def test_crossover_measured_and_predicted_by_hand():
    rows = _world(COMPUTE, KBYTES, MSGS, 1e-4)
    prof = link.calibrate(rows, "100mbit")
    # hybrid 0.8 s up to where 20e6*8/R + 0.09 = 0.8, i.e. R = 225 Mbit/s; the baseline's
    # link time 80e6*8/R + 0.04 equals 0.8 at R = 842 Mbit/s: hybrid wins below that.
    assert link.measured_crossover(rows, "hybrid") == dict(
        beats_baseline_up_to="300mbit", loses_from="1gbit", consistent=True)
    bits = link.predicted_crossover(prof, "hybrid", "overlapped")
    assert bits == pytest.approx(80e6 * 8 / (0.8 - 0.04), rel=1e-6)
    assert link.human_rate(bits) == "842 Mbit/s"
    assert link.human_rate(None) == "never" and link.human_rate(math.inf) == "unthrottled"


def test_link_report_needs_the_baseline_rows():
    rows = [r for r in _world(COMPUTE, KBYTES, MSGS, 1e-4) if r["settings"]["policy"] != "baseline"]
    with pytest.raises(ValueError, match="baseline"):
        link.link_report({"rows": rows})
    with pytest.raises(ValueError, match="throttled"):
        link.calibrate(_world(COMPUTE, KBYTES, MSGS, 1e-4), "unthrottled")
    json.dumps(link.link_report({"rows": _world(COMPUTE, KBYTES, MSGS, 1e-4)}), allow_nan=False)


def test_report_states_the_projection_with_communication_hidden_behind_compute():
    def row(compute, comm, codec):
        total = compute + comm + codec
        return dict(total_s=total, compute_s=compute, codec_s=codec, gain_pct=0.0,
                    comm_s={"data": comm, "tensor": 0.0, "pipeline": 0.0})
    res = {"paper": proj.PAPER, "clusters": {"c": {"policies": {
        "baseline": row(10.0, 2.0, 0.0), "naive": row(10.0, 0.5, 0.5),
        "hybrid": row(10.0, 1.0, 0.25)}}}}
    text = "\n".join(report_projection.projection_claims(res))
    # Hidden: every step is max(10, comm) + codec: 10, 10.5 and 10.25 s.
    assert f"naive {100 * (10 / 10.5 - 1):+.1f}%, hybrid {100 * (10 / 10.25 - 1):+.1f}%" in text
