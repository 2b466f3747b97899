"""Statistics over seeds for experiments/convergence.py, and their plots.

A setting's runs at seeds s_1..s_n are compared with the baseline's runs at the
same seeds: the gap of seed s is 100 * (val_loss_s - baseline_s) / baseline_s,
so the seed-to-seed spread that both share (initial weights, data order)
cancels. The interval is the 95% Student-t interval of the mean gap over the
paired seeds: mean +- t(0.975, n-1) * std / sqrt(n).

settings() gives summary.json's per-setting figures, frontier() the settings no
other beats on both bytes and loss, draw() the banded loss curves and the gap
against bytes. RESULTS.md's section and claims on them are report_seeds.py's.
"""
from __future__ import annotations

import math
import os
import statistics

from experiments import runlog
from jcomp.train.run import metrics as metrics_lib

GAP_TARGET_PCT = 1.0       # "reaches the baseline's loss": the gap's interval below +1%
BYTES_TARGET = 1 / 6       # the project's goal for the hybrid preset's bytes per step
SMOOTH_STEPS = 25          # the curves' running mean over training steps

# Two-sided 95% quantiles of Student's t for 1..30 degrees of freedom.
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
         2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
         2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def t975(df: int) -> float:
    if df < 1:
        raise ValueError(f"degrees of freedom must be >= 1; got {df}")
    return _T975[df - 1] if df <= len(_T975) else 1.960


def mean_interval(values) -> dict:
    """n, mean, sample standard deviation and the 95% Student-t interval of the
    mean (std and interval None for fewer than 2 values)."""
    values = [float(v) for v in values]
    n = len(values)
    if n == 0:
        raise ValueError("no values")
    mean = statistics.fmean(values)
    if n < 2:
        return dict(n=n, mean=mean, std=None, ci95=None)
    std = statistics.stdev(values)
    half = t975(n - 1) * std / math.sqrt(n)
    return dict(n=n, mean=mean, std=std, ci95=[mean - half, mean + half])


def settings(runs: list[dict]) -> list[dict]:
    """Per setting over its seeds: the final val_loss's mean and std, and the gap
    to the baseline paired by seed (only seeds where both finished)."""
    out = []
    for name in dict.fromkeys(r["name"] for r in runs):
        rows = [r for r in runs if r["name"] == name and r.get("final_val_loss") is not None]
        if not rows:
            continue
        paired = [r for r in rows if r.get("gap_pct") is not None]
        out.append(dict(
            name=name, seeds=[r["seed"] for r in rows], overrides=rows[0]["overrides"],
            policy=rows[0]["policy"], error_feedback=rows[0]["error_feedback"],
            extra=rows[0].get("extra", []),
            late_grad_norm=(statistics.fmean(r["late_grad_norm"] for r in rows)
                            if all(r.get("late_grad_norm") is not None for r in rows) else None),
            ef_norm_ratio=(statistics.fmean(r["ef_norm_ratio"] for r in rows)
                           if all(r.get("ef_norm_ratio") is not None for r in rows) else None),
            val_loss=mean_interval([r["final_val_loss"] for r in rows]),
            **_compressed_forward(rows),
            gap_pct=mean_interval([r["gap_pct"] for r in paired]) if paired else None,
            paired_seeds=[r["seed"] for r in paired],
            byte_ratio=statistics.fmean(r["byte_ratio"] for r in paired) if paired else None,
            across_bytes=_across(rows),
            git_commits=sorted({(r.get("git_commit") or "unknown")[:7] for r in rows})))
    return out


def _across(rows) -> float | None:
    """Bytes one device sends across the slow hop per (inner) step, mean over
    seeds: an outer loop's every byte across islands where its runs recorded it
    (syncs, the per-step metrics agreement, evaluations), else its syncs
    averaged over H; or an every-step two-hop run's 'dcn' messages; None for a
    run without two hops."""
    vals = [r["across_bytes_per_step"] if r.get("across_bytes_per_step") is not None
            else r["outer_bytes_per_step"] if r.get("outer_bytes_per_step") is not None
            else r.get("wire_bytes_dcn") for r in rows]
    return statistics.fmean(vals) if vals and all(v is not None for v in vals) else None


def _compressed_forward(rows) -> dict:
    """The loss under the setting's own compressed forward beside the exact one:
    its mean over seeds, the paired difference compressed - exact, and a flag
    where that difference exceeds the seed spread (the exact val_loss's std):
    the forward codec itself then moves the loss by more than the noise."""
    pairs = [(r["final_val_loss_compressed"], r["final_val_loss"]) for r in rows
             if r.get("final_val_loss_compressed") is not None]
    if not pairs:
        return {}
    diff = mean_interval([c - e for c, e in pairs])
    spread = mean_interval([e for _, e in pairs])["std"]
    return dict(val_loss_compressed=mean_interval([c for c, _ in pairs]),
                compressed_minus_exact=diff,
                forward_codec_flag=spread is not None and abs(diff["mean"]) > spread)


def paired_difference(runs: list[dict], a: str, b: str) -> dict | None:
    """100 * (val_loss_a - val_loss_b) / val_loss_b per seed where both finished,
    as mean_interval plus the seeds; None without a common seed."""
    va = {r["seed"]: r["final_val_loss"] for r in runs if r["name"] == a}
    vb = {r["seed"]: r["final_val_loss"] for r in runs if r["name"] == b}
    common = sorted(set(va) & set(vb))
    if not common:
        return None
    d = mean_interval([100.0 * (va[s] - vb[s]) / vb[s] for s in common])
    return dict(d, seeds=common)


# ------------------------------------------------------------------- plots

def _smoothed(xs, ys, window: int):
    out, acc = [], []
    for y in ys:
        acc.append(y)
        if len(acc) > window:
            acc.pop(0)
        out.append(sum(acc) / len(acc))
    return xs, out


def band_plot(groups, out_png: str, key: str = "loss") -> str:
    """One line per (label, [metrics records of each of its seeds]): the mean over seeds of
    each seed's running mean of `key` over SMOOTH_STEPS steps, with the band from
    the lowest to the highest seed shaded; val_`key` means as points."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(14, 5.5))
    FigureCanvasAgg(fig)
    whole, end = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    for label, seeds in groups:
        curves, vals = [], []
        for records in seeds:
            last = {}
            for r in records:  # a resumed run's repeated steps count once, the last written
                last[r["step"]] = r
            ordered = [last[s] for s in sorted(last)]
            curves.append(dict(zip(*_smoothed(*metrics_lib.series(ordered, key), SMOOTH_STEPS))))
            vals.append(dict(zip(*metrics_lib.series(ordered, f"val_{key}"))))
        steps = sorted(set.intersection(*(set(c) for c in curves)))
        if not steps:
            continue
        lo = [min(c[s] for c in curves) for s in steps]
        hi = [max(c[s] for c in curves) for s in steps]
        mid = [statistics.fmean(c[s] for c in curves) for s in steps]
        vsteps = sorted(set.intersection(*(set(v) for v in vals)))
        vmean = [statistics.fmean(v[s] for v in vals) for s in vsteps]
        tail = [i for i, s in enumerate(steps) if s >= 0.6 * steps[-1]]
        for ax, idx in ((whole, range(len(steps))), (end, tail)):
            xs = [steps[i] for i in idx]
            line = ax.plot(xs, [mid[i] for i in idx], linewidth=1.2,
                           label=f"{label} ({len(seeds)} seeds)")[0]
            ax.fill_between(xs, [lo[i] for i in idx], [hi[i] for i in idx],
                            color=line.get_color(), alpha=0.2, linewidth=0)
            vx = [(s, v) for s, v in zip(vsteps, vmean) if not xs or s >= xs[0]]
            if vx:
                ax.plot(*zip(*vx), "o", color=line.get_color(), markersize=4)
    whole.set_yscale("log")
    whole.set_title("whole run")
    end.set_title("last 40% of the steps")
    for ax in (whole, end):
        ax.set_xlabel("step")
        ax.set_ylabel(f"{key} (running mean over {SMOOTH_STEPS} steps; points: val_{key})")
        ax.grid(alpha=0.3, which="both")
    end.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_png, dpi=100, format="png")
    return out_png


def frontier(sts: list[dict]) -> list[dict]:
    """The settings no other setting beats on both counts: none has at most its
    bytes and a lower upper end of the gap's 95% interval. Settings with an
    interval only (>= 2 paired seeds), by bytes."""
    pts = [st for st in sts if st["name"] != "baseline" and st["gap_pct"]
           and st["gap_pct"]["ci95"] and st["byte_ratio"] is not None]
    hi = lambda st: st["gap_pct"]["ci95"][1]
    return sorted((st for st in pts
                   if not any(o is not st and o["byte_ratio"] <= st["byte_ratio"]
                              and hi(o) < hi(st) for o in pts)),
                  key=lambda st: st["byte_ratio"])


def frontier_plot(sts: list[dict], out_png: str) -> str | None:
    """Loss gap (mean, 95% interval as a bar) against bytes per step, one point
    per setting with an interval; the target corner (gap's interval below +1%,
    bytes <= 1/6) shaded, the frontier joined."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    pts = [st for st in sts if st["name"] != "baseline" and st["gap_pct"]
           and st["gap_pct"]["ci95"] and st["byte_ratio"] is not None]
    if not pts:
        return None
    fig = Figure(figsize=(9, 5.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    for st in pts:
        g = st["gap_pct"]
        ax.errorbar([st["byte_ratio"]], [g["mean"]], capsize=3, fmt="o", markersize=4,
                    yerr=[[g["mean"] - g["ci95"][0]], [g["ci95"][1] - g["mean"]]])
        ax.annotate(f"{st['name']} (n={g['n']})", (st["byte_ratio"], g["mean"]), fontsize=7,
                    xytext=(4, 3), textcoords="offset points")
    front = frontier(sts)
    ax.plot([st["byte_ratio"] for st in front], [st["gap_pct"]["ci95"][1] for st in front],
            "k--", linewidth=0.8, label="frontier (upper end of the 95% interval)")
    ax.axhline(GAP_TARGET_PCT, color="grey", linewidth=0.8)
    ax.axvline(BYTES_TARGET, color="grey", linewidth=0.8)
    ax.fill_between([min(st["byte_ratio"] for st in pts) * 0.9, BYTES_TARGET],
                    [GAP_TARGET_PCT] * 2, [ax.get_ylim()[0]] * 2, color="green", alpha=0.08,
                    label="the rule's target: interval below +1% at <= 1/6 of the bytes")
    ax.set_xscale("log")
    ax.set_xlabel("bytes per step, relative to the baseline's")
    ax.set_ylabel("final val_loss gap to the baseline, % (mean, 95% interval)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_png, dpi=100, format="png")
    return out_png


def draw(out: str, runs: list[dict], png: str = "seeds_loss.png",
         frontier_png: str = "seeds_frontier.png") -> dict:
    """The banded loss curves of every setting with >= 2 seeds and the gap
    against bytes -> {"seeds": png, "frontier": frontier_png}."""
    stored = runlog.gather(out) if runs else {}
    by = {}
    for r in runs:
        by.setdefault(r["name"], []).append(stored[os.path.basename(r["workdir"])]["records"])
    groups = [(n, rs) for n, rs in by.items() if len(rs) >= 2]
    if not groups:
        return {}
    band_plot(groups, os.path.join(out, png))
    plots = {"seeds": png}
    if frontier_plot(settings(runs), os.path.join(out, frontier_png)):
        plots["frontier"] = frontier_png
    return plots
