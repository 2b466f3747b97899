"""benchmarks/collectives.py: its smallest run end to end, and its argument checks."""
import datetime
import json
import os
import pathlib
import subprocess
import sys

import jax
import pytest

from benchmarks import collectives as bench
from jcomp.meter import wire

ROOT = pathlib.Path(__file__).resolve().parents[2]
OPS = ["psum", "psum_scatter", "all_gather", "ppermute", "all_to_all"]


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    """(JSON document, stdout) of `--quick` on 8 emulated CPU devices."""
    out = tmp_path_factory.mktemp("bench") / "x.json"
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS="--xla_force_host_platform_device_count=8")
    proc = subprocess.run([sys.executable, "-m", "benchmarks.collectives", "--quick", "--json",
                           str(out)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout


@pytest.mark.e2e
def test_quick_run_records_its_setting(quick):
    doc, stdout = quick
    assert doc["jax_version"] == jax.__version__
    assert doc["backend"] == "cpu" and doc["device_count"] == 8
    assert doc["mesh"] == {"data": 2, "tensor": 2, "pipeline": 2}
    assert datetime.datetime.fromisoformat(doc["date"]).tzinfo is not None
    got = {(r["op"], r["codec"]) for r in doc["rows"]}
    assert got == {(op, c) for op in OPS for c in ("none", "int8", "topk:0.1")}
    # The quick size is not 4 MiB per device, so no budget verdict may be claimed.
    assert doc["budget"] is None and "budget: not measured" in stdout
    assert "int8" in stdout and "psum_scatter" in stdout


@pytest.mark.e2e
def test_every_row_sends_bytes_over_its_own_axis(quick):
    doc, _ = quick
    for r in doc["rows"]:
        assert r["bytes_per_device"] > 0, r
        assert set(r["bytes_by_axis"]) == {r["axis"]}, r
        assert sum(r["bytes_by_axis"].values()) == r["bytes_per_device"], r


@pytest.mark.e2e
def test_none_rows_are_the_lax_op(quick):
    doc, _ = quick
    for r in doc["rows"]:
        if r["codec"] == "none":
            assert r["byte_ratio"] == 1.0 and r["rel_err"] == 0.0, r
            assert r["time_ratio"] == 1.0, r


@pytest.mark.e2e
def test_int8_moves_about_a_quarter_of_the_bytes(quick):
    """int8 sends 1 byte per 4-byte element plus a float32 scale per 256-element
    block: (1 + 4/256) / 4 = 0.254 of the float32 op. At 2048 elements per device
    every row an op codes (2048 elements, or 1024 per peer of a 2-device axis) is
    whole blocks, so nothing is padded; 0.35 still holds for the padding of a
    partial block per row at sizes near this one, yet fails for any 16-bit or
    wider payload (>= 0.5)."""
    doc, _ = quick
    int8 = [r for r in doc["rows"] if r["codec"] == "int8"]
    assert len(int8) == len(OPS)
    for r in int8:
        assert r["byte_ratio"] < 0.35, r
        # Test suite bound for int8 on normal data (blockwise absmax, two codings at most).
        assert 0 < r["rel_err"] < 2e-2, r
        # The codes travel as bytes; float32 is only the scales' 4/256 share.
        assert r["bytes_by_dtype"]["u8"] / r["bytes_per_device"] > 0.98, r
        assert r["notes"] == [], r


@pytest.mark.e2e
def test_structured_codecs_move_their_compiled_bytes(quick):
    """PowerSGD sends (m + n) R float32 numbers where lax.pmean sends m n; the
    autoencoder's coded all-reduce sends n/4 numbers per row where lax.psum sends n."""
    doc, stdout = quick
    rows = {r["codec"].split(":")[0]: r for r in doc["structured_rows"]}
    assert set(rows) == {"powersgd", "ae"} and "Structured codecs" in stdout
    m, n = rows["powersgd"]["matrix"]
    assert m * n == 2048
    assert rows["powersgd"]["bytes_per_device"] == (m + n) * 4 * 4
    assert rows["powersgd"]["reference_bytes"] == m * n * 4
    assert rows["ae"]["byte_ratio"] == pytest.approx(0.25)
    # One cold power step on rank-4 + 10% noise: well below a random guess's error.
    assert 0 < rows["powersgd"]["rel_err"] < 0.8
    assert all(r["notes"] == [] for r in rows.values())


@pytest.mark.e2e
def test_ratios_agree_with_the_recorded_figures(quick):
    doc, _ = quick
    base = {r["op"]: r for r in doc["rows"] if r["codec"] == "none"}
    for r in doc["rows"]:
        b = base[r["op"]]
        assert r["byte_ratio"] == pytest.approx(r["bytes_per_device"] / b["bytes_per_device"])
        assert r["time_ratio"] == pytest.approx(r["time_s"] / b["time_s"])
        assert len(r["times_s"]) == doc["repeats"] == 1 and r["time_s"] > 0


def test_a_compressed_program_that_saves_nothing_is_noted():
    widened = wire.Collective(kind="all-gather", dtype="f32", shape=(2, 8), group_size=2,
                              axes=("tensor",), bytes_per_device=32.0, count=1, name="ag",
                              parts=(("f32", (2, 8), 64.0),))
    report = wire.WireReport([widened])
    assert bench.no_saving_note("bf16", 1.0, report) == [
        "sends 1.000x the bytes of the jax.lax op; on the wire: f32"]
    assert bench.no_saving_note("int8", 0.254, report) == []
    assert bench.no_saving_note("none", 1.0, report) == []


def test_mesh_from_the_devices_there_are():
    assert bench.mesh_sizes(8) == (2, 2, 2)
    assert bench.mesh_sizes(1) == (1, 1, 1)
    assert bench.mesh_sizes(4) == (2, 2, 1)
    assert bench.mesh_sizes(12) == (3, 2, 2)
    assert bench.mesh_sizes(24) == (4, 3, 2)
    for n in (2, 3, 6, 16, 24):
        d, t, p = bench.mesh_sizes(n)
        assert d * t * p == n and d >= t >= p


@pytest.mark.parametrize("argv,flag", [
    (["--sizes", "0"], "--sizes"),
    (["--sizes", "3Gi"], "--sizes"),
    (["--codecs", "int3"], "--codecs"),
    (["--ops", "broadcast"], "--ops"),
    (["--repeats", "0"], "--repeats"),
])
def test_bad_arguments_are_refused_by_name(argv, flag, capsys):
    with pytest.raises(SystemExit) as e:
        bench.parse_args(argv)
    assert e.value.code == 2
    assert flag in capsys.readouterr().err


def test_defaults_and_quick_always_include_the_baseline():
    args, _ = bench.parse_args([])
    assert args.sizes == [64 * 1024, 1024 * 1024] and args.repeats == 5
    assert args.codecs[0] == "none" and "randk:0.1" in args.codecs
    args, _ = bench.parse_args(["--codecs", "int4", "INT8", "--sizes", "64Ki", "4096"])
    assert args.codecs == ["none", "int4", "int8"]
    assert args.sizes == [65536, 4096]


def test_budget_is_the_worst_compressed_time_at_4_mib():
    def row(op, codec, ratio, elements=1 << 20, axis_size=2):
        return dict(op=op, codec=codec, time_ratio=ratio, elements=elements,
                    axis_size=axis_size)

    rows = [row("psum", "none", 1.0), row("psum", "int8", 1.5), row("ppermute", "int8", 2.5),
            row("psum", "int4", 1.8), row("psum", "int2", 9.0, elements=1 << 16),
            row("psum", "fp8", 7.0, axis_size=1)]
    b = bench.budget(rows)
    assert (b["max_time_ratio"], b["op"], b["codec"], b["passed"]) == (2.5, "ppermute", "int8", False)
    assert b["by_codec"] == {"int8": dict(time_ratio=2.5, op="ppermute"),
                             "int4": dict(time_ratio=1.8, op="psum")}
    assert bench.budget(rows[:2] + rows[3:])["passed"] is True
    assert bench.budget([row("psum", "int8", 1.5, elements=2048)]) is None
