"""Tests for jcomp.train.run.metrics: the JSON-lines log, human units, progress bar and plots."""
import io
import json
import math
import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from jcomp.train.run.metrics import (
    METRICS_FILE,
    MetricsWriter,
    Progress,
    human_bytes,
    metrics_path,
    plot,
    read_metrics,
    series,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _write_run(directory, losses, val=None):
    os.makedirs(directory, exist_ok=True)
    with MetricsWriter(directory) as log:
        for step, loss in enumerate(losses):
            log.write({"step": step, "loss": loss})
        for step, v in (val or {}).items():
            log.write({"step": step, "val_loss": v})
    return os.path.join(directory, METRICS_FILE)


# ------------------------------------------------------------------ writer and reader


def test_roundtrip_converts_scalars_and_keeps_nonfinite(tmp_path):
    rec = {
        "step": np.int64(3),
        "loss": jnp.float32(2.5),
        "lr": np.float32(1e-3),
        "tokens": jnp.int32(4096),
        "nan": float("nan"),
        "inf": np.float32("inf"),
        "ninf": jnp.array(-jnp.inf),
        "ok": np.bool_(True),
        "note": "warmup",
        "none": None,
        "one": np.array([7.0]),
    }
    with MetricsWriter(tmp_path) as log:
        log.write(rec)
        log.write({"step": 4, "loss": 2.25})
    (got, second) = read_metrics(tmp_path)
    assert got["step"] == 3 and type(got["step"]) is int
    assert got["tokens"] == 4096 and type(got["tokens"]) is int
    assert got["loss"] == 2.5 and type(got["loss"]) is float
    assert got["lr"] == float(np.float32(1e-3))
    assert math.isnan(got["nan"]) and got["inf"] == math.inf and got["ninf"] == -math.inf
    assert got["ok"] is True and got["note"] == "warmup" and got["none"] is None and got["one"] == 7.0
    assert second == {"step": 4, "loss": 2.25}


def test_lines_are_strict_json_and_flushed(tmp_path):
    log = MetricsWriter(tmp_path / "m.jsonl")
    log.write({"step": 1, "loss": float("nan"), "g": -math.inf})
    # Read before close: each line is on disk as soon as it is written.
    lines = (tmp_path / "m.jsonl").read_text().splitlines()
    log.close()
    assert lines == ['{"step": 1, "loss": "NaN", "g": "-Infinity"}']
    reject = lambda token: (_ for _ in ()).throw(ValueError(token))
    json.loads(lines[0], parse_constant=reject)  # strict: no bare NaN/Infinity


def test_writer_appends_across_reopen(tmp_path):
    for step in (1, 2):
        with MetricsWriter(tmp_path / "run") as log:  # a run directory that does not exist yet
            log.write({"step": step})
    assert read_metrics(tmp_path / "run") == [{"step": 1}, {"step": 2}]
    assert metrics_path(tmp_path / "run") == str(tmp_path / "run" / METRICS_FILE)


def test_reader_accepts_bare_nonfinite_tokens(tmp_path):
    f = tmp_path / "py.jsonl"
    f.write_text('{"loss": NaN, "x": Infinity}\n\n{"loss": -Infinity}\n')
    a, b = read_metrics(f)
    assert math.isnan(a["loss"]) and a["x"] == math.inf and b["loss"] == -math.inf


def test_reader_names_file_and_line_of_bad_lines(tmp_path):
    f = tmp_path / "bad.jsonl"
    f.write_text('{"step": 1}\n{"step": 2, "lo\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: not valid JSON"):
        read_metrics(f)
    f.write_text("[1, 2]\n")
    with pytest.raises(ValueError, match=r"bad\.jsonl:1: expected a JSON object; got list"):
        read_metrics(f)


def test_writer_rejects_what_is_not_a_scalar(tmp_path):
    with MetricsWriter(tmp_path) as log:
        with pytest.raises(TypeError, match=r"metric 'g' must be a scalar; got an array of shape \(2,\)"):
            log.write({"g": np.zeros(2)})
        with pytest.raises(TypeError, match="metric 'd' must be a number, bool, str or None; got dict"):
            log.write({"d": {}})
        with pytest.raises(TypeError, match="metric names must be str"):
            log.write({1: 2.0})
        with pytest.raises(TypeError, match="record must be a dict"):
            log.write([("step", 1)])
    assert not os.path.exists(metrics_path(tmp_path))  # a rejected record writes nothing


def test_series_keeps_last_record_per_step():
    records = [{"step": 0, "loss": 3.0}, {"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.9},
               {"step": 1, "loss": 2.1}, {"step": 3}, {"step": 2, "loss": 1.8}]
    assert series(records, "loss") == ([0, 1, 2], [3.0, 2.1, 1.8])


# ------------------------------------------------------------------ human units


@pytest.mark.parametrize(
    "n, text",
    [(0, "0 B"), (1023, "1023 B"), (1024, "1.00 KiB"), (1536, "1.50 KiB"),
     (int(15.3 * 2**20), "15.3 MiB"), (300 * 2**30, "300 GiB"), (1023.9 * 1024, "1.00 MiB"),
     (np.int64(5 * 2**40), "5.00 TiB")],
)
def test_human_bytes(n, text):
    assert human_bytes(n) == text


def test_human_bytes_rejects_bad_input():
    with pytest.raises(ValueError, match="n must be a finite number >= 0; got -1"):
        human_bytes(-1)
    with pytest.raises(ValueError, match="got nan"):
        human_bytes(float("nan"))
    with pytest.raises(TypeError, match="n must be a number of bytes; got str"):
        human_bytes("1k")


# ------------------------------------------------------------------ progress


def test_progress_shows_loss_and_rate():
    out = io.StringIO()
    with Progress(100, start_step=10, enabled=True, file=out) as bar:
        bar.update(20, loss=2.345678, tokens_per_s=12345.0)
        assert bar.bar.n == 20
    text = out.getvalue()
    assert "20/100" in text and "loss=2.3457" in text and "tok/s=12.3k" in text


@pytest.mark.parametrize("sent,shown", [(9_787_919.0, "MB/step=9.79"),
                                        (46_059.0, "MB/step=0.0461")])
def test_progress_shows_megabytes_per_step(sent, shown):
    out = io.StringIO()
    with Progress(10, enabled=True, file=out) as bar:
        bar.update(1, loss=2.0, tokens_per_s=1000.0, bytes_per_step=sent)
    assert out.getvalue().rstrip().endswith(f"loss=2.0000, tok/s=1k, {shown}]")


def test_progress_writes_text_above_the_bar_on_stdout(capsys):
    out = io.StringIO()
    with Progress(10, enabled=True, file=out) as bar:
        bar.update(1, loss=2.0)
        bar.write("a table\nof two lines")
        bar.update(2, loss=1.9)
    assert capsys.readouterr().out == "a table\nof two lines\n"
    assert "a table" not in out.getvalue() and "loss=1.9000" in out.getvalue()


def test_progress_disabled_prints_nothing(capsys):
    out = io.StringIO()
    with Progress(10, 0, enabled=False, file=out) as bar:
        bar.update(5, loss=1.0)
        bar.write("a table")
    assert out.getvalue() == "" and capsys.readouterr().out == ""


def test_progress_rejects_bad_steps():
    with pytest.raises(ValueError, match="start_step=11, total_steps=10"):
        Progress(10, 11, enabled=False)
    with pytest.raises(TypeError, match="total_steps must be an int"):
        Progress(10.0, 0, enabled=False)


# ------------------------------------------------------------------ plots


def _png_size(path):
    data = open(path, "rb").read()
    assert data[:8] == PNG_MAGIC
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def test_plot_writes_png_with_one_line_per_run(tmp_path):
    pytest.importorskip("matplotlib")
    a = _write_run(tmp_path / "baseline", [3.0, 2.5, float("nan"), 2.0], val={3: 2.2})
    b = _write_run(tmp_path / "int8", [3.1, 2.6, 2.3, 2.1])
    out = plot([a, b], tmp_path / "curves.png")
    assert out == str(tmp_path / "curves.png")
    assert _png_size(out) == (800, 500)
    assert os.path.getsize(out) > 10_000  # axes, two curves, points and a legend


def test_plot_draws_different_images_for_different_data(tmp_path):
    pytest.importorskip("matplotlib")
    a = _write_run(tmp_path / "a", [3.0, 2.0, 1.0])
    b = _write_run(tmp_path / "b", [1.0, 2.0, 3.0])
    plot([a], tmp_path / "a.png")
    plot([b], tmp_path / "b.png")
    assert open(tmp_path / "a.png", "rb").read() != open(tmp_path / "b.png", "rb").read()


def test_plot_without_the_key_raises(tmp_path):
    pytest.importorskip("matplotlib")
    a = _write_run(tmp_path / "a", [3.0, 2.0])
    with pytest.raises(ValueError, match="has both 'step' and 'grad_norm'"):
        plot([a], tmp_path / "x.png", key="grad_norm")
    assert not (tmp_path / "x.png").exists()


def test_plot_command_in_subprocess(tmp_path):
    pytest.importorskip("matplotlib")
    a = _write_run(tmp_path / "A", [3.0, 2.5, 2.0])
    b = _write_run(tmp_path / "B", [3.0, 2.4, 1.9])
    out = tmp_path / "curves.png"
    proc = subprocess.run(
        [sys.executable, "-m", "jcomp.train.run.metrics", "plot", a, b, "--out", str(out), "--key", "loss"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert f"wrote {out}" in proc.stdout
    assert _png_size(out)[0] > 0 and os.path.getsize(out) > 10_000
    bad = subprocess.run(
        [sys.executable, "-m", "jcomp.train.run.metrics", "plot", a, "--out", str(out), "--key", "nope"],
        capture_output=True, text=True, timeout=120,
    )
    assert bad.returncode == 1 and bad.stderr.startswith("error: no record in") and "'nope'" in bad.stderr


def test_plot_without_matplotlib_says_how_to_install(tmp_path, monkeypatch):
    a = _write_run(tmp_path / "a", [3.0, 2.0])
    for name in ("matplotlib", "matplotlib.figure", "matplotlib.backends.backend_agg"):
        monkeypatch.setitem(sys.modules, name, None)  # makes `import name` raise ImportError
    with pytest.raises(ImportError, match=r"pip install 'jcomp\[plot\]'"):
        plot([a], tmp_path / "x.png")


def test_writer_creates_nothing_before_its_first_record(tmp_path):
    log = MetricsWriter(tmp_path / "run", tensorboard=True)
    log.close()
    assert os.listdir(tmp_path / "run") == []  # no metrics file, no empty TensorBoard run


def test_a_line_cut_off_mid_write_is_removed_before_appending(tmp_path, caplog):
    """A crash mid-write leaves a last line without its newline; the next run's
    first record must not be glued onto it, and the file must stay readable."""
    path = tmp_path / "m.jsonl"
    partial = '{"step": 2, "lo'
    path.write_text('{"step": 1, "loss": 2.0}\n' + partial)
    with caplog.at_level("WARNING"), MetricsWriter(path) as log:
        log.write({"step": 2, "loss": 1.5})
    assert read_metrics(path) == [{"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.5}]
    assert any("cut off mid-write" in r.getMessage() and f"{len(partial)} bytes" in r.getMessage()
               for r in caplog.records), caplog.text
