"""Statistics over seeds for experiments/convergence.py, and their RESULTS.md section.

A setting's runs at seeds s_1..s_n are compared with the baseline's runs at the
same seeds: the gap of seed s is 100 * (val_loss_s - baseline_s) / baseline_s,
so the seed-to-seed spread that both share (initial weights, data order)
cancels. The interval is the 95% Student-t interval of the mean gap over the
paired seeds: mean +- t(0.975, n-1) * std / sqrt(n).
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


ACROSS_REFERENCE = "hop_raw"  # the every-step run with two hops and nothing coded


def across_table(sts: list[dict], table) -> list[str]:
    """Markdown lines: each two-hop setting's bytes across the slow hop per
    step against the every-step uncoded run's, beside its loss gap."""
    rows = [st for st in sts if st.get("across_bytes") is not None]
    if not rows:
        return []
    ref = next((st["across_bytes"] for st in rows if st["name"] == ACROSS_REFERENCE), None)
    return ["", "Across the slow hop (between the two halves of the data axis): bytes one "
            "device sends per step, an outer loop's every byte across islands per inner "
            "step where its runs recorded it (outer_across_bytes_per_step: syncs, metrics, "
            "evaluations), else its syncs averaged over its inner steps "
            f"(outer_bytes_per_step), against {ACROSS_REFERENCE}'s, the every-step run with "
            "nothing coded.", "",
            table(["setting", "bytes across per step", f"vs {ACROSS_REFERENCE}",
                   f"fewer than {ACROSS_REFERENCE}", "gap % (mean)", "gap 95% interval", "seeds"],
                  [[st["name"], f"{st['across_bytes']:,.0f}",
                    f"{st['across_bytes'] / ref:.4f}" if ref else "n/a",
                    f"{ref / st['across_bytes']:.0f}x" if ref and st["across_bytes"] else "n/a",
                    f"{st['gap_pct']['mean']:+.2f}" if st.get("gap_pct") else "n/a",
                    _fmt_ci(st["gap_pct"]) if st.get("gap_pct") else "n/a",
                    ", ".join(map(str, st["seeds"]))] for st in rows])]


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


# ---------------------------------------------------------------- the page

def _fmt_ci(st) -> str:
    if st is None or st["ci95"] is None:
        return "n/a"
    return f"[{st['ci95'][0]:+.2f}, {st['ci95'][1]:+.2f}]"


def _pm(st, spec) -> str:
    if st is None:
        return "n/a"
    return format(st["mean"], spec) + ("" if st["std"] is None else f" ± {format(st['std'], spec.lstrip('+'))}")


def _forward_cell(st) -> str:
    if "val_loss_compressed" not in st:
        return "= exact (no forward codec)"
    flag = " **FLAG**" if st["forward_codec_flag"] else ""
    return _pm(st["val_loss_compressed"], ".4f") + flag


def section(summary: dict, rel_dir: str, compressed_what, table) -> str:
    m = summary["model"]
    # Runs evaluated exactly also carry the loss under their compressed forward.
    both = any("val_loss_compressed" in st for st in summary["settings"])
    rows = []
    for st in summary["settings"]:
        rows.append([st["name"], compressed_what(st), ", ".join(map(str, st["seeds"])),
                     _pm(st["val_loss"], ".4f")]
                    + ([_forward_cell(st)] if both else [])
                    + [_pm(st["gap_pct"], "+.2f"), _fmt_ci(st["gap_pct"]),
                       "n/a" if st["byte_ratio"] is None else f"{st['byte_ratio']:.3f}",
                       ", ".join(st["git_commits"])])
    out = [f"### {rel_dir}: {summary['steps']} steps of {summary['config']}, seeds "
           f"{', '.join(map(str, summary['seeds']))}",
           f"Model d_model {m['d_model']}, {m['n_layers']} layers; batch {summary['batch_size']} x "
           f"{summary['seq_len']} tokens; mesh {summary['mesh']}; learning-rate warm-up "
           f"{summary['warmup_steps']} steps. A seed sets the initial weights and the data order "
           "alike. Gap: final val_loss against the baseline's at the same seed, mean ± std "
           "over the paired seeds, and its 95% Student-t interval. The commits column names "
           "the commits that trained the runs of each setting (they differ only in code that "
           "a setting does not use, where several are listed: see git log).", "",
           table(["setting", "compressed", "seeds", "final val_loss (mean ± std)"]
                 + (["compressed-forward val_loss (flag: differs by more than the seed std)"]
                    if both else [])
                 + ["gap % (mean ± std)", "gap 95% interval", "bytes vs baseline", "commits"],
                 rows)]
    if both:
        out[1] += (" val_loss is the exact forward's (every message uncompressed, as the "
                   "weights are used after training); the compressed-forward column is the "
                   "same weights through the setting's own forward codecs, where it has any.")
    front = frontier(summary["settings"])
    if front:
        out += ["", "The frontier: the settings that no other beats on both bytes and the upper "
                f"end of the gap's 95% interval, by bytes (the rule's target: below "
                f"+{GAP_TARGET_PCT:g}% at no more than {BYTES_TARGET:.3f} of the bytes).", "",
                table(["setting", "bytes vs baseline", "gap % (mean)", "gap 95% interval",
                       "seeds", "meets the rule"],
                      [[st["name"], f"{st['byte_ratio']:.3f}", f"{st['gap_pct']['mean']:+.2f}",
                        _fmt_ci(st["gap_pct"]), str(st["gap_pct"]["n"]),
                        "yes" if _meets(st) else "no"] for st in front])]
    out += across_table(summary["settings"], table)
    for name, png in summary.get("plots", {}).items():
        what = {"seeds": f"the mean over seeds of each seed's running mean over {SMOOTH_STEPS} "
                         "steps, the band from the lowest seed to the highest, points the mean "
                         "val_loss",
                "frontier": "final val_loss gap against bytes per step, one point per setting, "
                            "its 95% interval as a bar; the dashed line joins the frontier"
                }.get(name, f"seed {summary['seeds'][0]}'s runs")
        kind = "loss gap against bytes" if name == "frontier" else f"{name} loss curves"
        out.append(f"\n![{kind}]({rel_dir}/{png}) `{rel_dir}/{png}`: {what}.")
    resumed = [f"{r['name']} seed {r['seed']} (after step {x['stuck_after_step']})"
               for r in summary.get("runs", []) for x in r.get("restarts", [])]
    if resumed:
        out += ["", "Resumed from their last checkpoint after XLA's CPU runtime ended them, "
                "their emulated devices waiting in collectives that never completed (the "
                "first attempt's log is stuck1.log in the run's folder; a resumed run is "
                "bit for bit the uninterrupted one): " + "; ".join(resumed) + "."]
    return "\n".join(out)


def _meets(st) -> bool:
    g = st["gap_pct"]
    return (g is not None and g["ci95"] is not None and g["ci95"][1] < GAP_TARGET_PCT
            and st["byte_ratio"] is not None and st["byte_ratio"] <= BYTES_TARGET)


def _diff_text(d, a, b) -> str:
    ci = "" if d["ci95"] is None else f", 95% interval [{d['ci95'][0]:+.2f}%, {d['ci95'][1]:+.2f}%]"
    return f"{a} against {b} on seeds {', '.join(map(str, d['seeds']))}: {d['mean']:+.2f}%{ci}"


def _verdict(d) -> str:
    if d["ci95"] is None:
        return "one seed cannot tell"
    if d["ci95"][0] > 0:
        return "higher loss, beyond the noise"
    if d["ci95"][1] < 0:
        return "lower loss, beyond the noise"
    return "not told apart at these seeds"


def claims(summary: dict, preset_setting: str | None) -> list[str]:
    """Computed statements: which setting meets the hybrid target, whether the
    hybrid preset is it, int4:rot against int4, naive against hybrid."""
    sts = {st["name"]: st for st in summary["settings"]}
    runs = summary["runs"]
    tag = f"[{summary['steps']} steps, seeds {', '.join(map(str, summary['seeds']))}]"
    out = []
    ok = sorted((st for st in sts.values() if st["name"] != "baseline" and _meets(st)),
                key=lambda st: st["byte_ratio"])
    if ok:
        b = ok[0]
        out.append(f"{tag} Fewest bytes with the gap's 95% interval below +{GAP_TARGET_PCT:g}% "
                   f"and at most 1/6 of the baseline's bytes: {b['name']} ({b['byte_ratio']:.3f} "
                   f"of the bytes, gap {b['gap_pct']['mean']:+.2f}% {_fmt_ci(b['gap_pct'])}).")
    elif any(st["byte_ratio"] is not None and st["byte_ratio"] <= BYTES_TARGET
             for st in sts.values()):  # a suite with candidates for the hybrid target
        cands = [st for st in sts.values() if st["name"] != "baseline" and st["gap_pct"]
                 and st["gap_pct"]["ci95"] and st["byte_ratio"] <= BYTES_TARGET]
        best = min(cands, key=lambda st: st["gap_pct"]["ci95"][1], default=None)
        out.append(f"{tag} No setting has its gap's 95% interval below +{GAP_TARGET_PCT:g}% at "
                   "1/6 of the baseline's bytes or fewer" + (
                       f"; the best found at those bytes is {best['name']} "
                       f"({best['byte_ratio']:.3f}, gap {best['gap_pct']['mean']:+.2f}% "
                       f"{_fmt_ci(best['gap_pct'])})." if best else "."))
    if preset_setting:
        out.append(f"{tag} The hybrid preset (jcomp.gpt.policy) is the setting {preset_setting}.")
    for name in ("hybrid_paper", "naive"):
        st = sts.get(name)
        if st and st["gap_pct"] and st["gap_pct"]["ci95"]:
            hi = st["gap_pct"]["ci95"][1]
            out.append(f"{tag} {name} ({st['byte_ratio']:.3f} of the bytes): gap "
                       f"{st['gap_pct']['mean']:+.2f}% {_fmt_ci(st['gap_pct'])}, "
                       f"{'within' if hi < GAP_TARGET_PCT else 'not shown within'} "
                       f"{GAP_TARGET_PCT:g}% of the baseline.")
    base = sts.get("baseline")
    if base and base.get("late_grad_norm"):
        ratios = [(n, st["late_grad_norm"] / base["late_grad_norm"]) for n, st in sts.items()
                  if n != "baseline" and st.get("late_grad_norm")]
        if ratios:
            out.append(f"{tag} Median pre-clip gradient norm over the second half of training, "
                       "relative to the baseline's (mean over seeds): " + ", ".join(
                           f"{n} {r:.2f}x" for n, r in ratios) + ". Above 1, clip_norm scales "
                       "those updates down more than the baseline's, so a gap also reflects a "
                       "different effective step size, not only what the codec loses.")
    forward = [st for st in sts.values() if st.get("compressed_minus_exact")]
    if forward:
        out.append(f"{tag} Final val_loss through each setting's own compressed forward minus "
                   "the exact one (mean over seeds): " + ", ".join(
                       f"{st['name']} {st['compressed_minus_exact']['mean']:+.4f}"
                       + (" (FLAG: beyond the seed std)" if st["forward_codec_flag"] else "")
                       for st in forward) + ".")
    out += ef_claims(summary)
    d = paired_difference(runs, "grad_int4rot_efoff", "grad_int4_efoff")
    if d:
        out.append(f"{tag} Rotation on data gradients, int4:rot against int4 (error feedback "
                   f"off in both): {_diff_text(d, 'int4:rot', 'int4')} in final val_loss: "
                   f"{_verdict(d)}.")
    if "naive" in sts:
        others = [st for st in sts.values() if st["name"] not in ("naive", "baseline")
                  and st["name"].startswith("hybrid") and st["byte_ratio"]]
        if others and sts["naive"]["byte_ratio"]:
            nb = sts["naive"]["byte_ratio"]
            h = min(others, key=lambda st: abs(math.log(st["byte_ratio"] / nb)))
            d = paired_difference(runs, "naive", h["name"])
            if d:
                holds = {"higher loss, beyond the noise": "holds here",
                         "lower loss, beyond the noise": "does not hold here"}.get(
                    _verdict(d), "is not shown here at these seeds")
                out.append(f"{tag} Naive against the closest-bytes hybrid setting {h['name']} "
                           f"({nb:.3f} against {h['byte_ratio']:.3f} of the bytes): "
                           f"{_diff_text(d, 'naive', h['name'])}. The paper's finding, that "
                           f"naive compression degrades the loss where hybrid does not, {holds}.")
    return out


def ef_claims(summary: dict) -> list[str]:
    """Error feedback with AdamW and with SGD, and after a warm-up: paired by seed."""
    runs = summary["runs"]
    sts = {st["name"]: st for st in summary["settings"]}
    tag = f"[{summary['steps']} steps, seeds {', '.join(map(str, summary['seeds']))}]"
    out = []
    for a, b, what in (("grad_int4_efon", "grad_int4_efoff", "AdamW"),
                       ("sgd_grad_int4_efon", "sgd_grad_int4_efoff", "SGD with momentum"),
                       ("grad_int4_efon_warm50", "grad_int4_efoff_warm50",
                        "AdamW after a 50-step uncompressed warm-up"),
                       ("grad_int4_efon_warm50", "grad_int4_efon", "AdamW, warm-up against none")):
        d = paired_difference(runs, a, b)
        if d:
            out.append(f"{tag} Error feedback, {what}: {_diff_text(d, a, b)} in final "
                       f"val_loss: {_verdict(d)}.")
    ratios = [(n, sts[n]["ef_norm_ratio"]) for n in ("grad_int4_efon", "sgd_grad_int4_efon",
                                                    "grad_int4_efon_warm50")
              if n in sts and sts[n].get("ef_norm_ratio") is not None]
    if ratios:
        out.append(f"{tag} Residual norm over gradient norm (median over logged steps, mean "
                   "over seeds): " + ", ".join(f"{n} {r:.2f}" for n, r in ratios) + ".")
    return out
