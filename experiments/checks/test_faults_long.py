"""The long form of tests/train/test_faults.py: a full disk, a truncated newest
checkpoint, a second Ctrl-C and a checkpoint directory lost mid-run (about 1.5
minutes on two cores)."""
import os
import shutil
import signal
import time

import pytest

from tests.train.test_faults import (STEPS, TINY, TMP_MARK, _mount_tmpfs,  # noqa: F401
                                     _tmpfs_usage, _umount, ckpt_dir, committed_steps,
                                     error_lines, losses, n_records, records, reference,
                                     reference_run, restore_all, run, signal_when_locked,
                                     snapshot, start, truncate_biggest, unfinished_saves)

pytestmark = pytest.mark.e2e


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


def test_second_ctrl_c_exits_130_and_the_next_start_cleans_up(tmp_path):
    """A double Ctrl-C during the save of step 4 ends the run at once: exit 130,
    one line, no traceback, the save left unfinished. The next start removes
    what it left; SIGTERM during that start's setup, before any step, gives
    exit 0 with nothing written."""
    workdir = str(tmp_path / "ctrl_c")
    proc = run(workdir, *TINY, sigint_during_save=4)
    assert proc.returncode == 130, proc.stderr[-3000:]
    line = [l for l in proc.stderr.splitlines() if l.startswith("train.py:")]
    assert len(line) == 1 and "interrupted twice" in line[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "KeyboardInterrupt" not in proc.stderr
    assert committed_steps(workdir) == [] and unfinished_saves(workdir)
    recs = records(workdir)

    code, err = signal_when_locked(workdir, signal.SIGTERM, *TINY)
    assert code == 0, err[-3000:]
    assert "Traceback" not in err and "nothing saved" in err, err[-3000:]
    assert not unfinished_saves(workdir), os.listdir(ckpt_dir(workdir))
    assert committed_steps(workdir) == [] and records(workdir) == recs


def test_disk_full_stops_at_the_failing_save_and_resume_is_exact(reference, tmp_path):
    """The filesystem fills up after step 8 (once step 4 is committed), leaving
    room for half a checkpoint: the save of step 8 fails. The run stops with
    exit 3 and one line saying the disk is full and that step 4 is safe; nothing
    of step 8 is left. With space freed, the same command resumes from step 4
    and repeats the reference bit for bit."""
    # Filled at a fixed point rather than sized beforehand: a checkpoint's page
    # count varies from save to save (orbax's data files), and a tmpfs sized for
    # one and a half of them sometimes failed the first save already.
    sizes = {s: _tmpfs_usage(os.path.join(ckpt_dir(reference), str(s)))
             for s in committed_steps(reference)}
    mnt = tmp_path / "small"
    _mount_tmpfs(mnt, "64m")
    try:
        workdir, filler = str(mnt / "w"), str(mnt / "filler")
        t0 = time.monotonic()
        proc = run(workdir, *TINY, timeout=120, fill_disk_after=8, fill_file=filler,
                   fill_leave=min(sizes.values()) // 2)
        assert time.monotonic() - t0 < 120
        assert proc.returncode == 3, proc.stderr[-3000:]
        lines = error_lines(proc.stderr)
        assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
        saved = {n: _tmpfs_usage(os.path.join(ckpt_dir(workdir), n))
                 for n in os.listdir(ckpt_dir(workdir))}
        assert "disk full" in lines[0] and "last complete checkpoint is step 4" in lines[0], \
            (lines[0], "reference checkpoints", sizes, "here", saved)
        # No step 8 for a resume to find (a temporary directory that late writes
        # kept alive may remain: restore ignores it, the next start deletes it).
        left = [n for n in os.listdir(ckpt_dir(workdir)) if TMP_MARK not in n]
        assert left == ["4"], os.listdir(ckpt_dir(workdir))

        os.remove(filler)
        before = n_records(workdir)
        proc = run(workdir, *TINY)
        assert proc.returncode == 0, proc.stderr[-3000:]
        resumed = records(workdir)[before:]
        assert [r["step"] for r in resumed] == list(range(5, STEPS + 1)), "did not resume from 4"
        full = losses(records(reference))
        assert all(r["loss"] == full[r["step"]] for r in resumed), (resumed, full)
        assert committed_steps(workdir) == [4, 8, 10] and not unfinished_saves(workdir)
    finally:
        _umount(mnt)


def test_checkpoint_directory_lost_mid_run_ends_within_60_s(tmp_path):
    """checkpoints/ replaced by a file after the first step: the save of step 8
    cannot create its directory. The run ends at the next step (exit 3, one
    line naming the step) instead of waiting forever on orbax's threads at exit."""
    workdir = str(tmp_path / "lost")
    # The first save comes 7 steps of at least 0.4 s after the fault's cue.
    proc = start(workdir, *TINY, "--config.checkpoint.every=8", step_sleep=0.4)
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and proc.poll() is None and not (
                os.path.exists(os.path.join(workdir, "metrics.jsonl")) and n_records(workdir)):
            time.sleep(0.02)
        assert proc.poll() is None, "the run ended before the fault"
        shutil.rmtree(ckpt_dir(workdir))
        with open(ckpt_dir(workdir), "w") as f:
            f.write("not a directory\n")
        t0 = time.monotonic()
        _, err = proc.communicate(timeout=60)
        assert time.monotonic() - t0 < 60
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 3, err[-3000:]
    lines = error_lines(err)
    assert len(lines) == 1 and "Traceback" not in err, err[-3000:]
    assert "step 8" in lines[0] and ckpt_dir(workdir) in lines[0], lines[0]
    assert max(r["step"] for r in records(workdir)) < STEPS
