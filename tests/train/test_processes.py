"""train.py as several processes whose devices share data ranks: a tensor or
pipeline axis crossing processes, as it crosses nodes on a cluster. Each process
loads the batch rows its own devices hold (jcomp.train.run.data.process_rows), and
the run trains exactly as one process over all the devices does.

The runs start side by side in one module fixture (on two cores, compiles and
Python overlap), each bounded by a timeout.
"""
import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

from jcomp.gpt import mesh as mesh_lib

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS = 3
RUN = ["--config=configs/tiny.py", f"--config.train.steps={STEPS}", "--config.train.log_every=1"]
# Pipeline across the 2 processes, tensor inside each, one data rank: every
# process loads the whole batch. No validation split, to spare an eval compile.
PIPE_ACROSS = ["--config.mesh.data=1", "--config.mesh.tensor=4", "--config.mesh.pipeline=2",
               "--config.data.val_permille=0"]
TIMEOUT_S = 400


def _env(devices=None):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    # The same backend flags in every run, so that their programs compute alike.
    env["XLA_FLAGS"] = "--xla_backend_optimization_level=0" + (
        f" --xla_force_host_platform_device_count={devices}" if devices else "")
    return env


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(workdir, processes, *flags):
    """train.py as `processes` processes of 8 / processes CPU devices each."""
    base = [sys.executable, "train.py", f"--workdir={workdir}", *RUN, *flags]
    if processes == 1:
        return [subprocess.Popen(base, cwd=ROOT, env=_env(8), text=True,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE)]
    port = _free_port()
    return [subprocess.Popen([*base, f"--coordinator_address=127.0.0.1:{port}",
                              f"--num_processes={processes}", f"--process_id={i}",
                              f"--cpu_devices={8 // processes}"],
                             cwd=ROOT, env=_env(), text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            for i in range(processes)]


def _records(workdir):
    """step -> the metrics record of that step."""
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return {r["step"]: r for r in map(json.loads, f)}


def train_side_by_side(base, plan):
    """Starts every run of `plan` ({name: (processes, flags)}) at once under `base`;
    -> {name: step -> record}, every process having exited 0."""
    procs = {name: _start(str(base / name), n, *flags) for name, (n, flags) in plan.items()}
    try:
        for name, ps in procs.items():
            for i, p in enumerate(ps):
                _, err = p.communicate(timeout=TIMEOUT_S)
                assert p.returncode == 0, f"{name} process {i}: {err[-3000:]}"
    finally:
        for p in (p for ps in procs.values() for p in ps):
            if p.poll() is None:
                p.kill()
    return {name: _records(str(base / name)) for name in plan}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{name: step -> record} of 1 x 8 and 2 x 4 with PIPE_ACROSS. 4 x 2 on the
    (2, 2, 2) mesh is in experiments/checks/test_processes_long.py."""
    return train_side_by_side(tmp_path_factory.mktemp("processes"),
                              {"one_pipe": (1, PIPE_ACROSS), "two_pipe": (2, PIPE_ACROSS)})


class _FakeDevice:
    """What the mesh reads of a CPU device."""
    platform, device_kind = "cpu", "cpu"

    def __init__(self, i, process):
        self.id, self.process_index = i, process


def _process_grid(shape, processes):
    """process_index of each mesh position [data, tensor, pipeline] when `processes`
    processes hold the 8 devices, as jax.devices() lists them (process by process)."""
    devices = [_FakeDevice(i, i // (8 // processes)) for i in range(8)]
    grid = mesh_lib.make_mesh(shape, devices=devices).devices
    return np.vectorize(lambda d: d.process_index)(grid)


def test_the_layouts_put_data_ranks_across_processes():
    """What the runs below exercise: in 4 x 2 on (2, 2, 2) each data rank spans two
    processes, its pipeline stages; in 2 x 4 on (1, 4, 2) the one data rank spans both."""
    four = _process_grid((2, 2, 2), 4)
    assert (four[:, 0, :] == four[:, 1, :]).all()  # tensor stays inside a process
    assert (four[:, :, 0] != four[:, :, 1]).all()  # pipeline crosses processes
    assert [sorted(set(four[d].flat)) for d in range(2)] == [[0, 1], [2, 3]]
    two = _process_grid((1, 4, 2), 2)
    assert (two[0, :, 0] == 0).all() and (two[0, :, 1] == 1).all(), two


def test_pipeline_across_processes_matches_one_process_bitwise(runs):
    """2 processes x 4 devices, data=1 x tensor=4 x pipeline=2: each process
    loads the whole batch, and the losses are the 1 x 8 run's, bit for bit."""
    one, two = runs["one_pipe"], runs["two_pipe"]
    assert sorted(one) == sorted(two) == list(range(1, STEPS + 1))
    assert [two[s]["loss"] for s in one] == [one[s]["loss"] for s in one]
