"""The long form of tests/train/test_train.py: a lost peer of a two-process
run ends the survivor in one line, and the rerun resumes bit for bit (the
suite's runs, then two more two-process runs, about 3 minutes on two cores)."""
import os
import subprocess
import sys
import time

import pytest

from jcomp.train.run import checkpoint
from tests.train.test_train import (ROOT, TINY, _env, _free_port, finish, losses,  # noqa: F401
                                    runs)

pytestmark = pytest.mark.e2e


def test_a_lost_peer_ends_the_survivor_in_one_line_and_the_rerun_resumes_bitwise(runs, tmp_path):
    """2 processes x 4 devices as in "multi"; process 1 is killed (kill -9) after
    step 5, past the checkpoint of step 4. Process 0 exits within --peer_timeout
    (plus the time to notice) with exit 4 and one line naming process 1 and the
    last complete checkpoint, and nothing of JAX's C++ log on its stderr (that
    goes to WORKDIR/process0.log). Rerunning both processes with the same command
    resumes from that checkpoint and reproduces "multi"'s losses bit for bit."""
    workdir = str(tmp_path / "lost")
    port = _free_port()
    cmd = lambda i, *extra: [sys.executable, "tests/train/faultinject.py", *extra, "--",
                             f"--workdir={workdir}", *TINY,
                             f"--coordinator_address=127.0.0.1:{port}", "--num_processes=2",
                             f"--process_id={i}", "--cpu_devices=4", "--peer_timeout=5"]
    env = {**_env(4), "XLA_FLAGS": ""}
    procs = [subprocess.Popen(cmd(i, "--step_sleep=1.0"), cwd=ROOT, env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for i in range(2)]
    try:
        deadline = time.monotonic() + 300
        path = os.path.join(workdir, "metrics.jsonl")
        # The save of step 4 commits in the background: on a loaded machine it can
        # end after step 5, so the kill waits for its marker too.
        saved = os.path.join(workdir, "checkpoints", "4", checkpoint.COMMIT_MARKER)
        while time.monotonic() < deadline and procs[1].poll() is None:
            if (os.path.exists(path) and max(losses(workdir), default=0) >= 5
                    and os.path.exists(saved)):
                break
            time.sleep(0.1)
        procs[1].kill()
        t0 = time.monotonic()
        _, err = procs[0].communicate(timeout=120)
        waited = time.monotonic() - t0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert procs[0].returncode == 4, err[-3000:]
    assert waited < 5 + 30, waited
    lines = [l for l in err.splitlines() if l.startswith("train.py:")]
    assert len(lines) == 1 and "process 1 of the cluster was lost" in lines[0], err[-3000:]
    assert "last complete checkpoint is step 4" in lines[0], lines[0]
    assert "process0.log" in lines[0] and "Check failure" not in err and "Traceback" not in err
    assert "Terminating process" in open(os.path.join(workdir, "process0.log")).read()

    port = _free_port()
    rerun = [subprocess.Popen(cmd(i), cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE) for i in range(2)]
    finish(rerun, timeout=400)
    got, want = losses(workdir), losses(runs["multi"])
    assert sorted(got) == sorted(want) and all(got[s] == want[s] for s in want), (got, want)
