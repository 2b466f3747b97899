"""RESULTS.md's section on the throttled link (network.json with projection.json's
link profile), the commands that made each sweep, what the rows named hybrid
ran at each commit, and the helpers the two-hop rig's sections share (a
commit's rows, tables); report.py calls these. The two-hop rig's sections are
report_hops.py's (hops, outer loop), report_auto.py's (compression.auto) and
report_streaming.py's (Streaming DiLoCo)."""
from __future__ import annotations

import functools
import os
import subprocess

from experiments import linkprofile

STEP_RATIO_TARGET = 0.35    # hybrid's step time at 100 Mbit/s, vs the baseline's
BYTES_TOLERANCE = 0.10      # kernel bytes vs the meter's
PREDICTION_BAND = (0.85, 1.15)


def _table(header, rows) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(str(c) for c in r) + " |" for r in rows])


def _f(x, spec):
    return "n/a" if x is None else format(x, spec)


def _rows(net: dict, commit: str) -> list[dict]:
    return [r for r in net["rows"] if r.get("commit") == commit and "error" not in r]


def _main_commit(net: dict) -> str | None:
    rows = [r for r in net["rows"] if "error" not in r]
    return linkprofile.main_commit(rows) if rows else None


def _sweep(net: dict, commit: str) -> list[dict]:
    return linkprofile.sweep_rows(net, commit)


def _runs_phrase(sweep) -> str:
    counts = sorted({r.get("repeats", 1) for r in sweep})
    if counts == [1]:
        return "one run per row"
    n = str(counts[0]) if len(counts) == 1 else f"{counts[0]}-{counts[-1]}"
    return (f"each row the median of {n} runs, made repeat-major (runs: the range of the "
            "runs' medians, and their count)")


def _spread(r) -> str:
    """The run medians' range and count of a combined row."""
    runs = r.get("repeat_step_s") or [r["median_step_s"]]
    return f"{min(runs):.3f}-{max(runs):.3f} ({len(runs)})" if len(runs) > 1 else "1 run"


def earlier_sweeps(net: dict) -> str:
    """Step time and meter bytes of every commit's sweep side by side, oldest first:
    what a change to the collectives did on the same link."""
    rows = [r for r in net["rows"] if "error" not in r and r["settings"]["kind"] == "sweep"]
    commits = list(dict.fromkeys(r["commit"] for r in sorted(rows, key=lambda r: r["date"])))
    if len(commits) < 2:
        return ""
    rows = [r for c in commits for r in _sweep(net, c)]
    by = {(r["commit"], r["settings"]["rate"], r["settings"]["policy"]): r for r in rows}
    keys = list(dict.fromkeys((r["settings"]["rate"], r["settings"]["policy"]) for r in rows))
    base = lambda c, rate: by.get((c, rate, "baseline"))
    cells = []
    for rate, pol in keys:
        row = [rate, pol]
        for c in commits:
            r, b = by.get((c, rate, pol)), base(c, rate)
            row += ["n/a"] * 3 if r is None else [
                _f(r["median_step_s"], ".3f"),
                _f(r["median_step_s"] / b["median_step_s"], ".2f") if b else "n/a",
                _f(r["meter_bytes_per_step"] / 1e6, ".2f")]
        cells.append(row)
    header = ["link", "policy"] + [f"{h} @{c[:7]}" for c in commits
                                   for h in ("step s", "vs baseline", "meter MB")]
    ran = "; ".join(f"@{c[:7]} {hybrid_at(c)}" for c in commits)
    return ("Every commit's sweep side by side (the same command; oldest first). The rows "
            f"named hybrid ran each commit's preset: {ran}.\n\n" + _table(header, cells))


def commands(net: dict) -> list[str]:
    """One network.py command per commit, rebuilt from its rows' settings (every
    other option at its default), oldest first."""
    out = []
    for commit in dict.fromkeys(r["commit"] for r in sorted(net["rows"], key=lambda r: r["date"])):
        rows = [r["settings"] for r in net["rows"] if r["commit"] == commit]
        sweep = [s for s in rows if s["kind"] == "sweep"]
        ttl = [s for s in rows if s["kind"] == "ttl"]
        if not sweep and ttl:  # a --ttl-only run
            t = ttl[0]
            out.append(f"python -m experiments.network{' --hops' if t.get('hops') else ''} "
                       f"--ttl-only --procs {t['procs']} --config {t['config']} --warmup-steps "
                       f"{t['warmup_steps']} --rates {t['rate']} --policies "
                       f"{' '.join(dict.fromkeys(r['policy'] for r in ttl))} --ttl-rate {t['rate']} "
                       f"--ttl-steps {t['steps']} --ttl-eval-every {t['eval_every']}"
                       + "".join(f" --set {k}={v}" for k, v in t["set"].items())
                       + f"  # commit {commit[:7]}")
            continue
        if not sweep:
            continue
        s = sweep[0]
        uniq = lambda key, rs: " ".join(dict.fromkeys(r[key] for r in rs))
        line = (f"python -m experiments.network{' --hops' if s.get('hops') else ''} "
                f"--procs {s['procs']} --config {s['config']} "
                f"--steps {s['steps']} --warmup-steps {s['warmup_steps']} --rates "
                f"{uniq('rate', sweep)} --policies {uniq('policy', sweep)}")
        line += f" --repeats {max(r.get('repeat', 0) for r in sweep) + 1}"
        line += f" --burst {s['burst']}" if s.get("burst") else ""
        line += f" --devices {s['devices']}" if s.get("devices") else ""
        line += "".join(f" --set {k}={v}" for k, v in s["set"].items())
        line += (f" --ttl-rate {ttl[0]['rate']} --ttl-steps {ttl[0]['steps']} --ttl-eval-every "
                 f"{ttl[0]['eval_every']}" if ttl else " --ttl-rate ''")
        out.append(f"{line}  # commit {commit[:7]}")
    return out


# What the hybrid preset was, by the commit that set it (oldest first); before the
# first, the CCGrid 2024 recipe (now hybrid_paper).
HYBRID_PRESETS = (
    ("3c5f7d1", "the seeds suite's hybrid_rot4_grad_rot4 (int4:rot on gradients and on "
                "tensor and pipeline activations, int8 parameter gathers)"),
    ("2242b6e", "today's (as 3c5f7d1's, with int8 on pipeline sends)"),
)


@functools.cache
def is_ancestor(ancestor: str, commit: str) -> bool:
    """Whether `commit` contains `ancestor` (git merge-base --is-ancestor); False
    for a commit this clone does not have."""
    proc = subprocess.run(["git", "merge-base", "--is-ancestor", ancestor, commit],
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                          capture_output=True)
    return proc.returncode == 0


def hybrid_at(commit: str) -> str:
    """What the rows named hybrid ran at `commit`."""
    ran = "the CCGrid 2024 recipe, now hybrid_paper (int4 gradients with error feedback, int8 elsewhere)"
    for since, what in HYBRID_PRESETS:
        if is_ancestor(since, commit):
            ran = what
    return ran


def network_section(net: dict, link: dict | None) -> tuple[str, list[str]]:
    """(markdown, claims) for the sweep of the commit with the most rows."""
    commit = _main_commit(net)
    if commit is None:
        return "No successful network.py run yet.", []
    rows = _rows(net, commit)
    sweep = _sweep(net, commit)
    s0 = sweep[0]["settings"]
    base = {r["settings"]["rate"]: r["median_step_s"] for r in sweep
            if r["settings"]["policy"] == "baseline"}
    pred = {}
    if link and link.get("commit") == commit:
        pred = {(r["rate"], r["policy"]): r for r in link["rows"]}
    dates = sorted(r["date"] for r in rows)
    cmd = next(c for c in commands(net) if c.endswith(commit[:7])).split("  #")[0]
    paper = ""
    if not is_ancestor(HYBRID_PRESETS[-1][0], commit):
        paper = (f" The rows named hybrid ran the preset of that commit, {hybrid_at(commit)}; "
                 "today's hybrid preset has not been swept on this link yet.")
    out = [f"`{cmd}`: {s0['procs']} processes x {8 // s0['procs']} CPU devices of "
           f"{s0['config']} on its (2, 2, 2) mesh, {s0['steps']} steps per run, medians over "
           f"steps after the first {net.get('warm_steps', 2)}; "
           + _runs_phrase(sweep) + "; every collective crosses the "
           f"namespace's loopback (gloo over TCP), throttled by tc tbf. Commit {commit[:7]}, "
           f"{dates[0]} to {dates[-1]}, on a 2-core machine shared with other work (load "
           f"average {min(r['loadavg_before'] for r in rows):.1f}-"
           f"{max(r['loadavg_before'] for r in rows):.1f} before the runs): times are noisy."
           + paper,
           "", "Kernel bytes: the namespace's lo bytes per steady-state step (headers "
           "included); meter: jcomp.meter.wire's bytes per device x 8 devices; payload: kernel bytes "
           "less 66 header bytes per packet. Predicted: experiments/linkprofile.py's overlapped "
           "model (compute and transfer overlap), calibrated on the unthrottled rows and the "
           "baseline at the calibration rate; additive: the same inputs with no overlap.", ""]
    header = ["link", "policy", "step s", "runs", "vs baseline", "kernel MB/step", "meter MB/step",
              "kernel/meter", "payload/meter", "predicted s", "pred/meas", "additive pred/meas",
              "final loss", "final val_loss"]
    table = []
    for r in sweep:
        s = r["settings"]
        p = pred.get((s["rate"], s["policy"]))
        role = f" ({p['role']})" if p and p["role"] != "predicted" else ""
        table.append([s["rate"], s["policy"], _f(r["median_step_s"], ".3f"), _spread(r),
                      _f(r["median_step_s"] / base[s["rate"]], ".2f") if s["rate"] in base else "n/a",
                      _f(r["kernel_bytes_per_step"] / 1e6, ".2f"), _f(r["meter_bytes_per_step"] / 1e6, ".2f"),
                      _f(r["kernel_over_meter"], ".3f"), _f(r.get("payload_over_meter"), ".3f"),
                      _f(p["predicted_s"]["overlapped"], ".3f") if p else "n/a",
                      (_f(p["ratio"]["overlapped"], ".2f") + role) if p else "n/a",
                      _f(p["ratio"]["additive"], ".2f") if p else "n/a",
                      _f(r["final_loss"], ".4f"), _f(r.get("final_val_loss"), ".4f")])
    out.append(_table(header, table))
    earlier = earlier_sweeps(net)
    if earlier:
        out += ["", earlier]
    claims = _claims(sweep, base, pred, link)
    ttl = net.get("ttl")
    if ttl:
        t_base = ttl["policies"].get("baseline", {}).get("time_s")
        out += ["", f"Time to the baseline's final val_loss ({ttl['target_val_loss']:.4f}) at "
                f"{ttl['rate']}: training time (the sum of step times, evaluation and compilation "
                "excluded) to the first evaluation at or below it, in a longer run of each "
                "policy (val_loss every few steps, one learning-rate schedule for all of them; "
                "kind 'sweep': the baseline's own run above, where it has no longer run). "
                "A compressed policy's run counts only if its val_loss is the exact forward's: "
                "the earlier ones (2242b6e and before) read it through activation blocks that "
                "spanned tokens, leaking the next token, and are withdrawn.", "",
                _table(["policy", "run", "steps run", "reached at step", "time s", "vs baseline",
                        "best val_loss", "commit"],
                       [[n, t.get("kind", "ttl"), t["steps_run"],
                         t["step"] if t["reached"] else "not reached",
                         _f(t["time_s"], ".1f"), _f(t["time_s"] / t_base, ".2f")
                         if t["reached"] and t_base else "n/a", _f(t["best_val_loss"], ".4f"),
                         t.get("commit", commit)[:7]]
                        for n, t in ttl["policies"].items()])]
        for n, t in ttl["policies"].items():
            if n != "baseline":
                claims.append(f"Time to the baseline's loss at {ttl['rate']}: {n} " + (
                    f"{t['time_s']:.1f} s (step {t['step']}) against the baseline's "
                    f"{_f(t_base, '.1f')} s." if t["reached"] else
                    f"did not reach {ttl['target_val_loss']:.4f} in {t['steps_run']} steps "
                    f"(best {_f(t['best_val_loss'], '.4f')})."))
    if link and link.get("crossover"):
        prof = link["profile"]
        out += ["", f"Link profile: beta = {prof['beta_bytes_per_s'] / 1e6:.2f} MB/s (the tbf "
                f"rate at {prof['calibration_rate']}; the calibration run moved "
                f"{prof['effective_bytes_per_s'] / 1e6:.2f} MB/s of kernel bytes on average), "
                f"alpha = {prof['alpha_s']['overlapped'] * 1e3:+.3f} ms per collective "
                f"(overlapped), {prof['alpha_s']['additive'] * 1e3:+.3f} ms (additive; the "
                f"calibration run asked for {prof['alpha_calibrated_s']['additive'] * 1e3:+.3f} "
                f"ms, as it took less than compute plus transfer)"
                + ("" if prof["latency_counted"] else "; no collective counts in the rows, "
                   "so no latency term") + ".", "",
                _table(["policy", "measured: faster than baseline up to", "measured: slower at",
                        "predicted (overlapped)", "predicted (additive)"],
                       [[n, c["measured"]["beats_baseline_up_to"] or "no swept rate",
                         c["measured"].get("loses_from") or "-", c["predicted"]["overlapped"],
                         c["predicted"]["additive"]] for n, c in link["crossover"].items()])]
        for n, c in link["crossover"].items():
            claims.append(f"Crossover of {n}: faster than the baseline up to "
                          f"{c['measured']['beats_baseline_up_to'] or 'no swept rate'} measured, "
                          f"up to {c['predicted']['overlapped']} predicted (overlapped model).")
    return "\n".join(out), claims


def _claims(sweep, base, pred, link) -> list[str]:
    out = []
    at = {(r["settings"]["rate"], r["settings"]["policy"]): r for r in sweep}
    h = at.get(("100mbit", "hybrid"))
    if h and "100mbit" in base:
        ratio = h["median_step_s"] / base["100mbit"]
        out.append(f"At 100 Mbit/s hybrid's step takes {ratio:.2f}x the baseline's "
                   f"({h['median_step_s']:.2f} s vs {base['100mbit']:.2f} s): "
                   f"{'PASS' if ratio <= STEP_RATIO_TARGET else 'FAIL'} against <= "
                   f"{STEP_RATIO_TARGET}.")
    u = at.get(("unthrottled", "hybrid"))
    if u and "unthrottled" in base:
        ratio = u["median_step_s"] / base["unthrottled"]
        out.append(f"Unthrottled, hybrid / baseline step time is {ratio:.2f}: "
                   f"{'PASS' if ratio <= 1.0 else 'FAIL'} against <= 1.00 (the codec's own time "
                   "is not hidden by a fast link).")
    k = [r["kernel_over_meter"] for r in sweep if r["kernel_over_meter"] is not None]
    pl = [r["payload_over_meter"] for r in sweep if r.get("payload_over_meter") is not None]
    if k:
        worst = max(k, key=lambda v: abs(v - 1))
        out.append(f"Kernel bytes per steady-state step are {min(k):.3f}-{max(k):.3f}x the "
                   f"meter's: {'PASS' if abs(worst - 1) <= BYTES_TOLERANCE else 'FAIL'} against "
                   f"{BYTES_TOLERANCE:.0%}" + (f"; less the measured 66 header bytes per packet "
                                              f"(Ethernet, IPv4, TCP with timestamps), the TCP "
                                              f"payload is {min(pl):.3f}-{max(pl):.3f}x the meter"
                                              if pl else "") + ".")
    if pred:
        lo, hi = PREDICTION_BAND
        checked = [p for p in pred.values() if p["role"] == "predicted"]
        for model in ("overlapped", "additive"):
            bad = [p for p in checked if not lo <= p["ratio"][model] <= hi]
            rs = [p["ratio"][model] for p in checked]
            if rs:
                out.append(f"Predicted / measured step time, {model} model, over the "
                           f"{len(checked)} rows not used to calibrate: {min(rs):.2f}-"
                           f"{max(rs):.2f}; {len(bad)} outside {lo}-{hi}"
                           + (": " + ", ".join(f"{p['rate']} {p['policy']} "
                                               f"{p['ratio'][model]:.2f}" for p in bad)
                              if bad else "") + ".")
        if link and checked:
            out += _where_off(checked, link["profile"])
    return out


def _where_off(checked, prof) -> list[str]:
    """The overlapped model's errors split by which term it predicts: compute (the
    unthrottled run's time) or the link (bytes / rate + latency)."""
    groups = {"compute": [], "link": []}
    for p in checked:
        c = prof["policies"][p["policy"]]["compute_s"]
        groups["compute" if p["predicted_s"]["overlapped"] == c else "link"].append(p)
    parts = []
    for name, ps in groups.items():
        if ps:
            rs = [p["ratio"]["overlapped"] for p in ps]
            parts.append(f"{len(ps)} rows where it predicts the {name} time are off by "
                         f"{min(rs):.2f}-{max(rs):.2f}")
    return ["Where the overlapped model is off: " + "; ".join(parts) + ". The link-bound rows "
            "are set by bytes / rate alone (tbf meters whole packets, so the kernel's bytes, "
            "headers included, are the ones that count); the latency term is "
            f"{prof['alpha_s']['overlapped'] * 1e3:.3f} ms per collective, negligible here. "
            "The compute-bound rows inherit the noise of the unthrottled row they are "
            "predicted from (the runs column gives its spread), on a machine shared with "
            "other work; rows near the balance of "
            "compute and transfer (1 Gbit/s for the baseline) also pay for overlap being "
            "partial. The additive model is off most where compute and transfer are both "
            "large: it adds what these 8 device threads on 2 cores do at the same time (gloo "
            "moves one device's bytes while XLA computes another's)."]
