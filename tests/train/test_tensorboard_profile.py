"""TensorBoard event files beside metrics.jsonl, and train.profile_steps' trace."""
import glob
import os
import struct
import subprocess
import sys

import pytest

from jcomp.train.run import metrics

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _env():
    env = dict(os.environ)
    env["XLA_FLAGS"] = ("--xla_force_host_platform_device_count=8 "
                        "--xla_backend_optimization_level=0")  # see conftest.py
    env["JAX_PLATFORMS"] = "cpu"
    return env


def _scalars(logdir):
    """{tag: {step: value}} read back from the TFRecord event files in `logdir`."""
    from tensorboardX.proto import event_pb2
    out = {}
    for path in glob.glob(os.path.join(logdir, "events.out.tfevents.*")):
        with open(path, "rb") as f:
            data = f.read()
        pos = 0
        while pos < len(data):
            (length,) = struct.unpack("<Q", data[pos:pos + 8])
            event = event_pb2.Event.FromString(data[pos + 12:pos + 12 + length])
            pos += 12 + length + 4  # length, its crc, the record, its crc
            for v in event.summary.value:
                out.setdefault(v.tag, {})[event.step] = v.simple_value
    return out


def test_writer_puts_numeric_metrics_in_tensorboard(tmp_path):
    with metrics.MetricsWriter(tmp_path, tensorboard=True) as w:
        w.write({"step": 1, "loss": 2.5, "compressed": True, "compression": "int8"})
        w.write({"step": 2, "loss": float("nan"), "lr": 1e-3})
    got = _scalars(tmp_path)
    assert got["loss"][1] == 2.5 and got["lr"][2] == pytest.approx(1e-3)
    assert got["loss"][2] != got["loss"][2], "NaN must stay NaN"
    assert "compression" not in got and "compressed" not in got and "step" not in got
    assert [r["step"] for r in metrics.read_metrics(tmp_path)] == [1, 2]


@pytest.mark.e2e
def test_a_bad_profile_spec_is_refused_before_the_workdir(tmp_path):
    """(The files a run writes are checked on test_train.py's tiny run.)"""
    bad = tmp_path / "bad"
    proc = subprocess.run(
        [sys.executable, "train.py", f"--workdir={bad}", "--config=configs/tiny.py",
         "--config.train.profile_steps=9-20"],
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [l for l in proc.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and "train.profile_steps" in lines[0], proc.stderr
    assert not bad.exists()
