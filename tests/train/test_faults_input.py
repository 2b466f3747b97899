"""Refusals before training: config files, process flags, workdirs and settings
no step of the run would use. Each case runs the real `train.py` in a
subprocess and must end with exit 2 and one line on stderr naming the problem,
no traceback, and the workdir as it was (same file hashes) or not created at
all. Most are refused before JAX starts; the cases run side by side.
"""
import hashlib
import os
import subprocess
import sys
import time

import numpy as np
import pytest
from tests.train.tinyconfig import tiny_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = ["--config=configs/tiny.py"]
# Cluster variables would make --distributed find a cluster.
_CLUSTER_ENV = ("SLURM_", "OMPI_", "PMI_", "JCOMP_")


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith(_CLUSTER_ENV)}
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
    env["JAX_PLATFORMS"] = "cpu"
    env.update(extra)
    return env


def hashes(path):
    """{relative path: sha256 of a file, or "dir"} under `path`; None if it does not exist."""
    if not os.path.lexists(path):
        return None
    if not os.path.isdir(path):
        with open(path, "rb") as f:
            return {".": hashlib.sha256(f.read()).hexdigest()}
    out = {}
    for root, dirs, files in os.walk(path):
        for d in dirs:
            out[os.path.relpath(os.path.join(root, d), path)] = "dir"
        for name in files:
            p = os.path.join(root, name)
            with open(p, "rb") as f:
                out[os.path.relpath(p, path)] = hashlib.sha256(f.read()).hexdigest()
    return out


def assert_refused(proc_out, named, workdir, before):
    code, err = proc_out
    lines = [l for l in err.splitlines() if l.strip()]
    assert code == 2, (code, err[-3000:])
    assert len(lines) == 1 and lines[0].startswith("train.py: error:"), err[-3000:]
    for n in named:
        assert n in lines[0], (n, lines[0])
    assert "Traceback" not in err
    assert hashes(workdir) == before, "a refused run changed its workdir"
    return lines[0]


def run_side_by_side(cases, timeout=120):
    """{name: (exit code, stderr)} of train.py runs, all started at once."""
    procs = {}
    for name, (workdir, args, env) in cases.items():
        procs[name] = subprocess.Popen(
            [sys.executable, "train.py", f"--workdir={workdir}", *args], cwd=ROOT,
            env=_env(**env), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out = {}
    for name, p in procs.items():
        _, err = p.communicate(timeout=timeout)
        out[name] = (p.returncode, err)
    return out


def _cases(tmp):
    """name -> (workdir, args, extra env, strings the line must name)."""
    fresh = lambda name: str(tmp / name / "w")  # a workdir that does not exist yet
    (tmp / "cfg").mkdir()
    syntax = tmp / "cfg" / "syntax.py"
    syntax.write_text("def get_config(:\n    pass\n")
    raising = tmp / "cfg" / "raising.py"
    raising.write_text("def get_config():\n    raise RuntimeError('no corpus configured')\n")
    a_file = tmp / "a_file"
    a_file.write_text("not a directory\n")
    ckpt_file = tmp / "ckpt_file"
    ckpt_file.mkdir()
    (ckpt_file / "checkpoints").write_text("a file where checkpoints/ goes\n")
    return {
        "config missing": (fresh("c1"), [f"--config={tmp / 'cfg' / 'none.py'}"], {},
                           ["--config=", "none.py", "no such file"]),
        "config syntax error": (fresh("c2"), [f"--config={syntax}"], {},
                                ["--config=", "SyntaxError", "line 1"]),
        "get_config raises": (fresh("c3"), [f"--config={raising}"], {},
                              ["get_config() raised RuntimeError", "no corpus configured"]),
        "unknown field": (fresh("c4"), [*TINY, "--config.train.stepz=3"], {},
                          ["--config.train.stepz", "no field 'stepz'", "did you mean 'steps'"]),
        "process_id >= num_processes": (
            fresh("p1"), [*TINY, "--coordinator_address=127.0.0.1:9", "--num_processes=2",
                          "--process_id=2"], {}, ["--process_id=2", "[0, 2)"]),
        "num_processes without coordinator": (
            fresh("p2"), [*TINY, "--num_processes=2", "--process_id=1"], {},
            ["--num_processes", "--process_id", "--coordinator_address"]),
        "process flags from the environment": (
            fresh("p3"), TINY, {"JCOMP_NUM_PROCESSES": "2", "JCOMP_PROCESS_ID": "1"},
            ["--num_processes", "--coordinator_address"]),
        "distributed without a cluster": (fresh("p4"), [*TINY, "--distributed"], {},
                                          ["--distributed", "no cluster"]),
        "workdir is a file": (str(a_file), TINY, {}, ["--workdir=", "is a file"]),
        "workdir under a file": (str(a_file / "w"), TINY, {}, ["cannot be created", str(a_file)]),
        "checkpoints is a file": (str(ckpt_file), TINY, {},
                                  [str(ckpt_file / "checkpoints"), "is a file"]),
        "compression warm-up past the run": (
            fresh("s1"), [*TINY, "--config.compression.policy=hybrid",
                          "--config.compression.warmup_steps=12"], {},
            ["compression.warmup_steps=12", "train.steps=12", "no step would be compressed"]),
    }


@pytest.mark.e2e
def test_user_errors_exit_2_with_one_line_and_leave_the_workdir_as_it_was(tmp_path):
    cases = _cases(tmp_path)
    before = {name: hashes(c[0]) for name, c in cases.items()}
    results = run_side_by_side({name: c[:3] for name, c in cases.items()})
    failures = []
    for name, (workdir, _, _, named) in cases.items():
        try:
            line = assert_refused(results[name], named, workdir, before[name])
            assert "\\'" not in line and "\\n" not in line, line  # no escaped quoting
        except AssertionError as e:
            failures.append(f"{name}: {e}")
    assert not failures, "\n".join(failures)


@pytest.mark.e2e
def test_a_config_file_returning_none_prints_exactly_one_line(tmp_path):
    """Refused before flag parsing: ml_collections' own warning about a None
    config (two lines of absl logging) never comes."""
    none = tmp_path / "none.py"
    none.write_text("def get_config():\n    pass\n")
    proc = subprocess.run([sys.executable, "train.py", f"--workdir={tmp_path / 'w'}",
                           f"--config={none}"], cwd=ROOT, env=_env(), capture_output=True,
                          text=True, timeout=60)
    assert (proc.returncode, proc.stdout) == (2, "")
    assert proc.stderr == (f"train.py: error: --config={none}: get_config() returned None "
                           "(a missing return statement?), not a ConfigDict\n")
    assert not (tmp_path / "w").exists()


@pytest.mark.e2e
def test_uncreatable_checkpoint_directory_ends_the_run_within_60_s(tmp_path):
    """checkpoints/ cannot be created (a file holds its name): the run is refused
    up front, long before the save that used to fail and then hang at exit."""
    workdir = tmp_path / "w"
    workdir.mkdir()
    (workdir / "checkpoints").write_text("")
    before = hashes(str(workdir))
    t0 = time.monotonic()
    out = run_side_by_side({"w": (str(workdir), [*TINY, "--config.train.steps=4"], {})},
                           timeout=60)["w"]
    assert time.monotonic() - t0 < 60
    assert_refused(out, [str(workdir / "checkpoints")], str(workdir), before)


# In this process: a token source set up as the config check's refusal says
# (the refusals themselves are tested in tests/train/test_runspec.py).

_tiny = tiny_config


def test_token_source_with_empty_tokenizer_loads(tmp_path):
    """What the refusal tells the user to do works."""
    from jcomp.train.settings import runspec
    from jcomp.train import loop as trainer
    path = tmp_path / "tokens.bin"
    np.arange(4096, dtype=np.uint16).__mod__(200).astype(np.uint16).tofile(path)
    cfg = _tiny(**{"data.source": f"tokens:{path}", "data.token_dtype": "uint16",
                   "data.tokenizer": "", "data.val_permille": 0})
    corpus, train, _ = trainer.load_data(runspec.validate(cfg, 8))
    assert len(corpus.train) == 4096
