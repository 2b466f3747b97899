"""benchmarks/codec_time.py: its smallest run end to end and its argument checks."""
import json
import os
import pathlib
import subprocess
import sys

import pytest

pytestmark = pytest.mark.e2e

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ["-m", "benchmarks.codec_time"]
# LLVM optimization level 0 cuts compile time; the (unchecked) step times are slower.
ENV = dict(os.environ, JAX_PLATFORMS="cpu",
           XLA_FLAGS="--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0")


def test_quick_run_times_each_entry_alone_beside_the_baseline_and_the_policy(tmp_path):
    out = tmp_path / "t.json"
    proc = subprocess.run([sys.executable, *SCRIPT, "--quick", "--entries", "data.grad",
                           "tensor.act", "--json", str(out)], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    rows = {r["variant"]: r for r in doc["rows"]}
    assert list(rows) == ["baseline", "whole policy", "only data.grad=int4:rot",
                          "only tensor.act=int4:rot"], list(rows)
    # Each variant compiles the step its name says: the plan of "only X" codes X's
    # messages and nothing else; the baseline codes nothing.
    assert rows["baseline"]["compression"] == "none"
    assert rows["only data.grad=int4:rot"]["compression"] == "data.grad_reduce=int4:rot"
    only_tensor = rows["only tensor.act=int4:rot"]["compression"].split()
    assert only_tensor and all(m.startswith("tensor.") and m.endswith("=int4:rot")
                               for m in only_tensor), only_tensor
    assert "data.grad_reduce=int4:rot" in rows["whole policy"]["compression"]
    assert rows["baseline"]["ratio"] == 1.0 and all(r["median_s"] > 0 for r in rows.values())
    assert "sum of the entries alone" in proc.stdout and doc["policy"] == "hybrid"


def test_an_entry_that_names_no_message_is_refused():
    proc = subprocess.run([sys.executable, *SCRIPT, "--quick", "--entries", "data.act"],
                          cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--entries: 'data.act' names no message" in proc.stderr


def test_codecs_time_each_entry_with_each_codec():
    from benchmarks import codec_time
    from jcomp.gpt import policy as policy_lib
    got = codec_time.variants(policy_lib.preset("hybrid"), ["tensor.act"], ["int4", "nvfp4:rot"])
    assert list(got) == ["baseline", "whole policy", "only tensor.act=int4",
                         "only tensor.act=nvfp4:rot"], list(got)
    assert str(got["only tensor.act=nvfp4:rot"]["tensor", "act"]) == "nvfp4:rot"
    assert str(got["only tensor.act=int4"]["data", "grad"]) == "none"


def test_a_codec_that_does_not_parse_is_refused():
    proc = subprocess.run([sys.executable, *SCRIPT, "--quick", "--codecs", "mxfp6"],
                          cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--codecs: invalid codec spec 'mxfp6'" in proc.stderr
