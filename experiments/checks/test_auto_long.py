"""The long form of tests/train/test_auto.py: two processes decide as one, with
an outer loop allowed and under a signal during the trial (about 1.5 minutes
on two cores)."""
import os
import subprocess
import sys

import pytest

from tests.train import test_auto as auto
from jcomp.train.auto import pick as autopick
from tests.train.test_auto import ROOT, TINY, _auto_records, _records


@pytest.mark.e2e
def test_a_signal_during_the_trial_of_two_processes_is_answered_within_seconds(tmp_path):
    auto.test_a_signal_during_the_trial_is_answered_within_seconds(tmp_path, 2)


@pytest.mark.e2e
def test_two_processes_allowed_an_outer_loop_weigh_it_and_train_with_the_route_taken(tmp_path):
    """2 processes x 4 CPU devices, the probe at start, compression.budget
    'outer=4': the routes weighed are the mesh as given, per hop and the outer
    loop across the two processes, and the run trains on the route the rule
    takes (on this loopback the link between processes is fast, so which one
    depends on the probe: under the outer loop the run syncs every 4 steps,
    otherwise never)."""
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    workdir = str(tmp_path / "w")
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=(
        "--xla_force_host_platform_device_count=4 --xla_backend_optimization_level=0"))
    flags = [*TINY, "--config.train.steps=8", "--config.mesh.data=4", "--config.mesh.pipeline=1",
             "--config.compression.budget=outer=4", "--config.checkpoint.every=8",
             "--config.train.eval_every=8"]
    procs = [subprocess.Popen([sys.executable, "train.py", f"--workdir={workdir}", *flags,
                               f"--coordinator_address=127.0.0.1:{port}", "--num_processes=2",
                               f"--process_id={i}", "--cpu_devices=4"],
                              cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE) for i in range(2)]
    outs = [p.communicate(timeout=400) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    [decision] = _auto_records(workdir)
    name = "outer loop (every 4, mesh.dcn_data=2)"
    routes = {k: v["seconds"] for k, v in decision["routes"].items()}
    assert set(routes) == {"as given", "per hop (mesh.dcn_data=2)", name}
    every_step = min(routes["as given"], routes["per hop (mesh.dcn_data=2)"])
    outer = routes[name] < (1 - autopick.OUTER_GAIN) * every_step
    assert bool(decision.get("outer")) == outer and decision["seconds"] == (
        routes[name] if outer else every_step)
    synced = [r["step"] for r in _records(workdir) if "outer_fragment" in r]
    assert synced == ([4, 8] if outer else [])
    assert f"route {name}: " in outs[0][0]
