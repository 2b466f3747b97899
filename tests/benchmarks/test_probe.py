"""benchmarks/probe.py in its smallest form: every figure it names, for each codec,
from one run on CPU; bad arguments exit 2."""
import json
import math
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.e2e

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(*args):
    return subprocess.run([sys.executable, "-m", "benchmarks.probe", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


def test_smallest_form_records_bench_and_probe_figures_per_codec(tmp_path):
    out = tmp_path / "probe.json"
    proc = _run("--mib", "0.25", "--codecs", "bf16", "int8", "--repeats", "1", "--json", str(out))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["backend"] == "cpu" and res["device_count"] == 8
    assert [r["codec"] for r in res["rows"]] == ["bf16", "int8"]
    for r in res["rows"]:
        for src in ("bench", "probe_1", "probe_all"):
            for part in ("encode", "decode"):
                v = r[f"{src}_{part}_gb_s"]
                assert math.isfinite(v) and v > 0, (r["codec"], src, part)
    assert "| `int8` |" in proc.stdout and "probe all 8" in proc.stdout


def test_bad_arguments_exit_2_naming_them():
    proc = _run("--mib", "0")
    assert proc.returncode == 2 and "--mib" in proc.stderr
