"""benchmarks/gpu.py --tiny: its smallest form runs on CPU and measures what it names."""
import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.e2e

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_tiny_form_runs_on_cpu_and_records_every_part(tmp_path):
    out = tmp_path / "gpu.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu", "--tiny", "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["backend"] == "cpu" and res["device_count"] == 8
    by_codec = {r["codec"]: r for r in res["codecs"]}
    assert set(by_codec) == {"bf16", "int8"}
    n = by_codec["int8"]["elements"]
    assert n == (1 << 20) // 4
    # int8 with a float32 scale per 256 elements: 1 + 4/256 bytes per element.
    assert by_codec["int8"]["wire_bytes"] == n + 4 * n // 256
    assert by_codec["bf16"]["wire_bytes"] == 2 * n
    assert 0 < by_codec["int8"]["rel_err"] < 0.02 and 0 < by_codec["bf16"]["rel_err"] < 0.01
    for r in res["codecs"]:
        assert r["encode_gb_s"] == 4 * n / r["encode_s"] / 1e9 and r["decode_gb_s"] > 0
    # The H100 compile's psum, timed beside its prediction (jcomp.tune.compiled).
    psum = {r["codec"]: r for r in res["psum"]["rows"]}
    assert set(psum) == {"none", "bf16", "int8"} and res["psum"]["devices"] == 8
    assert all(r["time_s"] > 0 and r["predicted_psum_s"] > 0 for r in psum.values())
    assert psum["none"]["predicted_codec_s"] == 0 < psum["int8"]["predicted_codec_s"]
    col = res["collectives"]
    assert col["mesh"] == {"data": 2, "tensor": 2, "pipeline": 2}
    rows = {(r["op"], r["codec"]): r for r in col["rows"]}
    assert set(rows) == {(op, c) for op in ("psum", "all_gather") for c in ("none", "bf16", "int8")}
    for op in ("psum", "all_gather"):
        assert rows[op, "none"]["byte_ratio"] == 1.0 and rows[op, "none"]["rel_err"] == 0.0
        assert 0.2 < rows[op, "int8"]["byte_ratio"] < 0.3, rows[op, "int8"]
        assert rows[op, "int8"]["time_s"] > 0
    (train,) = res["train"]
    assert train["policy"] == "baseline" and train["devices"] == 8
    assert 0 < train["median_step_s"] < train["wall_s"] and train["wire_bytes_per_device"] > 0
