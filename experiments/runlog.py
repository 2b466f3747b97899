"""A study's runs in one committed file: `<study>/runs.jsonl`, one JSON line per run.

A study is the --out folder of experiments/convergence.py: its summary.json, its
plots, and one folder per run (metrics.jsonl, TensorBoard events, git_commit.txt,
restarts.json). The run folders stay out of git; runs.jsonl keeps what the
study's summary and plots are computed from, so that

    python -m experiments.convergence ... --out STUDY --summarize-only

gives the same summary.json and plots with or without the run folders. A line:

    {"run": "baseline-600steps-seed1", "git_commit": "2643f3b..." | null,
     "restarts": [...] (only for a run that had them),
     "records": [{"step": 1, "loss": 5.53, "wire_bytes_total": 9787931.0, ...}, ...]}

`records` are every metrics record in file order, cut to FIELDS; non-finite
numbers are the strings "NaN", "Infinity", "-Infinity", as in metrics.jsonl.

    python -m experiments.report --summarize STUDY [STUDY ...]

writes it from the run folders; experiments/convergence.py writes it at the end
of every invocation.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import tempfile

from jcomp.train.run import metrics as metrics_lib

RUNS_FILE = "runs.jsonl"
COMMIT_FILE = "git_commit.txt"   # in each run's folder: the commit that trained it
RESTARTS_FILE = "restarts.json"  # in a run's folder: each restart after a stuck step

# The metrics that experiments/convergence.py's summarize() and the loss plots
# read; the rest of metrics.jsonl (rates, memory, the meter's mixed-axis keys)
# no report uses.
FIELDS = ("step", "loss", "val_loss", "val_loss_compressed", "grad_norm", "ef_norm",
          "step_time_s", "skipped_updates", "outer_bytes_per_step", "outer_across_bytes_per_step",
          "wire_bytes_data", "wire_bytes_tensor", "wire_bytes_pipeline", "wire_bytes_dcn",
          "wire_bytes_total")

_NONFINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def _study(study_dir) -> str:
    if not isinstance(study_dir, (str, os.PathLike)):
        raise TypeError(f"study_dir must be a str or path; got {type(study_dir).__name__}")
    study_dir = os.fspath(study_dir)
    if not os.path.isdir(study_dir):
        raise ValueError(f"study_dir {study_dir!r} is not a directory")
    return study_dir


def path_of(study_dir) -> str:
    return os.path.join(_study(study_dir), RUNS_FILE)


def _encode(x):
    if isinstance(x, float) and not math.isfinite(x):
        return "NaN" if math.isnan(x) else ("Infinity" if x > 0 else "-Infinity")
    return x


def _decode(x):
    return _NONFINITE.get(x, x) if isinstance(x, str) else x


def from_folder(run_dir: str) -> dict:
    """The runs.jsonl entry of one run folder (which must hold a metrics.jsonl)."""
    records = [{k: r[k] for k in FIELDS if k in r} for r in metrics_lib.read_metrics(run_dir)
               if "step" in r]  # a step's record; compression.auto's decision has none
    entry = dict(run=os.path.basename(os.path.normpath(run_dir)), git_commit=None)
    commit = os.path.join(run_dir, COMMIT_FILE)
    if os.path.exists(commit):
        with open(commit) as f:
            entry["git_commit"] = f.read().strip() or None
    restarts = os.path.join(run_dir, RESTARTS_FILE)
    if os.path.exists(restarts):
        with open(restarts) as f:
            entry["restarts"] = json.load(f)
    entry["records"] = records
    return entry


def _check(entry, where: str) -> dict:
    """`entry` with its records decoded; ValueError naming `where` if it is not one."""
    if not isinstance(entry, dict):
        raise ValueError(f"{where}: expected a JSON object; got {type(entry).__name__}")
    if not isinstance(entry.get("run"), str) or not entry["run"]:
        raise ValueError(f"{where}: 'run' must be a non-empty string")
    if not (entry.get("git_commit") is None or isinstance(entry["git_commit"], str)):
        raise ValueError(f"{where}: 'git_commit' must be a string or null")
    records = entry.get("records")
    if not isinstance(records, list) or not all(isinstance(r, dict) and "step" in r
                                                for r in records):
        raise ValueError(f"{where}: 'records' must be a list of objects, each with a 'step'")
    if not isinstance(entry.get("restarts", []), list):
        raise ValueError(f"{where}: 'restarts' must be a list")
    return dict(entry, records=[{k: _decode(v) for k, v in r.items()} for r in records])


def read(study_dir) -> dict[str, dict]:
    """{run name: entry} of `study_dir`/runs.jsonl, records decoded (non-finite
    numbers as floats). ValueError naming the file if it is missing or malformed."""
    path = path_of(study_dir)
    if not os.path.isfile(path):
        raise ValueError(f"{path}: no such file (write it with python -m experiments.report "
                         f"--summarize {os.path.dirname(path)})")
    runs = {}
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not valid JSON ({e.msg})") from None
            entry = _check(obj, f"{path}:{n}")
            if entry["run"] in runs:
                raise ValueError(f"{path}:{n}: run {entry['run']!r} appears twice")
            runs[entry["run"]] = entry
    return runs


def gather(study_dir) -> dict[str, dict]:
    """{run name: entry} of every run of the study, by name: from its folder where
    that holds a metrics.jsonl, else from runs.jsonl (when the file exists)."""
    study_dir = _study(study_dir)
    runs = read(study_dir) if os.path.isfile(path_of(study_dir)) else {}
    for name in os.listdir(study_dir):
        folder = os.path.join(study_dir, name)
        if os.path.isfile(os.path.join(folder, metrics_lib.METRICS_FILE)):
            runs[name] = from_folder(folder)
    return dict(sorted(runs.items()))


def _line(entry: dict) -> str:
    records = [{k: _encode(v) for k, v in r.items()} for r in entry["records"]]
    return json.dumps(dict(entry, records=records), allow_nan=False)


def write(study_dir) -> str:
    """Writes `study_dir`/runs.jsonl from gather() (run folders first, entries of
    runs whose folder is gone kept) -> its path. ValueError if the study has no run."""
    runs = gather(study_dir)
    if not runs:
        raise ValueError(f"study_dir {os.fspath(study_dir)!r} holds no run folder with a "
                         f"{metrics_lib.METRICS_FILE} and no {RUNS_FILE}")
    path = path_of(study_dir)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.writelines(_line(e) + "\n" for e in runs.values())
    os.replace(tmp, path)  # a reader never sees half a file
    return path


@contextlib.contextmanager
def metrics_files(entries):
    """Yields one metrics.jsonl path per entry, in a temporary folder named after
    the run, for readers of metrics files (jcomp.train.run.metrics.plot labels each
    curve by that folder's name, as it does a run folder)."""
    with tempfile.TemporaryDirectory() as tmp:
        paths = []
        for e in entries:
            os.makedirs(os.path.join(tmp, e["run"]))
            paths.append(os.path.join(tmp, e["run"], metrics_lib.METRICS_FILE))
            with open(paths[-1], "w", encoding="utf-8") as f:
                f.writelines(metrics_lib.to_json_line(r) + "\n" for r in e["records"])
        yield paths
