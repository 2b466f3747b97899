"""benchmarks/parallel.py: its smallest run end to end, the bubble bookkeeping and
its argument checks."""
import datetime
import json
import os
import pathlib
import subprocess
import sys

import jax
import pytest

from benchmarks import parallel as bench
from jcomp.meter import wire

ROOT = pathlib.Path(__file__).resolve().parents[2]
AXES = ("data", "tensor", "pipeline")
QUICK_XLA_FLAGS = "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    """(JSON document, stdout) of `--quick` on 8 emulated CPU devices."""
    out = tmp_path_factory.mktemp("bench") / "p.json"
    # LLVM optimization level 0 cuts compile time by about 40%. It acts after the
    # HLO passes, so the collectives read from the program are the same; only
    # the (unchecked) step times are slower.
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=QUICK_XLA_FLAGS)
    proc = subprocess.run([sys.executable, "-m", "benchmarks.parallel", "--quick", "--json",
                           str(out)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout


def _row(doc, shape, policy):
    found = [r for r in doc["rows"] if r["shape"] == list(shape) and r["policy"] == policy]
    assert len(found) == 1, (shape, policy, doc["rows"])
    return found[0]


@pytest.mark.e2e
def test_quick_run_records_its_setting(quick):
    doc, stdout = quick
    assert doc["jax_version"] == jax.__version__
    assert doc["backend"] == "cpu" and doc["device_count"] == 8
    assert doc["xla_flags"] == QUICK_XLA_FLAGS
    assert datetime.datetime.fromisoformat(doc["date"]).tzinfo is not None
    got = {(tuple(r["shape"]), r["policy"], r["microbatches"]) for r in doc["rows"]}
    assert got == {((8, 1, 1), "baseline", 1), ((8, 1, 1), "hybrid", 1),
                   ((1, 2, 4), "baseline", 2), ((1, 2, 4), "hybrid", 2)}
    assert doc["skipped"] == []
    # On CPU the output must say that the measured bubble is not the GPU one.
    assert any("idle pipeline stages free no compute" in n for n in doc["notes"])
    assert "free no compute" in stdout and "hybrid" in stdout and "1,2,4" in stdout


@pytest.mark.e2e
def test_times_bytes_and_losses_are_positive(quick):
    doc, _ = quick
    for r in doc["rows"]:
        assert len(r["times_s"]) == doc["repeats"] == 1, r
        assert r["time_s"] > 0 and r["param_bytes_per_device"] > 0, r
        assert r["opt_state_bytes_per_device"] > 0 and r["wire_bytes_total"] > 0, r
        assert sum(r["wire_bytes_by_axis"].values()) == pytest.approx(r["wire_bytes_total"])
        # A fresh model on random tokens over a 64-token vocabulary: loss near ln 64.
        assert 3.0 < r["first_loss"] < 5.5, r


@pytest.mark.e2e
def test_ratios_are_against_the_baseline_on_the_same_mesh(quick):
    doc, _ = quick
    for r in doc["rows"]:
        b = _row(doc, r["shape"], "baseline")
        assert r["time_ratio"] == pytest.approx(r["time_s"] / b["time_s"])
        assert r["wire_ratio"] == pytest.approx(r["wire_bytes_total"] / b["wire_bytes_total"])


@pytest.mark.e2e
def test_hybrid_sends_fewer_bytes_on_every_axis_that_carries_traffic(quick):
    doc, _ = quick
    for shape, busy in (((8, 1, 1), {"data"}), ((1, 2, 4), {"tensor", "pipeline"})):
        base, hyb = _row(doc, shape, "baseline"), _row(doc, shape, "hybrid")
        sent = {a for a in AXES if base["wire_bytes_by_axis"].get(a, 0) > 0}
        assert sent == busy, (shape, base["wire_bytes_by_axis"])
        for axis in sent:
            # int8/int4 payloads: well under the float32 bytes, not merely a little.
            assert hyb["wire_bytes_by_axis"][axis] < 0.5 * base["wire_bytes_by_axis"][axis], \
                (shape, axis, base["wire_bytes_by_axis"], hyb["wire_bytes_by_axis"])


@pytest.mark.e2e
def test_tensor_and_pipeline_split_the_parameters(quick):
    doc, _ = quick
    for policy in ("baseline", "hybrid"):
        replicated = _row(doc, (8, 1, 1), policy)["param_bytes_per_device"]
        split = _row(doc, (1, 2, 4), policy)["param_bytes_per_device"]
        assert split < replicated / 2, (policy, split, replicated)
    # The same parameters live on every device of a pure data-parallel mesh.
    assert _row(doc, (8, 1, 1), "hybrid")["param_bytes_per_device"] == \
        _row(doc, (8, 1, 1), "baseline")["param_bytes_per_device"]


@pytest.mark.e2e
def test_predicted_bubble_is_gpipe_exactly(quick):
    doc, _ = quick
    for r in doc["rows"]:
        p, m = r["shape"][2], r["microbatches"]
        assert r["predicted_bubble"] == (p - 1) / (m + p - 1), r
    assert _row(doc, (1, 2, 4), "baseline")["predicted_bubble"] == 0.6
    assert _row(doc, (8, 1, 1), "baseline")["predicted_bubble"] == 0.0
    # --quick runs no (data, tensor, 1) reference meshes, so nothing is claimed measured.
    assert all(r["measured_bubble"] is None for r in doc["rows"])


def _fake_built(total: float):
    """What `build` returns, minus the executable: one tensor all-reduce of `total` bytes."""
    coll = wire.Collective(kind="all-reduce", dtype="f32", shape=(4,), group_size=2,
                           axes=("tensor",), bytes_per_device=total, count=1, name="ar",
                           parts=(("f32", (4,), total),))
    return dict(report=wire.WireReport([coll]), param_bytes=10, opt_bytes=20)


def test_measured_bubble_comes_from_the_reference_mesh():
    cases = [dict(shape=(1, 2, 4), policy="baseline", microbatches=2, role="main"),
             dict(shape=(1, 2, 4), policy="hybrid", microbatches=2, role="main"),
             dict(shape=(1, 2, 1), policy="baseline", microbatches=2, role="reference")]
    built = [_fake_built(total=100.0), _fake_built(total=30.0), _fake_built(total=80.0)]
    times = [[0.5, 0.4, 0.6], [0.8, 0.8, 0.8], [0.8, 1.0, 1.2]]
    rows = bench.make_rows(cases, built, [4.0, 4.0, 4.0], times)
    base, hyb, ref = rows
    # t = 0.5, t_ref = 1.0, P = 4: 1 - (1.0 / 4) / 0.5 = 0.5.
    assert base["measured_bubble"] == pytest.approx(0.5)
    assert base["reference_time_s"] == pytest.approx(1.0)
    assert hyb["measured_bubble"] is None and ref["measured_bubble"] is None
    assert hyb["time_ratio"] == pytest.approx(1.6) and hyb["wire_ratio"] == pytest.approx(0.3)
    assert ref["predicted_bubble"] == 0.0 and base["predicted_bubble"] == pytest.approx(1 / 5 * 3)


def test_measured_bubble_rejects_non_positive_times():
    with pytest.raises(ValueError, match="step times"):
        bench.measured_bubble(0.0, 1.0, 4)
    with pytest.raises(ValueError, match="step times"):
        bench.measured_bubble(1.0, float("nan"), 4)


def test_plan_adds_references_and_skips_layouts_that_do_not_divide():
    cfg = bench.gpt.ModelConfig(vocab_size=64, d_model=32, n_heads=4, n_layers=4, d_ff=64)
    cases, skipped = bench.plan([(8, 1, 1), (2, 2, 2)], ["baseline", "hybrid"], [1, 4], cfg,
                                batch=8)
    got = {(c["shape"], c["policy"], c["microbatches"], c["role"]) for c in cases}
    # A mesh without a pipeline runs M = 1 only; each pipelined (M) gets its reference;
    # a mesh without tensor and pipeline also gets the plain jax.jit data-parallel step.
    assert got == {((8, 1, 1), "baseline", 1, "main"), ((8, 1, 1), "hybrid", 1, "main"),
                   ((8, 1, 1), bench.JIT_DP, 1, "jit"),
                   ((2, 2, 2), "baseline", 1, "main"), ((2, 2, 2), "hybrid", 1, "main"),
                   ((2, 2, 1), "baseline", 1, "reference"),
                   ((2, 2, 2), "baseline", 4, "main"), ((2, 2, 2), "hybrid", 4, "main"),
                   ((2, 2, 1), "baseline", 4, "reference")}
    assert skipped == []
    cases, skipped = bench.plan([(2, 2, 2)], ["baseline"], [8], cfg, batch=8)
    assert cases == [] and len(skipped) == 2
    assert all("batch_size=8 is not divisible" in s["reason"] for s in skipped)
    cases, _ = bench.plan([(2, 2, 2)], ["baseline"], [2], cfg, batch=8, reference=False)
    assert [c["role"] for c in cases] == ["main"]


@pytest.mark.parametrize("argv,flag", [
    (["--shapes", "2,2"], "--shapes"),
    (["--shapes", "2,0,4"], "--shapes"),
    (["--shapes", "2,2,1"], "--shapes"),
    (["--policies", "int4"], "--policies"),
    (["--microbatches", "0"], "--microbatches"),
    (["--repeats", "0"], "--repeats"),
    (["--heads", "3"], "n_heads"),
])
def test_bad_arguments_are_refused_by_name(argv, flag, capsys):
    with pytest.raises(SystemExit) as e:
        bench.parse_args(argv)
    assert e.value.code == 2
    assert flag in capsys.readouterr().err


def test_defaults_and_quick_always_include_the_baseline():
    args, _ = bench.parse_args([])
    assert args.shapes == [(8, 1, 1), (2, 2, 2), (1, 2, 4)] and args.repeats == 5
    assert args.policies == ["baseline", "hybrid", "naive"] and args.reference is True
    assert (args.model.d_model, args.model.n_layers, args.seq, args.batch) == (128, 4, 128, 16)
    args, _ = bench.parse_args(["--quick", "--policies", "naive"])
    assert args.policies == ["baseline", "naive"] and args.reference is False
    args, _ = bench.parse_args(["--quick", "--reference"])
    assert args.reference is True


@pytest.mark.slow
def test_jit_dp_reference_computes_the_baseline_step():
    """The plain jax.jit data-parallel row trains the same model on the same batch:
    its first loss is the baseline policy's, and its bytes are XLA's gradient
    all-reduce."""
    import numpy as np

    cfg = bench.gpt.ModelConfig(vocab_size=64, d_model=32, n_heads=4, n_layers=2, d_ff=64,
                                max_seq_len=16)
    tx = bench.hyperparams.make_tx(lr=1e-3, warmup_steps=0, total_steps=10)
    params = bench.jax.tree.map(np.asarray, bench.gpt.init_params(cfg, bench.jax.random.key(0)))
    tokens = np.random.default_rng(0).integers(0, 64, (8, 17)).astype(np.int32)
    case = dict(shape=(8, 1, 1), microbatches=1, role="main")
    jit = bench.build_jit_dp(dict(case, policy=bench.JIT_DP), cfg, tx, params, tokens)
    base = bench.build(dict(case, policy="baseline"), cfg, tx, params, tokens)
    _, loss_jit = bench.run_once(jit)
    _, loss_base = bench.run_once(base)
    assert abs(loss_jit - loss_base) <= 1e-5 * abs(loss_base), (loss_jit, loss_base)
    assert {c.kind for c in jit["report"].collectives} == {"all-reduce"}
