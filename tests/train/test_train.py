"""End-to-end runs of train.py in subprocesses, as users run it.

The runs that do not depend on one another start side by side in one
module-scoped fixture: a run of train.py spends much of its time in Python and
in single-threaded compiles, so on two cores three take little longer than one.
A lost peer of a two-process run is in experiments/checks/test_train_long.py.
"""
import json
import os
import re
import socket
import subprocess
import sys
import time

import pytest


pytestmark = pytest.mark.e2e  # every test here runs train.py in a subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = ["--config=configs/tiny.py", "--config.train.steps=8", "--config.train.log_every=1",
        "--config.checkpoint.every=4", "--config.train.eval_every=8"]


def _env(devices=8):
    env = dict(os.environ)
    env["XLA_FLAGS"] = (f"--xla_force_host_platform_device_count={devices} "
                        "--xla_backend_optimization_level=0")  # see conftest.py
    env["JAX_PLATFORMS"] = "cpu"
    return env


def run(workdir, *args, devices=8, timeout=300):
    return subprocess.run([sys.executable, "train.py", f"--workdir={workdir}", *args],
                          cwd=ROOT, env=_env(devices), capture_output=True, text=True,
                          timeout=timeout)


def start(workdir, *args, env):
    return subprocess.Popen([sys.executable, "train.py", f"--workdir={workdir}", *args],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def finish(procs, timeout):
    """Waits for every process; asserts each exited 0. -> each one's stdout."""
    outs = [p.communicate(timeout=timeout) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    return [out for out, _ in outs]


def losses(workdir):
    """step -> loss; a step logged twice (after a resume) keeps its last value."""
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f)}


def first_record(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return json.loads(f.readline())


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Runs of TINY, side by side: "tiny" (with a profile of steps 2-3, checked
    below) stores its compiled step in the suite's compilation cache; "fresh"
    runs without the cache; "multi" is 2 processes x 4 CPU devices (gloo) on
    the same mesh; "warm", started once tiny is done, loads tiny's step from
    the cache. -> {name: workdir}, each finished with exit 0; what each process
    printed is in WORKDIR.<process>.stdout."""
    base = tmp_path_factory.mktemp("runs")
    dirs = {name: str(base / name) for name in ("tiny", "fresh", "multi", "warm")}
    no_cache = {k: v for k, v in _env().items() if not k.startswith("JAX_PERSISTENT_CACHE")
                and k != "JAX_COMPILATION_CACHE_DIR"}
    port = _free_port()
    procs = {
        "tiny": [start(dirs["tiny"], *TINY, "--config.train.profile_steps=2-3", env=_env())],
        "fresh": [start(dirs["fresh"], *TINY, env=no_cache)],
        "multi": [start(dirs["multi"], *TINY, f"--coordinator_address=127.0.0.1:{port}",
                        "--num_processes=2", f"--process_id={i}", "--cpu_devices=4",
                        env={**_env(4), "XLA_FLAGS": ""}) for i in range(2)],
    }
    def keep(name, outs):
        for i, out in enumerate(outs):
            with open(f"{dirs[name]}.{i}.stdout", "w") as f:
                f.write(out)

    try:
        keep("tiny", finish(procs["tiny"], timeout=400))
        procs["warm"] = [start(dirs["warm"], *TINY, env=_env())]
        for name in ("fresh", "multi", "warm"):
            keep(name, finish(procs[name], timeout=400))
    finally:
        for p in (p for ps in procs.values() for p in ps):
            if p.poll() is None:
                p.kill()
    return dirs


@pytest.fixture(scope="module")
def tiny_run(runs):
    return runs["tiny"]


def test_tiny_trains_and_logs(tiny_run):
    got = losses(tiny_run)
    assert sorted(got) == list(range(1, 9))
    assert got[8] < got[1] - 0.5, got
    rec = first_record(tiny_run)
    for key in ("step", "loss", "lr", "tokens_per_s", "step_time_s", "wire_bytes_data",
                "wire_bytes_tensor", "wire_bytes_pipeline", "param_bytes_per_device",
                "opt_state_bytes_per_device"):
        assert key in rec, key
    with open(os.path.join(tiny_run, "metrics.jsonl")) as f:
        assert any("val_loss" in json.loads(line) for line in f)


def printed(workdir, process=0):
    with open(f"{workdir}.{process}.stdout") as f:
        return f.read()


def start_table(out):
    """{row: {column: cell}} of the table train.py starts with, and the line
    after it; a cell is "-" or "NUMBER UNIT", the comparison column as printed."""
    lines = out.splitlines()
    top = next(i for i, l in enumerate(lines) if l.startswith("Bytes sent per device per step"))
    head = lines[top + 1].split("|")
    columns = head[0].split()[1:] + [c.strip() for c in head[1:]]
    rows = {}
    for line in lines[top + 2:]:
        if not line.startswith("  "):
            return rows, line
        mine, *theirs = line.split("|")
        words, cells = mine.split(), []
        name = " ".join(words[:2]) if words[0] == "2+" else words[0]
        words = words[len(name.split()):]
        while words:
            cells.append(words.pop(0) if words[0] == "-" else f"{words.pop(0)} {words.pop(0)}")
        rows[name] = dict(zip(columns, cells + [t.strip() for t in theirs]))
    raise AssertionError(f"no line after the table:\n{out}")


def test_tiny_run_starts_and_ends_with_the_bytes_of_its_metrics(runs):
    """The start table's axis totals and the closing line's bytes are the
    metrics file's wire_bytes_*, read from the same compiled step; the hybrid
    column is an estimate and says so."""
    from jcomp.train.run.traffic import human
    tiny = runs["tiny"]
    out, rec = printed(tiny), first_record(tiny)
    rows, after = start_table(out)
    assert list(rows) == ["data", "tensor", "pipeline", "2+ axes", "total"], rows
    for axis in ("data", "tensor", "pipeline"):
        assert rows[axis]["total"] == human(rec[f"wire_bytes_{axis}"]), (axis, rows[axis], rec)
    several = sum(v for k, v in rec.items() if k.startswith("wire_bytes_") and "+" in k)
    assert several > 0 and rows["2+ axes"]["total"] == human(several)
    assert rows["total"]["total"] == human(rec["wire_bytes_total"])
    assert rows["data"]["act"] == rows["data"]["act_grad"] == "-"  # no activations over data
    assert rows["total"]["hybrid preset*"].startswith("~")
    assert after.startswith("* estimated from the message plan, not compiled")
    assert "python train.py --config=configs/hybrid.py" in out
    last = json.loads(open(os.path.join(tiny, "metrics.jsonl")).read().splitlines()[-1])
    assert out.splitlines()[-1] == (
        f"step 8: loss {last['loss']:.4f}, val_loss {last['val_loss']:.4f}; "
        f"{human(rec['wire_bytes_total'])}/step sent per device; "
        f"metrics in {os.path.join(tiny, 'metrics.jsonl')}")


def test_only_the_first_process_prints(runs):
    """Of the two processes of a cluster, process 0 prints the table and the
    closing line, process 1 nothing of its own (gloo's connection lines only).
    Gloo writes "[Gloo] Rank N is connected to N peer ranks. Expected number of
    connected peer ranks is : N" piece by piece from several threads, and other
    threads' output lands between any two pieces (seen: "[Gloo] Rank" and its
    number on two lines): process 1's output, its gloo pieces and numbers
    removed, must be blank."""
    gloo = re.compile(r"\[Gloo\] Rank \d+|is connected to \d+ peer ranks\.|"
                      r"Expected number of connected peer ranks is : \d+")
    pieces = re.compile(r"\[Gloo\] Rank|is connected to|peer ranks\.|"
                        r"Expected number of connected peer ranks is :|\d+")
    second = printed(runs["multi"], 1)
    assert not pieces.sub("", second).strip(), second
    first = [l for l in gloo.sub("", printed(runs["multi"], 0)).splitlines() if l.strip()]
    assert sum(l.startswith("Bytes sent per device") for l in first) == 1
    assert first[-1].startswith("step 8: loss ")


def test_a_cached_compilation_meters_and_trains_as_a_fresh_one(runs):
    """The suite shares a persistent compilation cache (conftest.py). A run that
    loads tiny's step from it (tiny_run stored it) and a run without the cache
    read the same bytes from the compiled program and log the same losses."""
    cache = os.environ["JAX_COMPILATION_CACHE_DIR"]
    assert os.listdir(cache), "the suite's compilation cache is empty"
    warm, fresh = runs["warm"], runs["fresh"]
    wire = lambda w: {k: v for k, v in first_record(w).items() if k.startswith("wire_")}
    assert wire(warm) == wire(fresh) and wire(fresh)["wire_bytes_total"] > 0
    assert losses(warm) == losses(fresh)


def test_tiny_run_writes_tensorboard_events_and_a_profile(tiny_run):
    """TensorBoard scalars beside metrics.jsonl hold the same losses, and
    train.profile_steps=2-3 left one jax.profiler trace."""
    import glob

    from tests.train.test_tensorboard_profile import _scalars

    got = _scalars(tiny_run)
    assert got["loss"] == pytest.approx(losses(tiny_run)), got.get("loss")
    assert 8 in got["val_loss"] and "wire_bytes_total" in got
    traces = glob.glob(os.path.join(tiny_run, "profile", "process0", "plugins", "profile", "*",
                                    "*.xplane.pb"))
    assert len(traces) == 1 and os.path.getsize(traces[0]) > 1000, traces


def test_rerun_resumes_and_matches_the_uninterrupted_run(tiny_run, tmp_path):
    """Drop the last checkpoint of a finished run: the same command resumes from
    step 4 and reproduces steps 5..8 bit for bit."""
    import shutil
    workdir = str(tmp_path / "resumed")
    shutil.copytree(tiny_run, workdir)
    shutil.rmtree(os.path.join(workdir, "checkpoints", "8"))
    os.remove(os.path.join(workdir, "metrics.jsonl"))
    proc = run(workdir, *TINY)
    assert proc.returncode == 0, proc.stderr[-3000:]
    resumed, full = losses(workdir), losses(tiny_run)
    assert sorted(resumed) == [5, 6, 7, 8], "did not resume from step 4"
    assert all(resumed[s] == full[s] for s in resumed), (resumed, full)


def test_zero1_optimizer_state_is_split_over_all_devices(tiny_run):
    """Measured from the arrays on device 0: master copy + two Adam moments of the
    whole model, divided by the 8 devices, up to the leaves that are replicated
    over tensor or pipeline (LayerNorms, row-parallel biases, the embedding over
    pipeline) and the per-leaf padding to whole codec blocks."""
    rec = first_record(tiny_run)
    params_total = 4 * _n_params_tiny()
    expected = 3 * params_total / 8
    assert expected <= rec["opt_state_bytes_per_device"] <= 1.6 * expected, rec


def _n_params_tiny():
    d, f, n, v = 32, 64, 2, 256
    layer = 4 * d + 3 * d * d + 3 * d + d * d + d + d * f + f + f * d + d
    return v * d + n * layer + 2 * d


@pytest.fixture(scope="module")
def policies(tmp_path_factory):
    """One step of tiny at d_model 64 as baseline and as hybrid, side by side
    (independent: together they take the time of one). -> {policy: (workdir,
    what it printed)}."""
    base = tmp_path_factory.mktemp("policies")
    # d_model 64: at tiny's 32 the block padding and f32 scales of the many small
    # arrays (biases, norms) take the ratio past a quarter (0.27).
    small = ["--config=configs/tiny.py", "--config.train.steps=1", "--config.optim.warmup_steps=0",
             "--config.train.eval_every=100", "--config.model.d_model=64",
             "--config.model.d_ff=256"]
    procs = {name: start(str(base / name), *small, f"--config.compression.policy={name}",
                         env=_env()) for name in ("baseline", "hybrid")}
    try:
        return {name: (str(base / name), finish([proc], timeout=300)[0])
                for name, proc in procs.items()}
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()


def test_hybrid_cuts_data_axis_traffic_to_a_quarter(policies):
    """Measured by the byte meter on the compiled step and written to metrics."""
    base = first_record(policies["baseline"][0])["wire_bytes_data"]
    hybrid = first_record(policies["hybrid"][0])["wire_bytes_data"]
    assert hybrid <= base / 4, (hybrid, base)
    # val_loss is the exact forward's; a policy that codes forward activations also
    # reports the loss through them, and here int4:rot moves it.
    last = {n: json.loads(open(os.path.join(w, "metrics.jsonl")).read().splitlines()[-1])
            for n, (w, _) in policies.items()}
    assert "val_loss" in last["baseline"] and "val_loss_compressed" not in last["baseline"]
    h = last["hybrid"]
    assert all(0 < h[k] < 10 for k in ("val_loss", "val_loss_compressed")), h
    assert h["val_loss_compressed"] != h["val_loss"], h


def _mb(cell):
    """'~1.56 MB (0.16x)' -> 1.56e6."""
    number, unit = cell.lstrip("~").split()[:2]
    return float(number) * {"B": 1, "kB": 1e3, "MB": 1e6, "GB": 1e9}[unit]


def test_the_plans_estimates_come_within_a_tenth_of_the_compiled_steps(policies):
    """Each run shows the other policy's bytes estimated from the message plan:
    the baseline run the hybrid preset's, the hybrid run the uncompressed
    step's, in its start table and closing line. Each lies within 10% of what
    the other run's compiled step sends (the estimate leaves out the ZeRO
    layout's padding of small leaves to whole codec blocks)."""
    from jcomp.train.run.traffic import human
    (b_dir, b_out), (h_dir, h_out) = policies["baseline"], policies["hybrid"]
    b_total = first_record(b_dir)["wire_bytes_total"]
    h_total = first_record(h_dir)["wire_bytes_total"]
    guess = _mb(start_table(b_out)[0]["total"]["hybrid preset*"])
    assert abs(guess / h_total - 1) < 0.1, (guess, h_total)
    raw = start_table(h_out)[0]["total"]["uncompressed*"]
    assert abs(_mb(raw) / b_total - 1) < 0.1, (raw, b_total)
    closing = re.fullmatch(r"step 1: loss [0-9.]+, val_loss [0-9.]+; (.+)/step sent per device, "
                           r"~([0-9.]+)x the uncompressed (.+) \(estimated from the message "
                           r"plan\); metrics in .+", h_out.splitlines()[-1])
    assert closing, h_out.splitlines()[-1]
    assert closing[1] == human(h_total) and closing[3] == raw.lstrip("~").split(" (")[0]
    assert float(closing[2]) == pytest.approx(h_total / _mb(raw), abs=0.01)


BAD = [
    ("--config.mesh.data=3", "mesh"),
    ("--config.train.batch_size=6", "train.batch_size"),
    ("--config.model.n_layers=3", "model.n_layers"),
    ("--config.model.n_heads=3", "model"),
    ("--config.compression.tensor.act=int3", "compression.tensor.act"),
    ("--config.compression.policy=fancy", "compression.policy"),
    ("--config.optim.lr=-0.1", "optim.lr"),
    ("--config.data.source=/no/such/corpus.txt", "data.source"),
    ("--config.data.seq_len=64", "data.seq_len"),
    ("--config.train.nonfinite=ignore", "train.nonfinite"),
    ("--config.optim.name=lion", "optim.name"),
    ("--config.compression.data.act=int8", "compression.data.act"),
    ("--config.seed=9223372036854775808", "seed must be <= 9223372036854775807"),
    ("--config.seed=-1", "seed must be >= 0"),
    ("--config.data.source=", "data.source='' names no corpus"),
    ("--config.data.source=text:", "data.source='text:' names no corpus"),
    ("--config.mesh.dcn_data=3", "mesh.dcn_data=3 does not divide mesh.data=2"),
    ("--config.compression.dcn.grad=int4", "needs mesh.dcn_data > 1"),
]


@pytest.mark.parametrize("arg,field", BAD)
def test_invalid_config_exits_2_with_one_line(tmp_path, arg, field):
    workdir = tmp_path / "w"
    proc = run(str(workdir), "--config=configs/tiny.py", arg, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [l for l in proc.stderr.splitlines() if l.strip()]
    assert len(lines) == 1, proc.stderr
    assert field in lines[0] and "Traceback" not in proc.stderr
    assert field.startswith("data.source") or "data.source" not in lines[0], lines[0]
    assert not workdir.exists(), "a rejected run must not create its workdir"


def test_two_hops_meter_the_slow_hop_and_a_resume_cannot_change_them(tmp_path):
    """tiny with its data axis split into two slow-hop groups (mesh.dcn_data=2 on
    data 4 x tensor 2): metrics.jsonl has wire_bytes_dcn beside wire_bytes_data
    and the start table a dcn row of those bytes. A rerun with dcn_data=4, whose
    state would fit the checkpoint's arrays, is refused in one line (exit 2)."""
    from jcomp.train.run.traffic import human
    workdir = str(tmp_path / "w")
    split = ["--config=configs/tiny.py", "--config.train.steps=3", "--config.checkpoint.every=3",
             "--config.train.eval_every=3", "--config.mesh.data=4", "--config.mesh.pipeline=1",
             "--config.compression.dcn.grad=int4:rot"]
    proc = run(workdir, *split, "--config.mesh.dcn_data=2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rec = first_record(workdir)
    assert rec["wire_bytes_dcn"] > 0 and rec["wire_bytes_data"] > 0, rec
    assert rec["compression"] == "dcn.grad_reduce_dcn=int4:rot"
    rows, _ = start_table(proc.stdout)
    assert list(rows)[:2] == ["dcn", "data"], rows
    assert rows["dcn"]["total"] == human(rec["wire_bytes_dcn"])
    assert rows["data"]["total"] == human(rec["wire_bytes_data"])
    again = run(workdir, *split, "--config.mesh.dcn_data=4", "--config.train.steps=4")
    assert again.returncode == 2, again.stderr[-3000:]
    lines = [l for l in again.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and "Traceback" not in again.stderr, again.stderr
    assert "written for mesh.dcn_data=2, this run has mesh.dcn_data=4" in lines[0], lines[0]


def test_two_processes_match_one(runs):
    """2 processes x 4 CPU devices (gloo) give the 1 x 8 run's losses, same mesh and config."""
    multi, single = losses(runs["multi"]), losses(runs["tiny"])
    assert sorted(multi) == sorted(single)
    for s in single:
        assert abs(multi[s] - single[s]) <= 1e-5 * abs(single[s]), (s, multi[s], single[s])


def _cluster(workdir, port, extra_by_process, *flags):
    env = {**_env(4), "XLA_FLAGS": ""}
    return [subprocess.Popen([sys.executable, "train.py", f"--workdir={workdir}", *TINY,
                              f"--coordinator_address=127.0.0.1:{port}", "--num_processes=2",
                              f"--process_id={i}", "--cpu_devices=4", *flags, *extra],
                             cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE)
            for i, extra in enumerate(extra_by_process)]


def test_processes_given_different_configs_are_refused_before_anything_is_written(tmp_path):
    """Process 1 with another optim.lr and train.steps: both processes exit 2 with
    the same one line naming process 1 and both fields with both values, and the
    workdir is never created (no process trains apart, none waits at the end)."""
    workdir = tmp_path / "w"
    procs = _cluster(str(workdir), _free_port(),
                     [[], ["--config.optim.lr=0.001", "--config.train.steps=9"]])
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (_, err) in zip(procs, outs):
        lines = [l for l in err.splitlines() if l.strip()]
        assert p.returncode == 2 and len(lines) == 1, err[-3000:]
        assert ("process 1 differs from process 0 in optim.lr (0.01 on process 0, 0.001 on "
                "process 1), train.steps (8 on process 0, 9 on process 1)") in lines[0], lines[0]
    assert not workdir.exists()


def test_a_cluster_that_never_forms_ends_in_one_line_within_init_timeout(tmp_path):
    """Only process 0 of 2 starts (a node that did not come up, a wrong port)."""
    workdir = tmp_path / "w"
    [proc] = _cluster(str(workdir), _free_port(), [[]], "--init_timeout=3")
    t0 = time.monotonic()
    _, err = proc.communicate(timeout=120)
    lines = [l for l in err.splitlines() if l.strip()]
    assert proc.returncode == 2 and len(lines) == 1, err[-3000:]
    assert "did not form within --init_timeout=3 s" in lines[0], lines[0]
    assert time.monotonic() - t0 < 3 + 30 and not workdir.exists()
