"""Training metrics: a JSON-lines log, a progress bar, and loss curves.

    with MetricsWriter(workdir) as log:                 # appends to WORKDIR/metrics.jsonl
        log.write({"step": 10, "loss": loss, "tokens_per_s": 5.1e4})
    records = read_metrics(workdir)                     # [{"step": 10, "loss": 2.31, ...}]
    plot(["runA/metrics.jsonl", "runB/metrics.jsonl"], "curves.png")

From a shell:

    python -m jcomp.train.run.metrics plot A/metrics.jsonl B/metrics.jsonl --out curves.png [--key loss]

Non-finite numbers. Python's json writes NaN and Infinity bare, which is not
JSON and which jq, browsers and strict parsers reject. The writer stores them
as the strings "NaN", "Infinity" and "-Infinity" instead, so every line is
strict JSON, and `read_metrics` turns exactly those strings back into floats
(it also accepts the bare tokens, as other Python tools write them). A metric
whose real value is one of those three strings would read back as a float.

A resumed run appends records for the steps it repeats after its checkpoint;
`plot` draws the last record written for each x.

TensorBoard. `MetricsWriter(path, tensorboard=True)` also writes every numeric
metric as a scalar (tag = its name, step = the record's "step") to a
TensorBoard event file beside metrics.jsonl, through tensorboardX's
SummaryWriter: `tensorboard --logdir runs/` then shows each run directory as a
run. Non-finite values go to TensorBoard as they are.

Profiling (train.profile_steps) is jcomp.train.run.profiler.
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import numbers
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Optional

import numpy as np

METRICS_FILE = "metrics.jsonl"
_log = logging.getLogger(__name__)
_NONFINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}
_PLOT_HINT = "pip install 'jcomp[plot]'"


def metrics_path(path) -> str:
    """The metrics file `path` names: `path`/metrics.jsonl for a directory, or for a
    path that does not exist yet and does not end in ".jsonl"; else `path` itself."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a str or path; got {type(path).__name__}")
    path = os.fspath(path)
    is_dir = os.path.isdir(path) or (not os.path.exists(path) and not path.endswith(".jsonl"))
    return os.path.join(path, METRICS_FILE) if is_dir else path


def _plain(key: str, value, nested: bool = False):
    """A JSON value for one metric: Python bool/int/float/str/None, non-finite as
    strings; with `nested`, a mapping as an object of such values."""
    if nested and isinstance(value, Mapping):
        return {str(k): _plain(f"{key}.{k}", v, True) for k, v in value.items()}
    if value is None or isinstance(value, (bool, np.bool_)):
        return None if value is None else bool(value)
    if isinstance(value, str):
        return value
    if hasattr(value, "shape") and hasattr(value, "dtype"):  # numpy and jax arrays, scalars
        if np.size(value) != 1:
            raise TypeError(f"metric {key!r} must be a scalar; got an array of shape {tuple(value.shape)}")
        value = np.asarray(value).reshape(()).item()
        return _plain(key, value)
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        value = float(value)
        if math.isnan(value):
            return "NaN"
        return value if math.isfinite(value) else ("Infinity" if value > 0 else "-Infinity")
    raise TypeError(f"metric {key!r} must be a number, bool, str or None; got {type(value).__name__}")


def to_json_line(record: Mapping, nested: bool = False) -> str:
    """One strict-JSON line (no newline) for a flat {name: scalar} record; with
    `nested`, values may be mappings of them (a run's one-off record, such as
    compression.auto's decision, which has no step and no TensorBoard scalars)."""
    if not isinstance(record, Mapping):
        raise TypeError(f"record must be a dict; got {type(record).__name__}")
    for key in record:
        if not isinstance(key, str):
            raise TypeError(f"metric names must be str; got {key!r}")
    return json.dumps({k: _plain(k, v, nested) for k, v in record.items()}, allow_nan=False)


def _cut_partial_last_line(path) -> int:
    """Truncates `path` after its last newline -> the bytes removed (0 if none)."""
    try:
        with open(path, "rb+") as f:
            size = f.seek(0, os.SEEK_END)
            if size == 0:
                return 0
            f.seek(size - 1)
            if f.read(1) == b"\n":
                return 0
            pos = size
            while pos > 0:  # back to the last newline, a block at a time
                step = min(pos, 65536)
                f.seek(pos - step)
                chunk = f.read(step)
                i = chunk.rfind(b"\n")
                if i >= 0:
                    pos = pos - step + i + 1
                    break
                pos -= step
            f.truncate(pos)
            return size - pos
    except FileNotFoundError:
        return 0


class MetricsWriter:
    """Appends one JSON object per line to `path` (a file, or a directory's
    metrics.jsonl), flushed line by line so a crash loses at most the current one.
    With tensorboard=True, numeric metrics also go to a TensorBoard event file in
    the same directory. In a multi-process run, create it on process 0 only.

    Nothing is created before the first record: a run stopped before its first
    step leaves no metrics file and no empty TensorBoard run. A last line cut
    off mid-write (a crash or power loss) is removed, with a warning, before
    the first new record is appended, so it is not glued onto the new one."""

    def __init__(self, path, tensorboard: bool = False):
        self.path = metrics_path(path)
        parent = os.path.dirname(self.path)
        if parent:
            os.makedirs(parent, exist_ok=True)
        self._tensorboard = tensorboard
        self._file = None
        self._tb = None

    def open(self):
        """Opens the files (once): before the first record, or to know the
        metrics file's size before one is written."""
        if self._file is not None:
            return
        cut = _cut_partial_last_line(self.path)
        if cut:
            _log.warning("%s ended in a line cut off mid-write (%d bytes, no newline): removed",
                         self.path, cut)
        self._file = open(self.path, "a", encoding="utf-8")
        if self._tensorboard:
            from tensorboardX import SummaryWriter
            self._tb = SummaryWriter(os.path.dirname(self.path) or ".", flush_secs=10)

    def write(self, record: Mapping, nested: bool = False):
        line = to_json_line(record, nested)  # validates every value before either file sees it
        self.open()
        self._file.write(line + "\n")
        self._file.flush()
        if self._tb is not None and isinstance(record.get("step"), numbers.Integral):
            for key, value in record.items():
                if key != "step" and not isinstance(value, (str, bool, np.bool_)) \
                        and value is not None:
                    self._tb.add_scalar(key, float(np.asarray(value).reshape(())), record["step"])

    def close(self):
        if self._file is not None:
            self._file.close()
        if self._tb is not None:
            self._tb.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _decode(obj: dict) -> dict:
    return {k: _NONFINITE.get(v, v) if isinstance(v, str) else v for k, v in obj.items()}


def read_metrics(path) -> list[dict]:
    """The records of a metrics file (or a directory's metrics.jsonl), in file order.

    Raises ValueError naming the file and line of any line that is not a JSON object.
    """
    path = metrics_path(path)
    records = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not valid JSON ({e.msg}): {line.strip()[:80]!r}") from e
            if not isinstance(obj, dict):
                raise ValueError(f"{path}:{n}: expected a JSON object; got {type(obj).__name__}")
            records.append(_decode(obj))
    return records


def series(records: Sequence[Mapping], key: str, x: str = "step"):
    """(xs, ys) of the records holding both `x` and `key`, sorted by x; for a repeated
    x the last record wins."""
    last = {}
    for r in records:
        if r.get(key) is not None and r.get(x) is not None:
            last[r[x]] = r[key]
    xs = sorted(last)
    return xs, [last[v] for v in xs]


# ---------------------------------------------------------------- human units


def human_bytes(n) -> str:
    """'512 B', '1.50 KiB', '15.3 MiB', '300 GiB': binary units."""
    if isinstance(n, bool) or not isinstance(n, numbers.Real):
        raise TypeError(f"n must be a number of bytes; got {type(n).__name__}")
    if not math.isfinite(n) or n < 0:
        raise ValueError(f"n must be a finite number >= 0; got {n}")
    if n < 1024:
        return f"{int(n)} B" if float(n).is_integer() else f"{n:.1f} B"
    for unit in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        n /= 1024
        digits = 2 if n < 10 else 1 if n < 100 else 0
        if round(n, digits) < 1024 or unit == "PiB":  # never print "1024 KiB"
            return f"{n:.{digits}f} {unit}"


def _human_count(n: float) -> str:
    """'950', '12.3k', '4.56M' for rates."""
    if not math.isfinite(n):
        return str(n)
    for div, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= div:
            return f"{n / div:.3g}{suffix}"
    return f"{n:.3g}"


# ---------------------------------------------------------------- progress bar


class Progress:
    """A tqdm bar over steps [start_step, total_steps) showing loss, tokens/s and
    the bytes each device sends per step, in MB (10^6 bytes).

    enabled=None shows it on process 0 only. tqdm falls back to plain lines when
    stderr is not a terminal. `write` prints text above the bar, on stdout.
    """

    def __init__(self, total_steps: int, start_step: int = 0, enabled: Optional[bool] = None, file=None):
        for name, v in (("total_steps", total_steps), ("start_step", start_step)):
            if isinstance(v, bool) or not isinstance(v, numbers.Integral):
                raise TypeError(f"{name} must be an int; got {type(v).__name__}")
        if not 0 <= start_step <= total_steps:
            raise ValueError(
                "need 0 <= start_step <= total_steps; "
                f"got start_step={start_step}, total_steps={total_steps}"
            )
        if enabled is None:
            import jax

            enabled = jax.process_index() == 0
        from tqdm import tqdm

        self.bar = tqdm(
            total=int(total_steps), initial=int(start_step), disable=not enabled,
            unit="step", dynamic_ncols=True, file=file,
        )

    def update(self, step: int, loss=None, tokens_per_s=None, bytes_per_step=None, **extra):
        """Moves the bar to `step` (steps done) and shows the given values."""
        shown = {}
        if loss is not None:
            shown["loss"] = f"{float(loss):.4f}"
        if tokens_per_s is not None:
            shown["tok/s"] = _human_count(float(tokens_per_s))
        if bytes_per_step is not None:
            shown["MB/step"] = f"{float(bytes_per_step) / 1e6:.3g}"
        shown.update({k: (f"{float(v):.4g}" if isinstance(v, numbers.Real) else v) for k, v in extra.items()})
        if shown:
            self.bar.set_postfix(shown, refresh=False)
        self.bar.update(int(step) - self.bar.n)

    def write(self, text: str):
        """`text` on stdout, above the bar (nothing where the bar is disabled)."""
        if not self.bar.disable:
            self.bar.write(text, file=sys.stdout)

    def close(self):
        self.bar.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# ---------------------------------------------------------------- plots


def _labels(paths: Sequence[str]) -> list[str]:
    """Each file's parent directory name, or its whole parent path where names repeat."""
    names = [os.path.basename(os.path.dirname(os.path.abspath(p))) for p in paths]
    return [
        n if names.count(n) == 1 else os.path.dirname(os.path.abspath(p)) for n, p in zip(names, paths)
    ]


def plot(paths, out_png, key: str = "loss", x: str = "step") -> str:
    """Draws `key` against `x`, one line per metrics file, with `val_<key>` as points
    where present; writes a PNG with matplotlib's Agg backend and returns its path."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ImportError(f"plot needs matplotlib: {_PLOT_HINT}") from e
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    paths = [metrics_path(p) for p in paths]
    if not paths:
        raise ValueError("paths must name at least one metrics file")
    fig = Figure(figsize=(8, 5))
    FigureCanvasAgg(fig)  # a canvas of its own: the global pyplot backend is left alone
    ax = fig.add_subplot()
    drawn = 0
    for path, label in zip(paths, _labels(paths)):
        records = read_metrics(path)
        xs, ys = series(records, key, x)
        line = ax.plot(xs, ys, label=label)[0] if xs else None
        vx, vy = series(records, f"val_{key}", x)
        if vx:
            color = line.get_color() if line else None
            ax.plot(vx, vy, "o", color=color, label=f"{label} val_{key}")
        drawn += len(xs) + len(vx)
    if not drawn:
        raise ValueError(f"no record in {paths} has both {x!r} and {key!r} (or val_{key})")
    ax.set_xlabel(x)
    ax.set_ylabel(key)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    out_png = os.fspath(out_png)
    fig.savefig(out_png, dpi=100, format="png")
    return out_png


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jcomp.train.run.metrics", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plot", help="draw curves from metrics.jsonl files into a PNG")
    p.add_argument("paths", nargs="+", help="metrics.jsonl files or the run directories holding them")
    p.add_argument("--out", required=True, help="PNG file to write")
    p.add_argument("--key", default="loss", help="metric to draw (default: loss)")
    p.add_argument("--x", default="step", help="metric on the x axis (default: step)")
    args = parser.parse_args(argv)
    try:
        out = plot(args.paths, args.out, key=args.key, x=args.x)
    except (ValueError, TypeError, ImportError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
