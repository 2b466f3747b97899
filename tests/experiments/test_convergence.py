"""experiments/convergence.py and experiments/report.py: a --quick run end to end,
the reuse of finished runs, and the bookkeeping of gaps, byte ratios and claims."""
import json
import math
import os
import pathlib
import subprocess
import sys

import pytest

from experiments import convergence as conv
from experiments import convergence_specs as conv_specs
from experiments import convergence_summary as conv_sum
from experiments import report_convergence
from experiments import report_format
from experiments import report_projection
from experiments import report_seeds
from experiments import seeds as seeds_lib

ROOT = pathlib.Path(__file__).resolve().parents[2]
AXES = ("data", "tensor", "pipeline")
# LLVM optimization level 0 cuts compile time; it acts after the HLO passes, so the
# collectives, and the bytes read from them, are those of the optimized program.
QUICK_ENV = dict(os.environ, JAX_PLATFORMS="cpu",
                 XLA_FLAGS="--xla_force_host_platform_device_count=8 "
                           "--xla_backend_optimization_level=0")


def _run(module, *args):
    return subprocess.run([sys.executable, "-m", f"experiments.{module}", *map(str, args)],
                          cwd=ROOT, env=QUICK_ENV, capture_output=True, text=True, timeout=900)


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    """(results dir, summary, convergence stdout, page text) of --quick + projection + report."""
    results = tmp_path_factory.mktemp("results")
    out = results / "convergence"
    proc = _run("convergence", "--quick", "--out", out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    p = _run("projection", "--measured", out / "summary.json", "--json",
             results / "projection.json")
    assert p.returncode == 0, p.stderr[-3000:]
    page = results / "RESULTS.md"
    r = _run("report", "--results", results, "--out", page)
    assert r.returncode == 0, r.stderr[-3000:]
    return results, summary, proc.stdout, page.read_text()


@pytest.mark.e2e
def test_quick_summary_has_every_field(quick):
    _, summary, _, _ = quick
    runs = {r["name"]: r for r in summary["runs"]}
    assert set(runs) == {"baseline", "hybrid"}
    assert summary["steps"] == 4 and summary["quick"] is True
    assert summary["mesh"] == {"data": 2, "tensor": 2, "pipeline": 2, "dcn_data": 1}
    for r in runs.values():
        assert r["steps"] == 4
        assert math.isfinite(r["final_val_loss"]) and r["best_val_loss"] <= r["final_val_loss"]
        assert set(r["wire_bytes"]) == set(AXES)
        assert all(r["wire_bytes"][a] > 0 for a in AXES)  # every axis of (2,2,2) carries traffic
        assert r["wire_bytes_total"] >= sum(r["wire_bytes"].values())
        assert os.path.exists(ROOT / r["workdir"] / "metrics.jsonl")
        assert not os.path.exists(ROOT / r["workdir"] / "checkpoints")  # deleted once finished
    base, hyb = runs["baseline"], runs["hybrid"]
    assert base["gap_pct"] == 0.0 and base["byte_ratio"] == 1.0
    assert hyb["gap_pct"] == pytest.approx(
        100 * (hyb["final_val_loss"] - base["final_val_loss"]) / base["final_val_loss"])
    assert hyb["byte_ratio"] == pytest.approx(hyb["wire_bytes_total"] / base["wire_bytes_total"])
    # int4/int8 codes with float32 block scales: well under half the float32 bytes
    assert hyb["byte_ratio"] < 0.5
    for a in AXES:
        assert hyb["byte_ratio_by_axis"][a] < 0.5


@pytest.mark.e2e
def test_same_initial_weights_and_data(quick):
    """Runs differ only in compression: their first-step losses agree to the
    float32 noise of the compressed step (the first loss is computed before any
    compressed gradient is applied; only compressed activations change it)."""
    results, summary, _, _ = quick
    first = {}
    for r in summary["runs"]:
        with open(ROOT / r["workdir"] / "metrics.jsonl") as f:
            first[r["name"]] = json.loads(f.readline())["loss"]
    # Seen 2e-5 apart; another seed's initial weights move the loss at init by
    # about 3e-3 relative, so 5e-4 tells the two apart.
    assert first["hybrid"] == pytest.approx(first["baseline"], rel=5e-4)


@pytest.mark.e2e
def test_quick_plot_and_report_tables(quick):
    results, summary, _, page = quick
    assert summary["plots"] == {"main": "main_loss.png"}
    png = results / "convergence" / "main_loss.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| run | compressed | final val_loss |" in page
    assert "| baseline |" in page and "| hybrid |" in page
    assert "(convergence/main_loss.png)" in page
    assert "## Projection to GPT-NeoX-20B" in page and "#### lassen" in page
    assert "## What matches the papers, what doesn't, and why" in page
    assert "--quick smoke run" in page
    hyb = next(r for r in summary["runs"] if r["name"] == "hybrid")
    verdict = "PASS" if hyb["gap_pct"] <= 1.0 else "FAIL"
    assert f"{hyb['gap_pct']:+.2f}% from the baseline's" in page
    assert f"{verdict} against the 1% loss target" in page
    assert "python -m experiments.convergence --quick" in page


@pytest.mark.e2e
def test_finished_runs_are_reused(quick):
    results, _, _, _ = quick
    out = results / "convergence"
    metrics = out / "hybrid-4steps" / "metrics.jsonl"
    before = metrics.read_text()
    proc = _run("convergence", "--quick", "--out", out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "baseline-4steps: finished already, skipped" in proc.stdout
    assert "hybrid-4steps: finished already, skipped" in proc.stdout
    assert metrics.read_text() == before


# ---------------------------------------------------------------- bookkeeping

def _records(val, wire_total=100.0):
    recs = [{"step": 1, "loss": 5.0, "step_time_s": 0.5, "wire_bytes_total": wire_total,
             "wire_bytes_data": wire_total / 2, "wire_bytes_tensor": wire_total / 2}]
    recs += [{"step": s, "loss": v + 0.1, "val_loss": v, "step_time_s": 0.1} for s, v in val]
    return recs


def test_summarize_takes_final_best_and_first_wire_record():
    s = conv_sum.summarize(_records([(2, 3.0), (4, 2.5), (6, 2.7)]))
    assert s["final_val_loss"] == 2.7 and s["best_val_loss"] == 2.5 and s["steps"] == 6
    assert s["wire_bytes"] == {"data": 50.0, "tensor": 50.0, "pipeline": 0.0}
    assert s["wire_bytes_total"] == 100.0


def test_summarize_keeps_the_last_record_of_a_repeated_step():
    recs = _records([(2, 3.0), (4, 2.5)]) + [{"step": 4, "loss": 2.0, "val_loss": 2.4}]
    assert conv_sum.summarize(recs)["final_val_loss"] == 2.4


def test_nan_loss_stays_nan():
    s = conv_sum.summarize(_records([(2, 3.0), (4, math.nan)]))
    assert math.isnan(s["final_val_loss"])
    assert math.isnan(conv_sum.gap_pct(s["final_val_loss"], 3.0))


def test_comparisons_against_baseline():
    runs = [dict(name="baseline", final_val_loss=2.0, best_val_loss=2.0, wire_bytes_total=400.0,
                 wire_bytes={"data": 200.0, "tensor": 200.0, "pipeline": 0.0}),
            dict(name="x", final_val_loss=2.02, best_val_loss=1.9, wire_bytes_total=100.0,
                 wire_bytes={"data": 20.0, "tensor": 80.0, "pipeline": 0.0})]
    conv_sum.add_comparisons(runs)
    assert runs[1]["gap_pct"] == pytest.approx(1.0)
    assert runs[1]["best_gap_pct"] == pytest.approx(-5.0)
    assert runs[1]["byte_ratio"] == 0.25
    assert runs[1]["byte_ratio_by_axis"] == {"data": 0.1, "tensor": 0.4, "pipeline": None}
    with pytest.raises(ValueError, match="baseline"):
        conv_sum.add_comparisons(runs[1:])


def test_suites_and_bad_arguments():
    names = lambda suite: [s["name"] for s in conv_specs.select(suite)]
    assert names("main") == ["baseline", "naive", "hybrid", "hybrid_paper"]
    assert sorted(names("seeds")) == sorted(conv_specs.SEED_RUNS)
    assert names("ablation") == ["baseline", "only_data", "only_tensor", "only_pipeline"]
    sweep = names("sweep")
    # baseline, 6 gradient codecs x EF on/off, PowerSGD, 3 activation codecs, the autoencoder
    assert len(sweep) == 1 + 12 + 1 + 3 + 1 and "grad_topk0p01_efoff" in sweep
    assert "grad_int4rot_efoff" in sweep
    assert {"act_int2", "grad_powersgd_r4", "act_ae32"} <= set(sweep)
    assert names("variants")[0] == "baseline" and "hybrid_grad_int8_tensor_ag_int4" in names(
        "variants")
    assert names("places") == ["baseline", "tensor_int2", "tensor_int2_layers_0-1",
                               "tensor_int2_layers_2-3", "pipeline_int2",
                               "pipeline_int2_stages_0", "pipeline_int2_stages_1"]
    late = next(s for s in conv_specs.run_specs() if s["name"] == "tensor_int2_layers_2-3")
    assert {"--config.compression.tensor.act=int2", "--config.compression.layers.tensor.act=2-3",
            "--config.compression.layers.tensor.act_grad=2-3"} <= set(
        conv_specs.train_args(late, "configs/base.py", 100, 20, 10))
    ae = next(s for s in conv_specs.run_specs() if s["name"] == "act_ae32")
    assert "--config.compression.tensor.act_grad=ae:dim=32" in conv_specs.train_args(
        ae, "configs/base.py", 100, 20, 10)
    spec = next(s for s in conv_specs.run_specs() if s["name"] == "grad_int2_efoff")
    args = conv_specs.train_args(spec, "configs/base.py", 100, 20, 10)
    assert "--config.compression.data.grad=int2" in args
    assert "--config.compression.error_feedback=off" in args
    assert "--config.seed=3" in conv_specs.train_args(spec, "configs/base.py", 100, 20, 10, seed=3)
    assert conv_specs.workdir_name(spec, 600) == "grad_int2_efoff-600steps"
    assert conv_specs.workdir_name(spec, 600, 2) == "grad_int2_efoff-600steps-seed2"
    # The paper's recipe keeps its meaning whatever the hybrid preset becomes.
    paper = next(s for s in conv_specs.run_specs() if s["name"] == "hybrid_paper")
    assert paper["policy"] == "baseline" and paper["overrides"]["data.grad"] == "int4"
    with pytest.raises(ValueError, match="--seeds"):
        conv.parse_args(["--seeds", "1", "1"])
    with pytest.raises(ValueError, match="suite"):
        conv_specs.select("everything")
    with pytest.raises(ValueError, match="--only"):
        conv_specs.select("main", ["nope"])
    with pytest.raises(ValueError, match="--warmup"):
        conv.parse_args(["--steps", "10", "--warmup", "10"])


def test_the_hops_suite_codes_the_same_data_messages_on_one_hop_or_the_whole_axis():
    specs = {s["name"]: s for s in conv_specs.select("hops")}
    assert list(specs) == ["baseline", "hop_flat", "hop_perhop", "hop_auto100mbit",
                           "hop_auto_param8", "hop_auto_act8", "hop_auto_act8_param8",
                           "hop_flat_act8", "hop_perhop_fewest"]
    flat = conv_specs.train_args(specs["hop_flat"], "configs/base.py", 600, 120, 60)
    perhop = conv_specs.train_args(specs["hop_perhop"], "configs/base.py", 600, 120, 60)
    assert {"--config.compression.data.grad=int4:rot",
            "--config.compression.data.param=int8"} <= set(flat)
    assert {"--config.compression.dcn.grad=int4:rot", "--config.compression.dcn.param=int8",
            "--config.mesh.dcn_data=2"} <= set(perhop)
    assert not any(a.startswith("--config.compression.data.") for a in perhop)
    auto = conv_specs.train_args(specs["hop_auto100mbit"], "configs/base.py", 600, 120, 60)
    assert {"--config.compression.data.grad=int8", "--config.compression.data.param=int8",
            "--config.compression.dcn.grad=int4:rot", "--config.compression.dcn.param=int8",
            "--config.mesh.dcn_data=2"} <= set(auto)
    param8 = conv_specs.train_args(specs["hop_auto_param8"], "configs/base.py", 600, 120, 60)
    act8 = conv_specs.train_args(specs["hop_auto_act8"], "configs/base.py", 600, 120, 60)
    across = {"--config.compression.dcn.grad=int4:rot", "--config.compression.dcn.param=int8",
              "--config.mesh.dcn_data=2"}
    assert across | {"--config.compression.data.param=int8"} <= set(param8)
    assert not any(a.startswith("--config.compression.data.grad") for a in param8)
    assert across | {"--config.compression.tensor.act=int8",
                     "--config.compression.tensor.act_grad=int8"} <= set(act8)
    assert not any(a.startswith("--config.compression.data.") for a in act8)
    both = conv_specs.train_args(specs["hop_auto_act8_param8"], "configs/base.py", 600, 120, 60)
    assert set(act8) | set(param8) <= set(both)  # both sets of codecs at once
    assert not any(a.startswith("--config.compression.data.grad") for a in both)
    # Each route at the default budget's most compressed codecs.
    flat8 = conv_specs.train_args(specs["hop_flat_act8"], "configs/base.py", 600, 120, 60)
    fewest = conv_specs.train_args(specs["hop_perhop_fewest"], "configs/base.py", 600, 120, 60)
    tensor8 = {"--config.compression.tensor.act=int8", "--config.compression.tensor.act_grad=int8"}
    assert set(flat) | tensor8 <= set(flat8) and "--config.mesh.dcn_data=2" not in flat8
    assert set(flat) | tensor8 | across <= set(fewest)


def test_set_overrides_typed_config_fields_and_names_a_bad_one():
    cfg = conv.load_config("configs/base.py")
    conv.apply_sets(cfg, [("mesh.data", "4"), ("optim.lr", "0.01"), ("train.remat", "true")])
    assert (cfg.mesh.data, cfg.optim.lr, cfg.train.remat) == (4, 0.01, True)
    with pytest.raises(ValueError, match="--set mesh.dat: no such config field"):
        conv.apply_sets(cfg, [("mesh.dat", "4")])
    with pytest.raises(ValueError, match="--set mesh.data=four: must be of type int"):
        conv.apply_sets(cfg, [("mesh.data", "four")])
    args = conv.parse_args(["--set", "mesh.data=4", "--set", "mesh.pipeline=1"])
    assert args.set == [("mesh.data", "4"), ("mesh.pipeline", "1")]
    with pytest.raises(SystemExit):
        conv.parse_args(["--set", "mesh.data"])


def test_a_run_stuck_in_a_collective_resumes_once_and_says_so(tmp_path, monkeypatch):
    """XLA's CPU runtime ends a run whose devices wait in collectives that never
    complete; the runner resumes it once and records it. Any other failure, or a
    second stuck attempt, ends the suite."""
    workdir = str(tmp_path / "perhop-600steps")
    calls = []

    def fake_call(cmd, cwd, stdout, stderr, outcomes):
        calls.append(cmd)
        os.makedirs(workdir, exist_ok=True)
        with open(os.path.join(workdir, "metrics.jsonl"), "a") as f:
            f.write(json.dumps({"step": 10 * len(calls)}) + "\n")
        rc, text = outcomes[len(calls) - 1]
        stdout.write(text)
        return rc

    stuck = (-6, "F1204 rendezvous.cc:161] Termination timeout for `all to all ...` of 40 s\n")
    monkeypatch.setattr(conv.subprocess, "call",
                        lambda *a, **k: fake_call(*a, **k, outcomes=[stuck, (0, "ok\n")]))
    log = open(tmp_path / "suite.log", "w")
    conv.run_one({}, workdir, ["--config=configs/tiny.py"], log)
    assert len(calls) == 2 and calls[0] == calls[1]
    assert json.load(open(os.path.join(workdir, conv.RESTARTS_FILE))) == [
        {"stuck_after_step": 10, "log": "stuck1.log"}]
    assert "Termination timeout" in open(os.path.join(workdir, "stuck1.log")).read()
    assert open(workdir + ".log").read() == "ok\n"

    for outcomes in ([(1, "Traceback: ValueError\n")], [stuck, stuck]):
        calls.clear()
        monkeypatch.setattr(conv.subprocess, "call",
                            lambda *a, outcomes=outcomes, **k: fake_call(*a, **k, outcomes=outcomes))
        with pytest.raises(RuntimeError, match="failed"):
            conv.run_one({}, workdir, [], log)
        assert len(calls) == len(outcomes)


def test_closest_bytes_pair_and_claims():
    def run(name, gap, ratio):
        return dict(name=name, gap_pct=gap, byte_ratio=ratio, wire_bytes_total=1000 * ratio)
    runs = [run("baseline", 0.0, 1.0), run("naive", 3.0, 0.13), run("hybrid", 0.5, 0.26),
            run("grad_int2_efon", 1.5, 0.12), run("grad_int2_efoff", 4.0, 0.12)]
    assert report_convergence.closest_bytes_pair(runs, "naive")["name"] == "grad_int2_efon"
    claims = report_convergence.convergence_claims({"runs": runs})
    text = "\n".join(claims)
    assert "PASS against the 1% loss target, FAIL against the 1/4 bytes target" in text
    assert "naive degrades the loss more than hybrid matches here" in text
    assert "grad_int2_efon has the lower loss" in text
    assert "lowered the final loss gap at 1 of 1 strengths" in text


def test_best_setting_and_data_codec_claims():
    def run(name, gap, ratio, data, **over):
        return dict(name=name, gap_pct=gap, byte_ratio=ratio, wire_bytes_total=1000 * ratio,
                    wire_bytes={"data": data, "tensor": 0, "pipeline": 0},
                    byte_ratio_by_axis={"data": data / 100, "tensor": 0, "pipeline": 0},
                    policy="hybrid", overrides=over, error_feedback="off")
    runs = [run("baseline", 0.0, 1.0, 100), run("hybrid", 4.0, 0.24, 20),
            run("v_small", 0.9, 0.21, 30, **{"data.grad": "int8"}),
            run("v_big", -0.5, 0.24, 30), run("v_over", 0.1, 0.26, 30),
            run("grad_int8_efoff", -0.2, 0.9, 50), run("grad_int4_efoff", 3.0, 0.9, 13),
            run("grad_powersgd_r4", 20.0, 0.9, 38)]
    text = "\n".join(report_convergence.best_claims(runs))
    assert "Best per-axis setting meeting both targets: v_small" in text
    assert "data.grad=int8" in text and "Also meeting both: v_big (0.240, -0.50%)" in text
    assert "v_over" not in text and "hybrid" not in text.split("=")[0]
    none = report_convergence.best_claims([r for r in runs if not r["name"].startswith("v_")])
    assert none and none[0].startswith("No run here meets both targets")
    data = report_convergence.data_codec_claims({r["name"]: r for r in runs})[0]
    assert "fewest data-axis bytes within 1% of the baseline's loss is grad_int8_efoff" in data
    assert "grad_powersgd_r4: 0.380 of the data bytes, gap +20.00%" in data


def test_places_claims_name_the_cheapest_half():
    def run(name, gap, tensor, pipeline):
        return dict(name=name, gap_pct=gap,
                    byte_ratio_by_axis={"data": 1.0, "tensor": tensor, "pipeline": pipeline})
    by = {r["name"]: r for r in [
        run("baseline", 0.0, 1.0, 1.0), run("tensor_int2", 9.0, 0.07, 1.0),
        run("tensor_int2_layers_0-1", 6.0, 0.53, 1.0), run("tensor_int2_layers_2-3", 2.0, 0.53, 1.0),
        run("pipeline_int2", 3.0, 1.0, 0.07), run("pipeline_int2_stages_0", 1.0, 1.0, 0.5)]}
    tensor, pipeline = report_convergence.places_claims(by)
    assert tensor.startswith("Where to compress tensor: tensor_int2 gap +9.00% at 0.070")
    assert tensor.endswith("Of the halves, tensor_int2_layers_2-3 costs the least loss.")
    assert "tensor_int2_layers_0-1 gap +6.00% at 0.530 of the tensor bytes" in tensor
    assert "pipeline_int2_stages_0 costs the least" in pipeline
    assert report_convergence.places_claims({"baseline": by["baseline"]}) == []


def test_projection_claims_compare_order_and_bound():
    def row(total, comm):
        return dict(total_s=total, comm_s={"data": comm, "tensor": 0.0, "pipeline": 0.0},
                    gain_pct=100 * (10.0 / total - 1))
    proj = {"paper": {"naive": {"tflops_gain_pct": 22.5, "samples_gain_pct": 23.6},
                      "hybrid": {"tflops_gain_pct": 17.3, "samples_gain_pct": 12.7}},
            "clusters": {"c": {"policies": {"baseline": row(10.0, 2.0), "naive": row(8.5, 0.5),
                                            "hybrid": row(9.0, 1.0)}}}}
    text = "\n".join(report_projection.projection_claims(proj))
    # gains 100*(10/8.5-1)=17.6 and 100*(10/9-1)=11.1; comm share 2/10 bounds gains at 25%
    assert "naive +17.6%, hybrid +11.1%" in text
    assert "The order naive > hybrid matches" in text
    assert "spends 20.0% of its step communicating" in text and "at +25.0%" in text
    assert "at least 18.4%" in text


# ------------------------------------------------------------------- seeds

def test_mean_interval_is_the_student_t_interval():
    st = seeds_lib.mean_interval([1.0, 2.0, 3.0])
    half = 4.303 * 1.0 / math.sqrt(3)  # t(0.975, 2) * std / sqrt(n)
    assert st["mean"] == 2.0 and st["std"] == 1.0 and st["n"] == 3
    assert st["ci95"] == pytest.approx([2.0 - half, 2.0 + half])
    assert seeds_lib.mean_interval([4.0])["ci95"] is None
    assert seeds_lib.t975(1000) == 1.960
    with pytest.raises(ValueError):
        seeds_lib.mean_interval([])
    with pytest.raises(ValueError):
        seeds_lib.t975(0)


def _fake_run(out, name, steps, seed, val, wire=100.0, **first):
    spec = next(s for s in conv_specs.run_specs() if s["name"] == name)
    wd = out / conv_specs.workdir_name(spec, steps, seed)
    wd.mkdir(parents=True)
    recs = [{"step": 1, "loss": 5.0, "wire_bytes_total": wire, "wire_bytes_data": wire, **first}]
    recs += [{"step": s, "loss": val + 1.0 / s, "val_loss": val if s == steps else val + 0.5}
             for s in range(2, steps + 1)]
    (wd / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    (wd / conv.COMMIT_FILE).write_text("abc1234\n")


def test_seeds_pair_each_run_with_the_baseline_of_its_seed(tmp_path):
    """The gap of seed s is against the baseline at seed s: a setting 1% worse
    than the baseline at every seed has a zero-width interval at +1%, though the
    baselines themselves spread by 10%."""
    steps, base = 8, {0: 2.0, 1: 2.2, 2: 1.8}
    for seed, b in base.items():
        _fake_run(tmp_path, "baseline", steps, seed, b)
        _fake_run(tmp_path, "naive", steps, seed, b * 1.01, wire=13.0)
    _fake_run(tmp_path, "hybrid_paper", steps, 0, 2.0)  # one seed only
    assert conv_sum.seeds_on_disk(str(tmp_path), steps) == [0, 1, 2]
    assert conv_sum.seeds_on_disk(str(tmp_path), 9) == []
    runs = conv_sum.collect(str(tmp_path), steps, lambda spec, seed=0: [f"--config.seed={seed}"],
                        seeds=[0, 1, 2])
    assert [(r["name"], r["seed"]) for r in runs][:3] == [("baseline", 0), ("naive", 0),
                                                          ("hybrid_paper", 0)]
    sts = {st["name"]: st for st in seeds_lib.settings(runs)}
    naive = sts["naive"]
    assert naive["seeds"] == [0, 1, 2] and naive["byte_ratio"] == pytest.approx(0.13)
    assert naive["gap_pct"]["mean"] == pytest.approx(1.0)
    assert naive["gap_pct"]["ci95"] == pytest.approx([1.0, 1.0], abs=1e-9)
    assert naive["val_loss"]["std"] == pytest.approx(0.2 * 1.01)
    assert sts["hybrid_paper"]["gap_pct"]["ci95"] is None and sts["hybrid_paper"]["seeds"] == [0]
    assert "--config.seed=2" in next(r for r in runs if r["seed"] == 2)["command"]
    d = seeds_lib.paired_difference(runs, "naive", "baseline")
    assert d["seeds"] == [0, 1, 2] and d["mean"] == pytest.approx(1.0)
    assert seeds_lib.paired_difference(runs, "naive", "grad_int4_efoff") is None
    png = seeds_lib.draw(str(tmp_path), runs)
    assert png == {"seeds": "seeds_loss.png", "frontier": "seeds_frontier.png"}
    for name in png.values():
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # --summarize-only trains nothing and writes the same settings to summary.json.
    assert conv.main(["--suite", "seeds", "--steps", str(steps), "--seeds", "0", "--out",
                      str(tmp_path), "--summarize-only"]) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["seeds"] == [0, 1, 2] and summary["plots"] == png
    got = {st["name"]: st for st in summary["settings"]}
    assert got["naive"]["gap_pct"]["mean"] == pytest.approx(1.0)
    assert not any((tmp_path / n).exists() for n in ("hybrid_paper-8steps-seed1", "baseline-8steps-seed3"))


def test_seed_claims_name_the_target_setting_and_the_rotation_verdict():
    def st(name, gaps, ratio):
        return dict(name=name, seeds=[0, 1, 2], byte_ratio=ratio,
                    gap_pct=seeds_lib.mean_interval(gaps), overrides={}, policy="baseline",
                    error_feedback="off", git_commits=["abc1234"])

    def runs(name, vals):
        return [dict(name=name, seed=s, final_val_loss=v) for s, v in enumerate(vals)]

    summary = dict(steps=600, seeds=[0, 1, 2], settings=[
        st("baseline", [0, 0, 0], 1.0), st("naive", [3.0, 3.5, 2.5], 0.13),
        st("hybrid_a", [0.1, -0.2, 0.3], 0.15), st("hybrid_b", [0.0, 0.9, 1.8], 0.14),
        st("hybrid_paper", [2.0, 3.0, 2.5], 0.245)],
        runs=runs("naive", [2.06, 2.07, 2.05]) + runs("hybrid_b", [2.0, 2.01, 2.0])
        + runs("grad_int4rot_efoff", [2.0, 2.0, 2.01]) + runs("grad_int4_efoff", [2.1, 2.1, 2.1]))
    text = "\n".join(report_seeds.claims(summary, "hybrid_a"))
    # hybrid_b has fewer bytes but its interval reaches past +1%; hybrid_a's does not.
    assert "at most 1/6 of the baseline's bytes: hybrid_a (0.150" in text
    assert "The hybrid preset (jcomp.gpt.policy) is the setting hybrid_a." in text
    assert "hybrid_paper (0.245 of the bytes): gap +2.50%" in text and "not shown within" in text
    assert "int4:rot against int4 on seeds 0, 1, 2: -4.60%" in text
    assert "lower loss, beyond the noise" in text
    assert "closest-bytes hybrid setting hybrid_b" in text and "holds here" in text
    summary["settings"] = [s for s in summary["settings"] if s["name"] != "hybrid_a"]
    assert "No setting has its gap's 95% interval below +1%" in "\n".join(
        report_seeds.claims(summary, None))


def test_the_frontier_keeps_the_settings_no_other_beats_on_bytes_and_interval():
    def st(name, gaps, ratio):
        return dict(name=name, byte_ratio=ratio, gap_pct=seeds_lib.mean_interval(gaps))

    sts = [st("baseline", [0, 0], 1.0), st("cheap_bad", [5.0, 6.0, 7.0], 0.10),
           st("mid_good", [0.4, 0.5, 0.6], 0.15), st("mid_worse", [1.0, 2.0, 3.0], 0.16),
           st("dear_best", [-0.1, 0.0, 0.1], 0.25), st("one_seed", [0.0], 0.05)]
    got = [s["name"] for s in seeds_lib.frontier(sts)]
    # mid_worse has more bytes and a higher interval than mid_good; one seed has
    # no interval and the baseline is the reference, not a point.
    assert got == ["cheap_bad", "mid_good", "dear_best"]
    text = report_seeds.section(dict(model=dict(d_model=8, n_layers=1), steps=600, seeds=[0, 1, 2],
                                     config="c", batch_size=2, seq_len=4, mesh=[2, 2, 2],
                                     warmup_steps=1, plots={"frontier": "f.png"},
                                     settings=[dict(s, seeds=[0, 1, 2], val_loss=s["gap_pct"],
                                                    git_commits=["abc"]) for s in sts]),
                                "results/x", lambda s: "-", report_format.table)
    rows = text[text.index("| setting | bytes vs baseline |"):].splitlines()[2:5]
    assert [r.split("|")[1].strip() for r in rows] == got
    assert rows[1].split("|")[-2].strip() == "yes" and rows[2].split("|")[-2].strip() == "no"
    assert "![loss gap against bytes](results/x/f.png)" in text
    assert "Resumed" not in text
    runs = [dict(name="mid_good", seed=1, restarts=[{"stuck_after_step": 560, "log": "stuck1.log"}])]
    text = report_seeds.section(dict(model=dict(d_model=8, n_layers=1), steps=600, seeds=[0, 1, 2],
                                     config="c", batch_size=2, seq_len=4, mesh=[2, 2, 2],
                                     warmup_steps=1, plots={}, runs=runs,
                                     settings=[dict(s, seeds=[0, 1, 2], val_loss=s["gap_pct"],
                                                    git_commits=["abc"]) for s in sts]),
                                "results/x", lambda s: "-", report_format.table)
    assert text.rstrip().endswith("mid_good seed 1 (after step 560).")


def test_hybrid_preset_setting_matches_the_policy_table():
    settings = [dict(name=s["name"], overrides=s["overrides"], policy=s["policy"],
                     error_feedback=s["error_feedback"]) for s in conv_specs.run_specs()]
    name = report_convergence.hybrid_preset_setting(settings)
    assert name is not None
    from jcomp.gpt import policy
    spec = next(s for s in conv_specs.run_specs() if s["name"] == name)
    ef = {"on": True, "off": False}.get(spec["error_feedback"])
    assert policy.build(spec["policy"], spec["overrides"], ef) == policy.preset("hybrid")


def test_the_readme_seeds_table_is_the_seeds_suites():
    """The table under "Convergence over seeds" (docs/experiments.md, which the
    README links) is RESULTS.md's table of results/convergence_seeds, row for
    row (RESULTS.md has other tables with the same columns, one of which once
    stood in its place)."""
    def table_after(text, marker):
        start = text.index("| setting | compressed | seeds |", text.index(marker))
        return text[start:text.index("\n\n", start)].splitlines()

    readme = (ROOT / "docs" / "experiments.md").read_text()
    results = (ROOT / "experiments" / "RESULTS.md").read_text()
    assert table_after(readme, "Convergence over seeds, **withdrawn** (") == table_after(
        results, "### results/convergence_seeds:")


def test_a_forward_codec_that_moves_the_loss_beyond_the_seed_spread_is_flagged():
    """val_loss is the exact forward's; a setting that codes its forward also has
    the loss through it. Where the two differ by more than the exact val_loss's
    std over seeds, the codec itself moves the loss beyond the noise: flagged,
    in the table and in a claim. A setting without a forward codec has neither."""
    def run(name, seed, exact, compressed=None):
        return {"name": name, "seed": seed, "final_val_loss": exact,
                "final_val_loss_compressed": compressed, "overrides": {}, "policy": "baseline",
                "error_feedback": "auto", "gap_pct": 0.0, "byte_ratio": 0.2}

    runs = [run("hybrid", s, 1.40 + 0.01 * s, 1.40 + 0.01 * s - 0.05) for s in range(3)]
    runs += [run("calm", s, 1.40 + 0.01 * s, 1.40 + 0.01 * s + 0.001) for s in range(3)]
    runs += [run("grad_only", s, 1.40 + 0.01 * s) for s in range(3)]
    sts = {st["name"]: st for st in seeds_lib.settings(runs)}
    assert sts["hybrid"]["forward_codec_flag"] is True
    assert sts["hybrid"]["compressed_minus_exact"]["mean"] == pytest.approx(-0.05)
    assert sts["calm"]["forward_codec_flag"] is False
    assert "val_loss_compressed" not in sts["grad_only"]
    cells = [report_seeds._forward_cell(sts[n]) for n in ("hybrid", "calm", "grad_only")]
    assert "**FLAG**" in cells[0] and "FLAG" not in cells[1] and cells[2].startswith("= exact")


def test_the_outer_suite_reports_bytes_across_the_slow_hop_against_the_uncoded_two_hop_run(
        tmp_path):
    names = [sp["name"] for sp in conv_specs.select("outer")]
    assert names[:2] == ["baseline", "hop_raw"]
    assert {"outer_h50_f2_int4rot", "outer_h10_f2_int4rot", "outer_h10_sparseloco_k64",
            "outer_h10_lr0.3_m0.7_none"} <= set(names) and "outer_h50_f5_int4rot" not in names
    sparse = next(sp for sp in conv_specs.run_specs() if sp["name"] == "outer_h10_sparseloco_k256")
    assert "--config.outer.codec=sparseloco:k=256:chunk=4096:beta=0.95:coder=index" in \
        conv_specs.train_args(sparse, "configs/base.py", 600, 120, 60)
    packed = next(sp for sp in conv_specs.run_specs()
                  if sp["name"] == "outer_h10_sparseloco_packed_k256")
    assert "--config.outer.codec=sparseloco:k=256:chunk=4096:beta=0.95" in conv_specs.train_args(
        packed, "configs/base.py", 600, 120, 60)
    h10 = next(sp for sp in conv_specs.run_specs() if sp["name"] == "outer_h10_topk3_ef")
    args = conv_specs.train_args(h10, "configs/base.py", 600, 120, 60)
    for flag in ("--config.mesh.dcn_data=2", "--config.outer.every=10",
                 "--config.outer.codec=topk:0.03", "--config.outer.error_feedback=on"):
        assert flag in args
    steps = 8
    for seed in (0, 1):
        _fake_run(tmp_path, "baseline", steps, seed, 2.0)
        _fake_run(tmp_path, "hop_raw", steps, seed, 2.0, wire_bytes_dcn=5000.0)
        _fake_run(tmp_path, "outer_h10_int4rot", steps, seed, 2.02, outer_bytes_per_step=50.0)
        # A run that counts every byte across islands: its total, not its syncs alone.
        _fake_run(tmp_path, "outer_h10_sparseloco_packed_k256", steps, seed, 2.01,
                  outer_bytes_per_step=8.0, outer_across_bytes_per_step=10.0)
    runs = conv_sum.collect(str(tmp_path), steps, lambda spec, seed=0: [], seeds=[0, 1])
    sts = seeds_lib.settings(runs)
    by = {st["name"]: st for st in sts}
    assert by["baseline"]["across_bytes"] is None  # one hop: nothing is "across"
    assert by["hop_raw"]["across_bytes"] == 5000.0
    assert by["outer_h10_int4rot"]["across_bytes"] == 50.0
    assert by["outer_h10_sparseloco_packed_k256"]["across_bytes"] == 10.0
    text = "\n".join(report_seeds.across_table(sts, report_format.table))
    row = next(line for line in text.splitlines() if line.startswith("| outer_h10_int4rot"))
    assert "| 0.0100 | 100x | +1.00 |" in row
