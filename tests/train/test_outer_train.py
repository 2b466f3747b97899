"""End-to-end runs of train.py with an outer loop (config.outer, jcomp.train.outer.islands):
metrics, kill -9 and a bitwise resume with a delayed fragment's sync in flight,
and the refusal of a changed outer setting on resume.

The longer forms (the plain and the streamed outer loop killed mid-interval, a
carried start pending at a save, the delayed sync across two processes, a
fragment due after every step) are in
experiments/checks/test_outer_train_long.py."""
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys

import pytest

pytestmark = pytest.mark.e2e  # every test here runs train.py in a subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# H=4, saves at 3, 6 and 8: step 3 is mid-interval (the islands differ there).
OUTER = ["--config=configs/tiny.py", "--config.train.steps=8", "--config.train.log_every=1",
         "--config.checkpoint.every=3", "--config.checkpoint.keep=3",
         "--config.train.eval_every=4", "--config.outer.every=4",
         "--config.outer.codec=randk:0.25", "--config.outer.error_feedback=on"]
# randk draws: each sync's key is a function of its step and fragment
# (outer.sync_key), so the kill-and-resume tests below also check that a
# resumed run draws what the uninterrupted one did (before: a ValueError asking
# for key= at the first sync).


def _env():
    env = dict(os.environ)
    env["XLA_FLAGS"] = ("--xla_force_host_platform_device_count=8 "
                        "--xla_backend_optimization_level=0")  # see conftest.py
    env["JAX_PLATFORMS"] = "cpu"
    return env


def run(workdir, *args, kill_during_save=None, timeout=300):
    program = ([os.path.join("tests", "train", "faultinject.py"),
                f"--kill_during_save={kill_during_save}", "--"]
               if kill_during_save is not None else ["train.py"])
    return subprocess.run([sys.executable, *program, f"--workdir={workdir}", *args], cwd=ROOT,
                          env=_env(), capture_output=True, text=True, timeout=timeout)


def records(workdir):
    """step -> its record; a step logged twice (after a resume) keeps its last."""
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return {r["step"]: r for r in map(json.loads, f)}


def state_digest(workdir, step):
    """The sha256 of a checkpoint's per-array checksums file: equal iff every array
    of the state (params, ZeRO, outer) is bitwise equal."""
    path = os.path.join(workdir, "checkpoints", str(step), "checksums")
    h = hashlib.sha256()
    for root, _, files in sorted(os.walk(path)):
        for name in sorted(files):
            if name != "commit_success.txt":
                with open(os.path.join(root, name), "rb") as f:
                    h.update(f.read())
    return h.hexdigest()


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("outer") / "full")
    proc = run(workdir, *OUTER)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(workdir + ".stdout", "w") as f:
        f.write(proc.stdout)
    return workdir


def test_syncs_are_logged_with_their_bytes_and_time(full):
    """Steps 4 and 8 synced: outer_sync_s, outer_bytes_per_sync (> 0, read from the
    compiled sync) and outer_bytes_per_step = per sync / H; no inner step sends
    anything across islands (no wire_bytes_dcn on the first record); with the
    islands' metrics and the evaluations, every byte across islands per inner
    step is counted on the first record. The start text and the closing line
    say what crosses between islands per step."""
    recs = records(full)
    assert sorted(s for s, r in recs.items() if "outer_sync_s" in r) == [4, 8]
    for s in (4, 8):
        r = recs[s]
        assert r["outer_sync_s"] > 0 and r["outer_bytes_per_sync"] > 0
        assert r["outer_bytes_per_step"] == r["outer_bytes_per_sync"] / 4
        assert "val_loss" in r
    assert recs[1].get("wire_bytes_dcn", 0) == 0 and "wire_bytes_total" in recs[1]
    assert recs[1]["outer_bytes_per_step"] == recs[4]["outer_bytes_per_step"]
    assert recs[1]["outer_state_bytes_per_device"] > 0
    # Every byte across islands per inner step: the syncs, the islands' agreement
    # on each step's metrics, and the evaluations (anchor and islands, every 4 steps).
    first = recs[1]
    assert first["outer_island_bytes_per_step"] > 0 and first["outer_eval_bytes_per_step"] > 0
    assert first["outer_across_bytes_per_step"] == (first["outer_bytes_per_step"]
                                                    + first["outer_island_bytes_per_step"]
                                                    + first["outer_eval_bytes_per_step"])
    with open(full + ".stdout") as f:
        out = f.read()
    from jcomp.train.run.traffic import human
    per_step = human(recs[4]["outer_bytes_per_step"])
    assert f"({per_step} per inner step; the inner step sends 0 B across islands)" in \
        " ".join(out.split()), out
    across = human(first["outer_across_bytes_per_step"])
    assert f"across islands per inner step: {across} per device (syncs {per_step}" in out
    assert f"(+ {across}/step across islands, outer loop)" in out.splitlines()[-1]


def _killed_at_6_resumes_as(full, workdir, flags, keys):
    """kill -9 during the save of step 6, then rerun: steps 4-8 repeat the
    uninterrupted run's `keys` and its final checkpoint bit for bit."""
    proc = run(workdir, *flags, kill_during_save=6)
    assert proc.returncode == -signal.SIGKILL, (proc.returncode, proc.stderr[-2000:])
    again = run(workdir, *flags)
    assert again.returncode == 0, again.stderr[-3000:]
    want, got = records(full), records(workdir)
    for s in range(4, 9):
        for key in keys:
            assert got[s].get(key) == want[s].get(key), (s, key, got[s], want[s])
    assert state_digest(workdir, 8) == state_digest(full, 8)


@pytest.mark.parametrize("args,says", [
    (["--config.outer.codec=int8"], "outer.codec='randk:0.25', this run has outer.codec='int8'"),
    # outer.every=0 with the other outer.* back at their defaults (else they are refused
    # as unused before the checkpoint is read)
    (["--config.outer.every=0", "--config.outer.codec=none", "--config.outer.error_feedback=off"],
     "outer.every=4, this run has outer.every=0"),
])
def test_a_resume_that_changes_an_outer_setting_is_refused(full, tmp_path, args, says):
    workdir = str(tmp_path / "changed")
    shutil.copytree(full, workdir)
    proc = run(workdir, *OUTER, "--config.train.steps=9", *args)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert says in lines[0], lines[0]


def test_a_bad_outer_field_exits_2_with_one_line_and_no_workdir(tmp_path):
    workdir = tmp_path / "w"
    proc = run(str(workdir), "--config=configs/tiny.py", "--config.outer.every=4",
               "--config.outer.fragments=3", timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "outer.fragments=3 does not divide outer.every=4" in lines[0], lines[0]
    assert not workdir.exists()


@pytest.mark.parametrize("args,says", [
    # before: trained with each data rank an island and wrote mesh_dcn_data=0 into the
    # checkpoint, which a resume with a valid value then refused
    (["--config.mesh.dcn_data=0", "--config.outer.every=4", "--config.train.steps=4"],
     "mesh.dcn_data=0; allowed: a divisor of mesh.data=2, 1 or 2"),
    # before: refused only after the workdir's lock and checkpoints/ were made
    (["--config.outer.every=16", "--config.outer.fragments=16", "--config.train.steps=16"],
     "outer.fragments=16: the model has only 2 layers and a fragment is a block of whole "
     "layers; allowed: 1 to 2"),
    (["--config.outer.every=4", "--config.outer.codec=sparseloco", "--config.outer.momentum=0.9"],
     "outer.momentum=0.9 with outer.codec='sparseloco': SparseLoCo takes no outer momentum"),
    # before: accepted and ignored
    (["--config.outer.lr=-1"], "outer.lr=-1.0 applies to an outer loop only"),
])
def test_bad_outer_input_exits_2_before_anything_is_written(tmp_path, args, says):
    """An existing, empty workdir stays empty: no lock file, no checkpoints/."""
    workdir = tmp_path / "w"
    workdir.mkdir()
    proc = run(str(workdir), "--config=configs/tiny.py", *args, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert says in lines[0], lines[0]
    assert os.listdir(workdir) == []


# Fragments by layer (2) with SparseLoCo: H=4, fragment 1 syncs after steps 2, 6,
# fragment 0 after 4, 8; the save at step 3 falls between two fragments' syncs.
STREAM = [*OUTER[:-2], "--config.outer.fragments=2",
          "--config.outer.codec=sparseloco:k=4:chunk=64:beta=0.9"]


def _trained(tmp_path_factory, name, flags):
    """The workdir of an uninterrupted run of train.py with `flags`."""
    workdir = str(tmp_path_factory.mktemp(name) / "full")
    proc = run(workdir, *flags)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return workdir


# The same with a delayed sync (outer.delay=2): fragment 1 starts after step 2 and
# merges after step 4, so the save at step 3 holds a sync in flight.
DELAYED = [*STREAM, "--config.outer.delay=2"]


@pytest.fixture(scope="module")
def delayed(tmp_path_factory):
    return _trained(tmp_path_factory, "delayed", DELAYED)


def test_a_delayed_sync_in_flight_at_a_save_resumes_bit_for_bit(delayed, tmp_path):
    """kill -9 during the save of step 6: resumed from step 3, whose checkpoint was
    written between fragment 1's start (step 2) and its merge (step 4); steps 4-8
    and every array of the final checkpoint repeat bit for bit, and the merges
    land delay steps after their starts."""
    full = delayed
    want = records(full)
    assert [want[s].get("outer_applied") for s in (4, 6, 8)] == [1, 0, 1], want
    assert [want[s].get("outer_started_at") for s in (4, 6, 8)] == [2, 4, 6], want
    # Fragment 1's starts (after steps 2 and 6) ride in steps 3 and 7; fragment 0's,
    # after the evaluated steps 4 and 8, run alone so that val_loss holds them.
    assert {s: r["outer_carried"] for s, r in want.items() if "outer_carried" in r} == \
        {3: 1, 7: 1}, want
    assert {s: r["outer_carried_by"] for s, r in want.items() if "outer_carried_by" in r} == \
        {2: 3, 6: 7}, want
    assert sorted(s for s, r in want.items() if "outer_sync_s" in r) == [4, 8], want
    # On CPU a carried start runs on a thread beside its step's, and is timed there.
    assert sorted(s for s, r in want.items() if r.get("outer_start_s", 0) > 0) == [3, 7], want
    _killed_at_6_resumes_as(full, str(tmp_path / "killed"), DELAYED,
                            ("loss", "grad_norm", "val_loss", "val_loss_islands"))


