"""What experiments/convergence.py makes of finished runs: summary.json's figures
and the loss-curve plots.

summarize() reads one run's metrics records (final and best val_loss, the
loss through its compressed forward, wire bytes per axis, step time, error
feedback's residual ratio, the late gradient norm); add_comparisons() adds the
gap to the baseline's val_loss and the byte ratio; collect() gathers every
finished known run of a study folder (its runs.jsonl or run folders) at each
seed; draw_plots() draws the first seed's loss curves per group (seeds.py draws
the banded ones over several seeds). RESULTS.md's sections on these summaries
are report_convergence.py's and report_seeds.py's.
"""
from __future__ import annotations

import math
import os
import re
import statistics

from experiments import runlog
from experiments.convergence_specs import run_specs, workdir_name
from jcomp.train.run import metrics as metrics_lib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

AXES = ("data", "tensor", "pipeline")


def reached(records: list[dict], steps: int) -> bool:
    """True when `records` hold a record of step `steps`."""
    return any(r.get("step") == steps for r in records)


def summarize(records: list[dict]) -> dict:
    """One run's numbers from its metrics records (file order; a resumed run's
    repeated steps count once, the last written)."""
    last = {}
    for r in records:
        if "step" in r:  # compression.auto's decision is a record without one
            last[r["step"]] = r
    steps = sorted(last)
    if not steps:
        raise ValueError("metrics hold no records")
    val = [(s, last[s]["val_loss"]) for s in steps if "val_loss" in last[s]]
    # The loss through the run's own compressed forward, where it codes one.
    val_c = [last[s]["val_loss_compressed"] for s in steps if "val_loss_compressed" in last[s]]
    wire = next((r for r in records if "wire_bytes_total" in r), None)
    if wire is None:
        raise ValueError("no metrics record holds wire_bytes_total")
    times = [last[s]["step_time_s"] for s in steps if "step_time_s" in last[s]]
    # Error feedback's residual against the gradient it rides on, per logged step.
    ef_ratio = [last[s]["ef_norm"] / last[s]["grad_norm"] for s in steps
                if "ef_norm" in last[s] and last[s].get("grad_norm")]
    return dict(
        steps=steps[-1], final_loss=last[steps[-1]]["loss"],
        final_val_loss=val[-1][1] if val else None,
        best_val_loss=min(v for _, v in val) if val else None,
        final_val_loss_compressed=val_c[-1] if val_c else None,
        wire_bytes={a: float(wire.get(f"wire_bytes_{a}", 0.0)) for a in AXES},
        wire_bytes_total=float(wire["wire_bytes_total"]),
        # Across the slow hop: an every-step two-hop run's dcn messages, or an
        # outer loop's syncs averaged over its inner steps (the last record's).
        wire_bytes_dcn=float(wire["wire_bytes_dcn"]) if "wire_bytes_dcn" in wire else None,
        outer_bytes_per_step=next((float(r["outer_bytes_per_step"]) for r in reversed(records)
                                   if "outer_bytes_per_step" in r), None),
        # Every byte across islands per inner step (syncs, the per-step metrics
        # agreement, evaluations), on runs that record it.
        across_bytes_per_step=next((float(r["outer_across_bytes_per_step"]) for r in records
                                    if "outer_across_bytes_per_step" in r), None),
        median_step_time_s=statistics.median(times) if times else None,
        ef_norm_ratio=statistics.median(ef_ratio) if ef_ratio else None,
        # The pre-clip gradient norm over the second half of training: noisier
        # (compressed) gradients are clipped harder at the same clip_norm.
        late_grad_norm=statistics.median(last[s]["grad_norm"] for s in steps
                                         if s > steps[-1] / 2 and "grad_norm" in last[s])
        if any(s > steps[-1] / 2 and "grad_norm" in last[s] for s in steps) else None,
        skipped_updates=last[steps[-1]].get("skipped_updates", 0))


def gap_pct(value, reference):
    """100 * (value - reference) / reference; None when either is missing.
    NaN or Inf losses stay NaN/Inf."""
    if value is None or reference is None:
        return None
    if reference == 0:
        raise ValueError("reference val_loss is 0: a gap in percent is undefined")
    return 100.0 * (value - reference) / reference


def byte_ratio(total, reference):
    if reference == 0:
        return None
    return total / reference


def add_comparisons(runs: list[dict]) -> list[dict]:
    """Adds gap_pct (final val_loss vs baseline) and byte_ratio (total bytes vs
    baseline) to each run; the baseline run must be among them."""
    base = next((r for r in runs if r["name"] == "baseline"), None)
    if base is None:
        raise ValueError("runs must include the baseline run")
    for r in runs:
        r["gap_pct"] = gap_pct(r["final_val_loss"], base["final_val_loss"])
        r["best_gap_pct"] = gap_pct(r["best_val_loss"], base["best_val_loss"])
        r["byte_ratio"] = byte_ratio(r["wire_bytes_total"], base["wire_bytes_total"])
        r["byte_ratio_by_axis"] = {a: byte_ratio(r["wire_bytes"][a], base["wire_bytes"][a])
                                   for a in AXES}
    return runs


def _json_safe(x):
    """Non-finite floats as the strings jcomp.train.run.metrics uses, so the file is strict JSON."""
    if isinstance(x, float) and not math.isfinite(x):
        return "NaN" if math.isnan(x) else ("Infinity" if x > 0 else "-Infinity")
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    return x


def seeds_on_disk(out: str, steps: int) -> list[int]:
    """The seeds of the runs of length `steps` that have a workdir in `out`, or
    an entry in its runs.jsonl."""
    if not os.path.isdir(out):
        return []
    pattern = re.compile(rf"-{steps}steps(?:-seed(\d+))?$")
    names = {e for e in os.listdir(out) if os.path.isdir(os.path.join(out, e))}
    found = {pattern.search(n) for n in names | set(runlog.gather(out))}
    return sorted({int(m.group(1) or 0) for m in found if m})


def collect(out: str, steps: int, args_of, seeds=(0,)) -> list[dict]:
    """Every finished known run of length `steps` in `out` at each of `seeds`,
    seed-major, baseline first within a seed; each compared with the baseline
    of its own seed."""
    stored = runlog.gather(out) if os.path.isdir(out) else {}
    runs = []
    for seed in seeds:
        at_seed = []
        for spec in run_specs():
            workdir = os.path.join(out, workdir_name(spec, steps, seed))
            entry = stored.get(os.path.basename(workdir))
            if entry is None or not reached(entry["records"], steps):
                continue
            row = dict(name=spec["name"], seed=seed, suite=spec["suite"], group=spec["group"],
                       policy=spec["policy"], overrides=spec["overrides"],
                       error_feedback=spec["error_feedback"], extra=list(spec.get("extra", ())),
                       workdir=os.path.relpath(workdir, ROOT),
                       command="python train.py " + " ".join(args_of(spec, seed))
                       + f" --workdir={os.path.relpath(workdir, ROOT)}")
            row.update(summarize(entry["records"]))
            # Runs of a sweep may come from several commits; each keeps its own.
            row["git_commit"] = entry["git_commit"]
            if "restarts" in entry:
                row["restarts"] = entry["restarts"]
            at_seed.append(row)
        if any(r["name"] == "baseline" for r in at_seed):
            add_comparisons(at_seed)
        runs += at_seed
    return runs


def draw_plots(out: str, runs: list[dict]) -> dict:
    """{group: png path relative to out} for the main, sweep and places groups present,
    drawn from the first seed's runs."""
    plots = {}
    runs = [r for r in runs if r["seed"] == runs[0]["seed"]] if runs else runs
    stored = runlog.gather(out) if runs else {}
    by_name = {r["name"]: r for r in runs}
    for group, png in (("main", "main_loss.png"), ("sweep_grad", "sweep_grad_loss.png"),
                       ("sweep_act", "sweep_act_loss.png"), ("places", "places_loss.png")):
        names = [r["name"] for r in runs if r["group"] == group]
        if not names or (names == ["baseline"] and len({r["group"] for r in runs}) > 1):
            continue  # the baseline alone is drawn beside each other group instead
        if group != "main" and "baseline" in by_name:
            names = ["baseline"] + names
        entries = [stored[os.path.basename(by_name[n]["workdir"])] for n in names]
        with runlog.metrics_files(entries) as paths:
            metrics_lib.plot(paths, os.path.join(out, png), key="loss")
        plots[group] = png
    return plots
