"""Faults injected into real runs of train.py (subprocesses, configs/tiny.py,
8 emulated CPU devices): signals, a kill during a save, a NaN step, damaged
checkpoints, bad input, the error-feedback guard, and determinism.

Runs are shared through module-scoped fixtures; every run uses the same config
so that losses compare bit for bit across runs (CPU arithmetic is
deterministic, and a resumed run must retrace the uninterrupted one exactly).
"""
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 10
# Saves at steps 4, 8 and 10 (the last step always saves); all three are kept.
TINY = ["--config=configs/tiny.py", f"--config.train.steps={STEPS}",
        "--config.train.log_every=1", "--config.checkpoint.every=4",
        "--config.checkpoint.keep=3", "--config.train.eval_every=100"]
HOOKS = ("JCOMP_TEST_STEP_SLEEP", "JCOMP_TEST_KILL_DURING_SAVE", "JCOMP_TEST_NAN_STEP")


def _env(**hooks):
    env = {k: v for k, v in os.environ.items() if k not in HOOKS}
    # LLVM level 0 for compile time; see conftest.py.
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
    env["JAX_PLATFORMS"] = "cpu"
    env.update({k: str(v) for k, v in hooks.items()})
    return env


def _cmd(workdir, *args):
    return [sys.executable, "train.py", f"--workdir={workdir}", *args]


def run(workdir, *args, timeout=300, **hooks):
    return subprocess.run(_cmd(workdir, *args), cwd=ROOT, env=_env(**hooks),
                          capture_output=True, text=True, timeout=timeout)


def records(workdir):
    """The metrics records in file order (a resumed run appends its own)."""
    from jcomp import metrics
    return list(metrics.read_metrics(os.path.join(workdir, "metrics.jsonl")))


def n_records(workdir):
    return len(records(workdir))


def losses(recs):
    return {r["step"]: r["loss"] for r in recs}


def ckpt_dir(workdir):
    return os.path.join(workdir, "checkpoints")


def committed_steps(workdir):
    d = ckpt_dir(workdir)
    return sorted(int(n) for n in os.listdir(d)
                  if n.isdigit() and os.path.exists(os.path.join(d, n, "commit_success.txt")))


def snapshot(workdir):
    """Every path under workdir with its kind, size and mtime."""
    out = {}
    for root, dirs, files in os.walk(workdir):
        for name in dirs + files:
            p = os.path.join(root, name)
            st = os.lstat(p)
            out[os.path.relpath(p, workdir)] = (name in dirs, st.st_size, st.st_mtime_ns)
    return out


def error_lines(stderr):
    return [l for l in stderr.splitlines() if l.startswith("train.py: error:")]


def truncate_biggest(step_dir):
    """Halves the largest array data file of a checkpoint step; returns its path."""
    files = [os.path.join(r, f) for r, _, fs in os.walk(os.path.join(step_dir, "state"))
             for f in fs]
    path = max(files, key=os.path.getsize)
    size = os.path.getsize(path)
    assert size > 16, path
    with open(path, "r+b") as f:
        f.truncate(size // 2)
    return path


def restore_all(workdir, policy="baseline"):
    """{step: restored state} for every checkpoint of a tiny run, verified by checksum."""
    import jax
    sys.path.insert(0, ROOT)
    from configs import tiny
    from jcomp import checkpoint, step, trainer
    from jcomp import mesh as mesh_lib
    from jcomp import model as gpt
    cfg = tiny.get_config()
    cfg.train.steps = STEPS
    cfg.compression.policy = policy
    model_cfg, shape, pol = trainer.validate(cfg, jax.device_count())
    mesh = mesh_lib.make_mesh(shape)
    shapes = jax.eval_shape(lambda: gpt.init_params(model_cfg, jax.random.key(0)))
    abstract = step.abstract_state(shapes, mesh, trainer.make_tx(cfg), pol)
    ckpt = checkpoint.Checkpointer(ckpt_dir(workdir), save_every=4, keep=3)
    try:
        return {s: ckpt.restore(abstract, step=s).state for s in ckpt.steps()}
    finally:
        ckpt.close()


def all_finite(tree):
    import jax
    return all(bool(np.isfinite(np.asarray(x)).all()) for x in jax.tree.leaves(tree)
               if np.issubdtype(np.asarray(x).dtype, np.floating))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted run: the losses every fault run must reproduce."""
    workdir = str(tmp_path_factory.mktemp("reference"))
    proc = run(workdir, *TINY)
    assert proc.returncode == 0, proc.stderr[-3000:]
    recs = records(workdir)
    assert [r["step"] for r in recs] == list(range(1, STEPS + 1))
    assert committed_steps(workdir) == [4, 8, 10]
    return workdir


# ------------------------------------------------------------ determinism

def test_same_config_and_seed_give_bitwise_equal_losses(reference, nan_skip_run):
    """Until its injected NaN, the NaN-skip run is the reference's command in
    another process: its steps before NAN_STEP must repeat the losses bit for bit."""
    a = {r["step"]: r for r in records(reference)}
    b = [r for r in records(nan_skip_run[0]) if r["step"] < NAN_STEP]
    assert [r["step"] for r in b] == list(range(1, NAN_STEP))
    for rb in b:
        ra = a[rb["step"]]
        assert ra["loss"] == rb["loss"] and ra["grad_norm"] == rb["grad_norm"], (ra, rb)


# ------------------------------------------------------------------ SIGTERM

def test_sigterm_saves_exits_0_and_resume_matches(reference, tmp_path):
    """SIGTERM at a random step k in [3, 6]: the run finishes the step in flight,
    saves it and exits 0; the same command resumes from there and reproduces the
    uninterrupted run's losses bit for bit."""
    k = random.Random(20261130).randint(3, 6)
    workdir = str(tmp_path / "term")
    # A second per step after each metrics line leaves the signal time to land
    # before the loop checks for it.
    hooks = {"JCOMP_TEST_STEP_SLEEP": 1.0}
    proc = subprocess.Popen(_cmd(workdir, *TINY), cwd=ROOT, env=_env(**hooks),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 240
    metrics_path = os.path.join(workdir, "metrics.jsonl")
    while time.monotonic() < deadline and proc.poll() is None:
        if os.path.exists(metrics_path) and any(r["step"] >= k for r in records(workdir)):
            break
        time.sleep(0.05)
    assert proc.poll() is None, "the run ended before the signal"
    proc.send_signal(signal.SIGTERM)
    t0 = time.monotonic()
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err[-3000:]
    assert time.monotonic() - t0 < 30, "exit after SIGTERM took too long"
    stopped = records(workdir)[-1]["step"]
    # The step in flight when the signal arrived: k, or k+1 if it landed after
    # the check of step k.
    assert k <= stopped <= k + 1 < STEPS, (k, stopped)
    assert stopped in committed_steps(workdir), (stopped, committed_steps(workdir))

    before = n_records(workdir)
    proc = run(workdir, *TINY, **hooks)
    assert proc.returncode == 0, proc.stderr[-3000:]
    resumed = records(workdir)[before:]
    assert [r["step"] for r in resumed] == list(range(stopped + 1, STEPS + 1))
    full = losses(records(reference))
    for r in resumed:
        assert r["loss"] == full[r["step"]], (r["step"], r["loss"], full[r["step"]])


# ------------------------------------------------------ kill -9 during a save

def test_kill_during_save_resumes_from_last_complete_checkpoint(reference, tmp_path):
    workdir = str(tmp_path / "killed")
    proc = run(workdir, *TINY, JCOMP_TEST_KILL_DURING_SAVE=8)
    assert proc.returncode == -signal.SIGKILL, (proc.returncode, proc.stderr[-2000:])
    # The kill really cut the save of step 8 short: only step 4 is complete.
    assert committed_steps(workdir) == [4], os.listdir(ckpt_dir(workdir))
    assert not os.path.exists(os.path.join(ckpt_dir(workdir), "8", "commit_success.txt"))

    before = n_records(workdir)
    assert records(workdir)[-1]["step"] == 8
    proc = run(workdir, *TINY)
    assert proc.returncode == 0, proc.stderr[-3000:]
    resumed = records(workdir)[before:]
    assert [r["step"] for r in resumed] == list(range(5, STEPS + 1)), "did not resume from 4"
    full = losses(records(reference))
    assert all(r["loss"] == full[r["step"]] for r in resumed), (resumed, full)
    assert committed_steps(workdir) == [4, 8, 10]


# ------------------------------------------------------------------- NaN step

NAN_STEP = 6


@pytest.fixture(scope="module")
def nan_skip_run(tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("nan_skip"))
    proc = run(workdir, *TINY, "--config.train.nonfinite=skip", JCOMP_TEST_NAN_STEP=NAN_STEP)
    return workdir, proc


def test_nan_step_is_skipped_and_training_continues(nan_skip_run):
    workdir, proc = nan_skip_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    recs = {r["step"]: r for r in records(workdir)}
    assert sorted(recs) == list(range(1, STEPS + 1))
    assert math.isnan(recs[NAN_STEP]["loss"]), recs[NAN_STEP]  # the hook really made a NaN
    assert all(math.isfinite(recs[s]["loss"]) for s in recs if s != NAN_STEP)
    assert [recs[s]["skipped_updates"] for s in sorted(recs)] == \
        [0] * (NAN_STEP - 1) + [1] * (STEPS - NAN_STEP + 1)
    assert f"at step {NAN_STEP}" in proc.stderr and "update skipped" in proc.stderr


def test_nan_step_skipped_leaves_no_nan_in_any_checkpoint(nan_skip_run):
    workdir, _ = nan_skip_run
    states = restore_all(workdir)
    assert sorted(states) == [4, 8, 10]
    for s, state in states.items():
        assert all_finite(state), f"checkpoint {s} holds a non-finite value"


def test_nan_step_with_stop_exits_1_naming_the_step(tmp_path):
    workdir = str(tmp_path / "nan_stop")
    proc = run(workdir, *TINY, "--config.train.nonfinite=stop", JCOMP_TEST_NAN_STEP=NAN_STEP)
    assert proc.returncode == 1, proc.stderr[-3000:]
    lines = error_lines(proc.stderr)
    assert len(lines) == 1 and f"step {NAN_STEP}" in lines[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert [r["step"] for r in records(workdir)] == list(range(1, NAN_STEP))
    # Only steps before the NaN were saved, and they restore complete and finite.
    assert committed_steps(workdir) == [4]
    states = restore_all(workdir)
    assert sorted(states) == [4] and all_finite(states[4])


# ------------------------------------------------------ damaged checkpoints

def test_truncated_newest_checkpoint_falls_back_to_previous(reference, tmp_path):
    workdir = str(tmp_path / "trunc")
    shutil.copytree(reference, workdir)
    truncate_biggest(os.path.join(ckpt_dir(workdir), "10"))
    damaged = snapshot(os.path.join(ckpt_dir(workdir), "10"))
    before = n_records(workdir)
    proc = run(workdir, *TINY)
    assert proc.returncode == 0, proc.stderr[-3000:]
    warned = [l for l in proc.stderr.splitlines() if "cannot be used" in l]
    assert any(os.path.join(ckpt_dir(workdir), "10") in l for l in warned), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    resumed = records(workdir)[before:]
    assert [r["step"] for r in resumed] == [9, 10], "did not resume from step 8"
    full = losses(records(reference))
    assert all(r["loss"] == full[r["step"]] for r in resumed), (resumed, full)
    # The damaged step was moved aside untouched, and step 10 was saved afresh.
    aside = os.path.join(workdir, "checkpoints_unusable", "10")
    assert snapshot(aside) == damaged
    assert committed_steps(workdir) == [4, 8, 10]
    assert sorted(restore_all(workdir)) == [4, 8, 10]


def test_all_checkpoints_damaged_exits_2_and_changes_nothing(reference, tmp_path):
    workdir = str(tmp_path / "all_bad")
    shutil.copytree(reference, workdir)
    for s in (4, 8, 10):
        truncate_biggest(os.path.join(ckpt_dir(workdir), str(s)))
    before = snapshot(workdir)
    proc = run(workdir, *TINY)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [l for l in proc.stderr.splitlines() if l.strip()]
    assert len(lines) == 1, proc.stderr[-3000:]
    assert ckpt_dir(workdir) in lines[0] and "Traceback" not in proc.stderr
    assert snapshot(workdir) == before


# --------------------------------------------------------------- bad input

@pytest.fixture(scope="module")
def finished(reference, tmp_path_factory):
    """A copy of a finished run, to rerun with bad input."""
    workdir = str(tmp_path_factory.mktemp("finished") / "w")
    shutil.copytree(reference, workdir)
    return workdir


def _bad_inputs(tmp):
    empty = tmp / "empty"
    empty.mkdir()
    (empty / "a.txt").write_text("")
    tokens32 = tmp / "tokens.bin"
    np.arange(64, dtype=np.uint32).tofile(tokens32)
    short = tmp / "short"
    short.mkdir()
    (short / "a.txt").write_text("only a few bytes\n")
    return {
        "empty corpus": ([f"--config.data.source={empty}"], "data.source"),
        "missing corpus": ([f"--config.data.source={tmp / 'nowhere.txt'}"], "data.source"),
        "token dtype": ([f"--config.data.source=tokens:{tokens32}",
                         "--config.data.token_dtype=uint16", "--config.data.tokenizer="],
                        "uint32"),
        "seq_len over data": ([f"--config.data.source={short}", "--config.data.val_permille=0"],
                              "seq_len"),
        "incompatible checkpoint": (["--config.model.d_model=64"], "model.d_model"),
    }


@pytest.mark.parametrize("case", ["empty corpus", "missing corpus", "token dtype",
                                  "seq_len over data", "incompatible checkpoint"])
def test_bad_input_exits_2_one_line_and_changes_nothing(finished, tmp_path, case):
    args, named = _bad_inputs(tmp_path)[case]
    before = snapshot(finished)
    proc = run(finished, *TINY, *args, timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [l for l in proc.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("train.py: error:"), proc.stderr[-3000:]
    assert named in lines[0], lines[0]
    assert snapshot(finished) == before


# ------------------------------------------------- error-feedback guard

def test_ef_residual_past_bound_is_reset_and_reported(tmp_path):
    """Hybrid policy (int4 + error feedback on data gradients) with a bound no
    residual stays under: every step resets, says so, and training goes on; the
    saved residuals are zero while the residual norm before the reset was not."""
    workdir = str(tmp_path / "ef")
    proc = run(workdir, *TINY, "--config.compression.policy=hybrid",
               "--config.train.ef_reset_norm=1e-9", "--config.train.steps=4")
    assert proc.returncode == 0, proc.stderr[-3000:]
    recs = records(workdir)
    assert [r["step"] for r in recs] == [1, 2, 3, 4]
    for r in recs:
        assert r["ef_norm"] > 1e-9 and r["ef_reset"] is True, r
        assert math.isfinite(r["loss"])
    assert recs[-1]["loss"] < recs[0]["loss"], "training did not go on"
    assert "train.ef_reset_norm" in proc.stderr and "residuals reset" in proc.stderr
    state = restore_all(workdir, policy="hybrid")[4]
    import jax
    ef = jax.tree.leaves(state["zero"]["ef"])
    assert ef and all(not np.asarray(x).any() for x in ef)
    assert any(np.asarray(x).any() for x in jax.tree.leaves(state["zero"]["master"]))

