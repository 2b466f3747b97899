"""Faults injected into real runs of train.py (subprocesses, configs/tiny.py,
8 emulated CPU devices): signals, a kill during a save, a NaN step, damaged
checkpoints, bad input, resume mismatches, a second trainer on the workdir, a
read-only workdir, the error-feedback guard, and determinism. A full disk, a
truncated newest checkpoint, a second Ctrl-C and a checkpoint directory lost
mid-run are in experiments/checks/test_faults_long.py.

Faults inside a run are injected by tests/train/faultinject.py, which runs
train.py's command with the loop's hooks (`jcomp.train.run.hooks`) set. Runs are shared
through module-scoped fixtures; every run uses the same config
so that losses compare bit for bit across runs (CPU arithmetic is
deterministic, and a resumed run must retrace the uninterrupted one exactly).
"""
import hashlib
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

pytestmark = pytest.mark.e2e  # every test here runs train.py in a subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS = 10
# Saves at steps 4, 8 and 10 (the last step always saves); all three are kept.
TINY = ["--config=configs/tiny.py", f"--config.train.steps={STEPS}",
        "--config.train.log_every=1", "--config.checkpoint.every=4",
        "--config.checkpoint.keep=3", "--config.train.eval_every=100"]
TMP_MARK = ".orbax-checkpoint-tmp"  # orbax's name for a save in progress


def _env():
    env = dict(os.environ)
    # LLVM level 0 for compile time; see conftest.py.
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
    env["JAX_PLATFORMS"] = "cpu"
    return env


def _cmd(workdir, *args, **faults):
    """train.py with `args`; given faults (options of tests/train/faultinject.py, e.g.
    step_sleep=1.0), the same command run through faultinject.py, which injects them."""
    program = [os.path.join("tests", "train", "faultinject.py"),
               *(f"--{name}={value}" for name, value in faults.items()), "--"] if faults \
        else ["train.py"]
    return [sys.executable, *program, f"--workdir={workdir}", *args]


def run(workdir, *args, timeout=300, **faults):
    return subprocess.run(_cmd(workdir, *args, **faults), cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=timeout)


def records(workdir):
    """The metrics records in file order (a resumed run appends its own)."""
    from jcomp.train.run import metrics
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
    """Every path under workdir with its kind, size, mtime and (files) sha256."""
    out = {}
    for root, dirs, files in os.walk(workdir):
        for name in dirs + files:
            p = os.path.join(root, name)
            st = os.lstat(p)
            digest = None
            if name in files:
                with open(p, "rb") as f:
                    digest = hashlib.sha256(f.read()).hexdigest()
            out[os.path.relpath(p, workdir)] = (name in dirs, st.st_size, st.st_mtime_ns, digest)
    return out


def error_lines(stderr):
    return [l for l in stderr.splitlines() if l.startswith("train.py: error:")]


def only_line(stderr):
    """The one line train.py wrote on stderr (asserted to be the only one)."""
    lines = [l for l in stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("train.py: "), stderr[-3000:]
    assert "Traceback" not in stderr
    return lines[0]


def unfinished_saves(workdir):
    return sorted(n for n in os.listdir(ckpt_dir(workdir)) if TMP_MARK in n)


def holds_workdir_lock(pid, workdir):
    """Whether process `pid` holds the flock on WORKDIR/.lock (read from /proc/locks,
    without taking the lock, which could make the trainer's own attempt fail)."""
    try:
        inode = os.stat(os.path.join(workdir, ".lock")).st_ino
    except FileNotFoundError:
        return False
    with open("/proc/locks") as f:
        for line in f:
            parts = line.split()
            if len(parts) > 5 and parts[1] == "FLOCK" and parts[4] == str(pid) \
                    and int(parts[5].rsplit(":", 1)[1]) == inode:
                return True
    return False


def wait_for_lock(proc, workdir, timeout=180):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if holds_workdir_lock(proc.pid, workdir):
            return True
        time.sleep(0.02)
    return False


def signal_when_locked(workdir, sig, *args):
    """Starts train.py on `workdir`, sends `sig` once it holds the workdir's lock and
    waits for it to end. -> (exit code, stderr)."""
    proc = start(workdir, *args)
    try:
        assert wait_for_lock(proc, workdir), "the run never locked its workdir"
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, err


def start(workdir, *args, **faults):
    return subprocess.Popen(_cmd(workdir, *args, **faults), cwd=ROOT, env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


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
    from jcomp.train.run import checkpoint
    from jcomp.train.settings import runspec
    from jcomp.gpt import step
    from jcomp.gpt import mesh as mesh_lib
    from jcomp.gpt import model as gpt
    cfg = tiny.get_config()
    cfg.train.steps = STEPS
    cfg.compression.policy = policy
    spec = runspec.validate(cfg, jax.device_count())
    mesh = mesh_lib.make_mesh(spec.mesh_shape)
    shapes = jax.eval_shape(lambda: gpt.init_params(spec.model, jax.random.key(0)))
    abstract = step.abstract_state(shapes, mesh, spec.optim.tx(spec.train.steps), spec.zero)
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
def reference_run(tmp_path_factory):
    """An uninterrupted run: the losses every fault run must reproduce. While it
    holds its workdir, a second trainer is started on the same workdir (the
    first is held still with SIGSTOP meanwhile, so the second's try is certain
    to meet the lock). -> (workdir, second's CompletedProcess, whether the
    workdir was byte-identical before and after the second's try)."""
    assert os.path.exists("/proc/locks"), "the lock check reads /proc/locks (Linux)"
    workdir = str(tmp_path_factory.mktemp("reference"))
    first = start(workdir, *TINY)
    try:
        assert wait_for_lock(first, workdir), "the first trainer never locked its workdir"
        os.kill(first.pid, signal.SIGSTOP)
        try:
            before = snapshot(workdir)
            second = run(workdir, *TINY, timeout=120)
            unchanged = snapshot(workdir) == before
        finally:
            os.kill(first.pid, signal.SIGCONT)
        _, err = first.communicate(timeout=300)
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == 0, err[-3000:]
    recs = records(workdir)
    assert [r["step"] for r in recs] == list(range(1, STEPS + 1))
    assert committed_steps(workdir) == [4, 8, 10]
    return workdir, second, unchanged


@pytest.fixture(scope="module")
def reference(reference_run):
    return reference_run[0]


# ------------------------------------------------------------ workdir lock

def test_second_trainer_on_a_workdir_in_use_is_refused(reference_run):
    """Exit 2 and one line for the second; the first finishes intact: one record
    per step (no interleaving) and no more checkpoints than keep=3."""
    workdir, second, unchanged = reference_run
    assert second.returncode == 2, second.stderr[-3000:]
    line = only_line(second.stderr)
    assert "in use by another trainer" in line and workdir in line, line
    assert unchanged, "the refused trainer changed the workdir"
    assert [r["step"] for r in records(workdir)] == list(range(1, STEPS + 1))
    assert committed_steps(workdir) == [4, 8, 10] and not unfinished_saves(workdir)


# ------------------------------------------------------------ determinism

def test_same_config_and_seed_give_bitwise_equal_losses(reference, nan_skip_run):
    """Until its injected NaN, the NaN-skip run is the reference's config in
    another process (train.py under tests/train/faultinject.py): its steps before
    NAN_STEP must repeat the losses bit for bit."""
    a = {r["step"]: r for r in records(reference)}
    b = [r for r in records(nan_skip_run[0]) if r["step"] < NAN_STEP]
    assert [r["step"] for r in b] == list(range(1, NAN_STEP))
    for rb in b:
        ra = a[rb["step"]]
        assert ra["loss"] == rb["loss"] and ra["grad_norm"] == rb["grad_norm"], (ra, rb)


# ------------------------------------------------------------------ SIGTERM

def test_sigterm_saves_exits_0_and_resume_matches(reference, tmp_path):
    """SIGTERM at a random step k in [3, 6]: the run finishes the step in flight,
    saves it and exits 0; train.py with the same flags resumes from there and
    reproduces the uninterrupted run's losses bit for bit."""
    k = random.Random(20261130).randint(3, 6)
    workdir = str(tmp_path / "term")
    # A second per step after each metrics line leaves the signal time to land
    # before the loop checks for it.
    faults = {"step_sleep": 1.0}
    proc = start(workdir, *TINY, **faults)
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
    proc = run(workdir, *TINY)  # the plain command: no signal to wait for now
    assert proc.returncode == 0, proc.stderr[-3000:]
    resumed = records(workdir)[before:]
    assert [r["step"] for r in resumed] == list(range(stopped + 1, STEPS + 1))
    full = losses(records(reference))
    for r in resumed:
        assert r["loss"] == full[r["step"]], (r["step"], r["loss"], full[r["step"]])


# ------------------------------------------------------ kill -9 during a save

def test_kill_during_save_resumes_from_last_complete_checkpoint(reference, tmp_path):
    """kill -9 mid-save; the rerun (its train.steps raised from 10 to 12) takes
    the workdir (the lock died with the killed process), removes the unfinished
    save, resumes from step 4 and keeps the first run's 10-step learning-rate
    schedule: steps 5-10 repeat the reference bit for bit (a schedule stretched
    to 12 steps would change every rate after the warm-up), 11-12 run at its
    final rate."""
    workdir = str(tmp_path / "killed")
    proc = run(workdir, *TINY, kill_during_save=8)
    assert proc.returncode == -signal.SIGKILL, (proc.returncode, proc.stderr[-2000:])
    # The kill really cut the save of step 8 short: only step 4 is complete.
    assert committed_steps(workdir) == [4], os.listdir(ckpt_dir(workdir))
    assert not os.path.exists(os.path.join(ckpt_dir(workdir), "8", "commit_success.txt"))
    assert unfinished_saves(workdir), os.listdir(ckpt_dir(workdir))

    before = n_records(workdir)
    assert records(workdir)[-1]["step"] == 8
    # A kill can also land mid-line in metrics.jsonl: the rerun cuts the line off.
    with open(os.path.join(workdir, "metrics.jsonl"), "a") as f:
        f.write('{"step": 9, "loss": 1.2')
    proc = run(workdir, *TINY, "--config.train.steps=12")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "cut off mid-write" in proc.stderr and "Traceback" not in proc.stderr
    assert not unfinished_saves(workdir), "the unfinished save was left behind"
    resumed = records(workdir)[before:]
    assert [r["step"] for r in resumed] == list(range(5, 13)), "did not resume from 4"
    ref = {r["step"]: r for r in records(reference)}
    for r in resumed[:STEPS - 4]:
        assert (r["loss"], r["lr"]) == (ref[r["step"]]["loss"], ref[r["step"]]["lr"]), r
    # tiny's lr 1e-2 times base's min_lr_ratio 0.1: where the 10-step schedule ends.
    tail = [r["lr"] for r in resumed[STEPS - 4:]]
    assert tail[0] == tail[1] == pytest.approx(1e-3, rel=1e-6) and tail[0] < ref[STEPS]["lr"]
    assert "train.steps=12 differs from the 10 steps" in proc.stderr
    assert committed_steps(workdir) == [4, 8, 12]


# ------------------------------------------------------------------- NaN step

NAN_STEP = 6


@pytest.fixture(scope="module")
def nan_skip_run(tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("nan_skip"))
    proc = run(workdir, *TINY, "--config.train.nonfinite=skip", nan_step=NAN_STEP)
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
    proc = run(workdir, *TINY, "--config.train.nonfinite=stop", nan_step=NAN_STEP)
    assert proc.returncode == 1, proc.stderr[-3000:]
    lines = error_lines(proc.stderr)
    assert len(lines) == 1 and f"step {NAN_STEP}" in lines[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert [r["step"] for r in records(workdir)] == list(range(1, NAN_STEP))
    # Only steps before the NaN were saved, and they restore complete and finite.
    assert committed_steps(workdir) == [4]
    states = restore_all(workdir)
    assert sorted(states) == [4] and all_finite(states[4])


def test_nonfinite_limit_stops_after_consecutive_skipped_updates(reference, tmp_path):
    """NaN at steps 3, 5 and 6 with train.nonfinite_limit=2: the lone skip at 3
    is under the limit and training goes on; 5-6 is two in a row: exit 1, one
    line naming step 6 and the limit."""
    workdir = str(tmp_path / "nan_limit")
    proc = run(workdir, *TINY, "--config.train.nonfinite_limit=2", nan_step="3,5,6")
    assert proc.returncode == 1, proc.stderr[-3000:]
    lines = error_lines(proc.stderr)
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "at step 6" in lines[0] and "train.nonfinite_limit=2" in lines[0] \
        and "steps 5-6" in lines[0], lines[0]
    recs = records(workdir)
    assert [r["step"] for r in recs] == [1, 2, 3, 4, 5]
    assert [r["skipped_updates"] for r in recs] == [0, 0, 1, 1, 2]
    assert math.isnan(recs[2]["loss"]) and math.isfinite(recs[3]["loss"])
    ref = losses(records(reference))
    assert [r["loss"] for r in recs[:2]] == [ref[1], ref[2]]
    assert committed_steps(workdir) == [4]


# ------------------------------------------------------ damaged checkpoints

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
    proc = run(workdir, *TINY, "--config.compression.policy=hybrid_paper",
               "--config.train.ef_reset_norm=1e-9", "--config.train.steps=4")
    assert proc.returncode == 0, proc.stderr[-3000:]
    recs = records(workdir)
    assert [r["step"] for r in recs] == [1, 2, 3, 4]
    for r in recs:
        assert r["ef_norm"] > 1e-9 and r["ef_reset"] is True, r
        assert math.isfinite(r["loss"])
    assert recs[-1]["loss"] < recs[0]["loss"], "training did not go on"
    assert "train.ef_reset_norm" in proc.stderr and "residuals reset" in proc.stderr
    state = restore_all(workdir, policy="hybrid_paper")[4]
    import jax
    ef = jax.tree.leaves(state["zero"]["ef"])
    assert ef and all(not np.asarray(x).any() for x in ef)
    assert any(np.asarray(x).any() for x in jax.tree.leaves(state["zero"]["master"]))



# ------------------------------------------------ a second Ctrl-C, SIGTERM early

def test_sighup_before_the_first_step_leaves_no_workdir(tmp_path):
    """A new workdir stopped during setup by SIGHUP (a closed terminal), which stops
    a run as SIGTERM does: exit 0, and nothing of the workdir remains (no lock
    file, no empty checkpoints/, metrics file or TensorBoard run)."""
    workdir = str(tmp_path / "early")
    code, err = signal_when_locked(workdir, signal.SIGHUP, *TINY)
    assert code == 0 and "nothing saved" in err, err[-3000:]
    assert not os.path.exists(workdir), os.listdir(workdir)


def test_sighup_asks_to_stop_as_sigterm_does():
    from jcomp.train.run import faults
    before = signal.getsignal(signal.SIGHUP)
    with faults.StopFlag() as stop:
        assert not stop.requested
        os.kill(os.getpid(), signal.SIGHUP)
        assert stop.requested
    assert signal.getsignal(signal.SIGHUP) == before


# ---------------------------------------------------------- resume mismatch

def test_resume_mismatches_exit_2_before_anything_moves(finished, tmp_path):
    """Against a finished 10-step run: (a) seed, sequence length, batch size and
    data source all changed, while the newest step 10 is incomplete (so the
    restore looks past it to step 8) - one line names all four and step 10 is
    not moved aside; (b) train.steps below the newest checkpoint."""
    text = tmp_path / "other.txt"
    text.write_text("".join(f"line {i} of another corpus\n" for i in range(2000)))
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    shutil.copytree(finished, a)
    shutil.copytree(finished, b)
    os.remove(os.path.join(ckpt_dir(a), "10", "commit_success.txt"))
    cases = {a: ["--config.seed=1", "--config.data.seq_len=16", "--config.train.batch_size=16",
                 f"--config.data.source={text}", "--config.data.val_permille=0"],
             b: ["--config.train.steps=6"]}
    before = {w: snapshot(w) for w in cases}
    procs = {w: start(w, *TINY, *args) for w, args in cases.items()}
    errs = {w: p.communicate(timeout=180)[1] for w, p in procs.items()}
    for w, p in procs.items():
        assert p.returncode == 2, errs[w][-3000:]
        assert snapshot(w) == before[w], f"{w}: the refused run changed its workdir"
    line = only_line(errs[a])
    for named in ("seed=1", "data.seq_len=16", "train.batch_size=16", "other training data",
                  os.path.join(ckpt_dir(a), "8")):
        assert named in line, (named, line)
    line = only_line(errs[b])
    assert "train.steps=6" in line and "step 10" in line and ">= 10" in line, line


# ------------------------------------------------------ write failures

def _mount_tmpfs(path, size):
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    os.makedirs(path, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                       capture_output=True, text=True)
    if r.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip() or r.returncode}")


def _remount(path, options):
    subprocess.run(["mount", "-o", f"remount,{options}", str(path)], check=True)


def _umount(path):
    subprocess.run(["umount", str(path)], capture_output=True)


def _tmpfs_usage(path):
    """Bytes the files under `path` would take on a tmpfs (whole 4 KiB pages)."""
    return sum(-(-os.path.getsize(os.path.join(r, f)) // 4096) * 4096
               for r, _, fs in os.walk(path) for f in fs)


def test_read_only_workdir_exits_2_and_changes_nothing(finished, tmp_path):
    mnt = tmp_path / "ro"
    _mount_tmpfs(mnt, "16m")
    try:
        workdir = str(mnt / "w")
        shutil.copytree(finished, workdir)
        _remount(mnt, "ro")
        before = snapshot(workdir)
        proc = run(workdir, *TINY, timeout=120)
        assert proc.returncode == 2, proc.stderr[-3000:]
        line = only_line(proc.stderr)
        assert "read-only" in line and str(mnt) in line, line
        assert snapshot(workdir) == before
    finally:
        _umount(mnt)


