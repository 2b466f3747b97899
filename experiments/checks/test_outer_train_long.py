"""The long forms of tests/train/test_outer_train.py: train.py with an outer
loop killed mid-interval (plain and streamed by fragments), a save with a
carried start pending, the delayed sync across two processes, and a
fragment falling due after every step. Each trains one to three runs of its
own (about 6 minutes on two cores in all); the suite keeps the delayed,
streamed run killed with a sync in flight."""
import signal
import subprocess
import sys

import pytest

from tests.train.test_outer_train import (DELAYED, OUTER, ROOT, STREAM, _env,  # noqa: F401
                                          _killed_at_6_resumes_as, _trained, delayed, full,
                                          records, run, state_digest)

pytestmark = pytest.mark.e2e


def test_kill_mid_interval_resumes_bit_for_bit(full, tmp_path):
    """kill -9 during the save of step 6: the rerun resumes from step 3 (mid-interval:
    H=4, the islands differ and carry error-feedback residuals) and repeats
    steps 4-8, syncs included, bit for bit: losses, gradient norms, validation
    losses and every array of the final checkpoint."""
    _killed_at_6_resumes_as(full, str(tmp_path / "killed"), OUTER,
                            ("loss", "grad_norm", "val_loss"))


@pytest.fixture(scope="module")
def stream(tmp_path_factory):
    return _trained(tmp_path_factory, "stream", STREAM)


def test_fragments_log_the_global_val_loss_beside_the_islands(stream):
    """Each eval records val_loss (the anchor's) and val_loss_islands; at step 4
    only fragment 0 has just synced, so the two differ."""
    recs = records(stream)
    assert sorted(s for s, r in recs.items() if "outer_sync_s" in r) == [2, 4, 6, 8]
    assert [recs[s]["outer_fragment"] for s in (2, 4, 6, 8)] == [1, 0, 1, 0]
    for s in (4, 8):
        assert "val_loss_islands" in recs[s] and recs[s]["val_loss"] != recs[s]["val_loss_islands"]


def test_stream_killed_mid_round_resumes_bit_for_bit(stream, tmp_path):
    """kill -9 during the save of step 6: resumed from step 3 (fragment 1 synced
    at step 2, fragment 0 not yet; SparseLoCo's residuals in flight), steps 4-8
    repeat bit for bit, and so does every array of the final checkpoint."""
    _killed_at_6_resumes_as(stream, str(tmp_path / "killed"), STREAM,
                            ("loss", "grad_norm", "val_loss", "val_loss_islands"))


def test_a_delayed_sync_across_two_processes_trains_as_in_one(delayed, tmp_path):
    """The same run as 2 processes x 4 CPU devices, an island each
    (mesh.dcn_data=2), saving once: the starts after steps 2 and 6 overlap steps
    3 and 7 on a thread of their own in each process, and every loss matches
    the one-process run's."""
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    workdir = str(tmp_path / "two")
    env = dict(_env(), XLA_FLAGS=("--xla_force_host_platform_device_count=4 "
                                  "--xla_backend_optimization_level=0"))
    procs = [subprocess.Popen([sys.executable, "train.py", f"--workdir={workdir}", *DELAYED,
                               "--config.checkpoint.every=8", "--config.mesh.dcn_data=2",
                               f"--process_id={i}", f"--coordinator_address=127.0.0.1:{port}",
                               "--num_processes=2", "--cpu_devices=4"],
                              cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE) for i in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    want, got = records(delayed), records(workdir)
    assert sorted(s for s, r in got.items() if r.get("outer_start_s", 0) > 0) == [3, 7], got
    for s in range(1, 9):
        for key in ("loss", "val_loss", "val_loss_islands"):
            if key in want[s]:
                assert got[s][key] == pytest.approx(want[s][key], rel=1e-5), (s, key)


def test_a_save_with_a_carried_start_pending_resumes_bit_for_bit(tmp_path):
    """Saves every 2 steps: the save at step 2 falls between fragment 1's start
    falling due (after step 2) and step 3, whose program carries it; the
    checkpoint records it (outer_pending) and the resumed run's step 3 carries it.
    kill -9 during the save of step 4: steps 3-8 and the final checkpoint repeat
    the uninterrupted run's bit for bit."""
    flags = [*DELAYED, "--config.checkpoint.every=2"]
    full = str(tmp_path / "full")
    proc = run(full, *flags)
    assert proc.returncode == 0, proc.stderr[-3000:]
    killed = str(tmp_path / "killed")
    proc = run(killed, *flags, kill_during_save=4)
    assert proc.returncode == -signal.SIGKILL, (proc.returncode, proc.stderr[-2000:])
    again = run(killed, *flags)
    assert again.returncode == 0, again.stderr[-3000:]
    want, got = records(full), records(killed)
    assert got[3].get("outer_carried") == 1, got[3]
    for s in range(3, 9):
        for key in ("loss", "grad_norm", "val_loss", "val_loss_islands", "outer_carried"):
            assert got[s].get(key) == want[s].get(key), (s, key, got[s], want[s])
    assert state_digest(killed, 8) == state_digest(full, 8)


def test_a_fragment_due_every_step_with_a_delay_trains(tmp_path):
    """outer.every=2, 2 fragments, delay 1: a start falls due after every step,
    the first after step 1, before the start table (before: an IndexError
    reading that sync's bytes, which were not compiled yet). Each start is
    carried by the next step and merged after it; after the evaluated steps 4
    and 8 it runs alone."""
    workdir = str(tmp_path / "w")
    proc = run(workdir, *OUTER[:-2], "--config.outer.every=2", "--config.outer.fragments=2",
               "--config.outer.delay=1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    recs = records(workdir)
    assert [recs[s]["outer_fragment"] for s in range(1, 9)] == [1, 0] * 4
    assert [recs[s].get("outer_applied") for s in range(1, 9)] == [None] + [1, 0] * 3 + [1]
    sent = {(recs[s]["outer_fragment"], recs[s]["outer_bytes_per_sync"]) for s in range(1, 9)}
    assert len(sent) == 2 and all(b > 0 for _, b in sent), sent  # one value per fragment
    assert {s: r["outer_carried"] for s, r in recs.items() if "outer_carried" in r} == \
        {2: 1, 3: 0, 4: 1, 6: 1, 7: 0, 8: 1}
    assert sorted(s for s, r in recs.items() if "outer_sync_s" in r) == [4, 8]
