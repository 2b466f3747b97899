"""RESULTS.md's section on a convergence study run at several seeds
(experiments/seeds.py's statistics in its summary.json): the table of settings
with their gap's 95% interval, the frontier of bytes against loss, bytes across
the slow hop, the plots, and the claims computed from them (the hybrid target,
rotation, naive against hybrid, error feedback); report.py calls these.
"""
from __future__ import annotations

import math

from experiments.seeds import (BYTES_TARGET, GAP_TARGET_PCT, SMOOTH_STEPS, frontier,
                               paired_difference)


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
