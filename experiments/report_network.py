"""RESULTS.md's sections on the throttled link (network.json with projection.json's
link profile; the two-hop rig's hops, outer-loop and compression.auto sweeps)
and on GPUs (gpu.json); report.py calls these. Streaming DiLoCo's sections are
in report_streaming.py."""
from __future__ import annotations

import functools
import os
import statistics
import subprocess

from experiments import linkprofile, network_launch
from tools.netns import BURST, rate_bits

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


def gpu_section(gpu: dict | None) -> str:
    if not gpu or gpu.get("backend") != "gpu":
        return ("No GPU was available when these results were made, so there are no GPU "
                "figures. `benchmarks/gpu.py` is ready for one: `pip install -e '.[cuda12]' && "
                "python -m benchmarks.gpu` measures codec encode/decode GB/s at 1-256 MiB, each "
                "cc.* op against its jax.lax twin, and train.py's step time per policy "
                "(`--tiny` is its CPU form, run by tests/benchmarks/test_gpu.py).")
    head = (f"`{gpu['command']}` on {gpu['device_count']} x {gpu['device_kind']}, JAX "
            f"{gpu['jax_version']}, {gpu['date']}; medians of {gpu['repeats']} calls.")
    codecs = _table(["codec", "MiB", "encode GB/s", "decode GB/s", "rel. error"],
                    [[r["codec"], f"{r['mib']:g}", _f(r["encode_gb_s"], ".1f"),
                      _f(r["decode_gb_s"], ".1f"), _f(r["rel_err"], ".2e")] for r in gpu["codecs"]])
    col = gpu["collectives"]
    ops = _table(["op", "axis size", "codec", "ms", "time vs lax", "bytes vs lax"],
                 [[r["op"], r["axis_size"], r["codec"], _f(r["time_s"] * 1e3, ".3f"),
                   _f(r["time_ratio"], ".2f"), _f(r["byte_ratio"], ".3f")] for r in col["rows"]])
    train = _table(["policy", "devices", "median step ms", "tokens/s"],
                   [[r["policy"], r.get("devices", "-"),
                     _f(r.get("median_step_s") and r["median_step_s"] * 1e3, ".1f"),
                     _f(r.get("tokens_per_s"), ".0f")] for r in gpu["train"]])
    return "\n\n".join([head, codecs, f"Mesh {col['mesh']}, {col['elements_per_device']} "
                        "float32 elements per device:", ops, train])


# The per-hop policies of experiments/network.py, compared with the flat hybrid.
PERHOP_POLICIES = {
    "perhop": "data messages raw inside a process and coded across, the rest raw",
    "hybrid_perhop": "the hybrid preset with its data messages coded across processes only",
}


def hops_section(net: dict) -> tuple[str, list[str]]:
    """(markdown, claims) for network_hops.json (experiments/network.py --hops):
    per link rate and policy, the median over repeats of the step time and of
    what crossed the slow hop, beside the meter's slow-hop bytes; time to the
    baseline's loss at each rate that has it."""
    commit = _main_commit(net)
    if commit is None:
        return "No successful network.py --hops run yet.", []
    sweep = _sweep(net, commit)
    s0 = sweep[0]["settings"]
    groups = {}
    for r in sweep:
        groups.setdefault((r["settings"]["rate"], r["settings"]["policy"]), []).append(r)
    med = lambda rs, k: (statistics.median(r[k] for r in rs)
                         if all(r.get(k) is not None for r in rs) else None)
    base = {rate: med(rs, "median_step_s") for (rate, p), rs in groups.items() if p == "baseline"}
    mesh = ", ".join(f"{k.split('.', 1)[1]}={v}" for k, v in s0["set"].items()
                     if k.startswith("mesh."))
    out = [f"{s0['procs']} processes x {8 // s0['procs']} CPU devices of {s0['config']} "
           f"({mesh or 'its mesh'}), each process in a network namespace of its own, the two "
           f"joined by a veth pair throttled by tc tbf (burst {s0.get('burst', BURST)}) at "
           "both ends: only what goes from one "
           "process to the other is throttled and counted (the slow hop); a process's own "
           f"devices talk over its unthrottled loopback. {s0['steps']} steps per run, medians "
           f"over the steps after the first {net.get('warm_steps', 2)}, then the median over "
           f"the runs of a row. Commit {commit[:7]}, on a 2-core machine shared with other work.",
           "", "Link MB/step: bytes that crossed the veth per steady-state step, both "
           "directions, headers included; payload: less 66 header bytes per packet. Meter "
           "(slow hop): jcomp.meter.wire's bytes on the 'dcn' axis x 8 devices, for runs that "
           "split the data axis (mesh.dcn_data); runs that do not leave the choice of route "
           "to gloo, and the meter cannot say which of their bytes cross.", ""]
    rows = []
    for (rate, policy), rs in groups.items():
        step, link, pay = (med(rs, k) for k in ("median_step_s", "kernel_bytes_per_step",
                                                  "tcp_payload_per_step"))
        slow = med(rs, "meter_slow_hop_bytes_per_step")
        rows.append([rate, policy, _f(step, ".3f"), _spread(rs[0]),
                     _f(step / base[rate], ".2f") if base.get(rate) else "n/a",
                     _f(link and link / 1e6, ".3f"), _f(pay and pay / 1e6, ".3f"),
                     _f(slow and slow / 1e6, ".3f"),
                     _f(pay / slow, ".3f") if pay and slow else "n/a",
                     _f(med(rs, "final_loss"), ".4f")])
    over = []  # rows that moved their bytes faster than the link's rate
    for (rate, policy), rs in groups.items():
        step, link, bits = med(rs, "median_step_s"), med(rs, "kernel_bytes_per_step"), \
            rate_bits(rate)
        if step and link and bits and link / 2 * 8 / bits > step:
            over.append(f"{rate} {policy} ({step:.3f} s; its {link / 2e6:.2f} MB each way need "
                        f"{link / 2 * 8 / bits:.3f} s at the rate)")
    failed = {}
    for r in net["rows"]:
        st = r["settings"]
        if r.get("commit") == commit and "error" in r and st["kind"] == "sweep":
            failed.setdefault((st["rate"], st["policy"]), []).append(r["error"])
    for (rate, policy), errs in failed.items():
        if (rate, policy) not in groups:
            rows.append([rate, policy, f"failed ({len(errs)} of {len(errs)} runs)", "-", "-",
                         "-", "-", "-", "-", "-"])
    out.append(_table(["link", "policy", "step s", "runs", "vs baseline", "link MB/step",
                       "payload MB/step", "meter slow hop MB/step", "payload/meter",
                       "final loss"], rows))
    if over:
        out += ["", "Faster than their link: tc's token bucket (tbf, burst "
                f"{s0.get('burst', BURST)}) starts full and lets a run send that much above "
                f"the rate, which can cover a {s0['steps']}-step run's excess; at the rate their "
                "step could not be shorter than the link's time for the bytes each way: "
                + "; ".join(over) + "."]
    if failed:
        out += ["", "Failed runs (the first line of each error): " + "; ".join(
            f"{rate} {policy}: " + errs[0].split(" | ")[0][:200]
            for (rate, policy), errs in failed.items())]
    claims = []
    for rate in dict.fromkeys(r["settings"]["rate"] for r in sweep):
        for name, what in PERHOP_POLICIES.items():
            h, p = groups.get((rate, "hybrid")), groups.get((rate, name))
            if h and p:
                ratio = med(p, "median_step_s") / med(h, "median_step_s")
                lk = med(p, "kernel_bytes_per_step") / med(h, "kernel_bytes_per_step")
                claims.append(f"Two hops at {rate}: {name} ({what}) takes {ratio:.2f}x the flat "
                              f"hybrid's step time and sends {lk:.2f}x its bytes over the slow "
                              "link (medians of the runs, side by side).")
    for rate, ttl in sorted((net.get("ttl_by_rate") or {}).items()):
        t_base = ttl["policies"].get("baseline", {}).get("time_s")
        out += ["", f"Time to the baseline's final val_loss ({ttl['target_val_loss']:.4f}) at "
                f"{rate} (training time, evaluation and compilation excluded):", "",
                _table(["policy", "reached at step", "time s", "vs baseline", "best val_loss"],
                       [[n, t["step"] if t["reached"] else f"not in {t['steps_run']} steps",
                         _f(t["time_s"], ".1f"),
                         _f(t["time_s"] / t_base, ".2f") if t["reached"] and t_base else "n/a",
                         _f(t["best_val_loss"], ".4f")] for n, t in ttl["policies"].items()])]
    return "\n".join(out), claims


# The outer-loop policies of experiments/network.py.
OUTER_POLICIES = tuple(n for n, p in network_launch.POLICIES.items() if "outer.every" in p)


def outer_section(net: dict) -> tuple[str, list[str]]:
    """(markdown, claims) for network_outer.json (experiments/network.py --hops
    with outer-loop policies): the two-hop table, then per outer row each
    sync's bytes on the link against the meter's, and the time to the
    baseline's loss at each rate."""
    text, _ = hops_section(net)
    commit = _main_commit(net)
    if commit is None:
        return text, []
    # Each run's own figures (sweep_rows keeps the first run's beside the median time).
    synced = [r for r in _rows(net, commit) if r["settings"]["kind"] == "sweep"
              and r.get("kernel_sync_bytes") is not None]
    groups = {}
    for r in synced:
        groups.setdefault((r["settings"]["rate"], r["settings"]["policy"]), []).append(r)
    med = lambda rs, k: statistics.median(r[k] for r in rs)
    rows = [[rate, policy, str(len(rs)),
             _f(med(rs, "kernel_bytes_per_step_without_sync"), ",.0f"),
             _f(med(rs, "kernel_sync_bytes") / 1e3, ".1f"),
             _f(med(rs, "meter_sync_bytes") / 1e3, ".1f"),
             _f(med(rs, "kernel_over_meter_sync"), ".3f")]
            for (rate, policy), rs in groups.items()]
    out = [text]
    if rows:
        out += ["", "Outer-loop rows: a step without a sync still sends a little across (the "
                "islands' mean loss for the log, and the coordination service's preemption "
                "check each step: small messages whose TCP headers dominate); a sync's bytes "
                "on the link are its step's kernel bytes less the median step without one, "
                "against the meter's (outer_bytes_per_sync, read from the compiled sync "
                "program, x 8 devices).", "",
                _table(["link", "policy", "runs", "link B per plain step", "link kB per sync",
                        "meter kB per sync", "link/meter"], rows)]
    claims = []
    for rate, ttl in sorted((net.get("ttl_by_rate") or {}).items()):
        pol = ttl["policies"]
        base = pol.get("baseline", {})
        every = [n for n in pol
                 if n not in OUTER_POLICIES and n != "baseline" and pol[n]["reached"]]
        best_every = min(every, key=lambda n: pol[n]["time_s"], default=None)
        for name in OUTER_POLICIES:
            t = pol.get(name)
            if not t or not base.get("reached"):
                continue
            what = (f"reaches it in {t['time_s']:.1f} s (step {t['step']}), "
                    f"{t['time_s'] / base['time_s']:.2f}x the baseline's {base['time_s']:.1f} s"
                    + (f" and {t['time_s'] / pol[best_every]['time_s']:.2f}x {best_every}'s"
                       if best_every else "") if t["reached"]
                    else f"does not reach it in {t['steps_run']} steps")
            claims.append(f"Outer loop across a {rate} link: {name} {what} (time to the "
                          f"baseline's loss {ttl['target_val_loss']:.4f}, one run each).")
    return "\n".join(out), claims


AUTO_POLICY = "auto"
AUTO_RIVALS = ("baseline", "hybrid", "hybrid_perhop")
AUTO_WITHIN_FASTEST, AUTO_OVER_BASELINE, AUTO_PREDICTION = 0.05, 0.03, 0.15


def _choice(auto: dict) -> str:
    """compression.auto's choice in a few words: its route and the coded entries,
    and where a trial took a route's fewest-bytes variant, that."""
    coded = [f"{e}={c}" for e, c in auto["codecs"].items() if c != "none"]
    route = (f"outer loop (every {auto['outer']['every']})" if auto.get("outer") else
             f"per hop (dcn_data={auto['dcn_data']})" if auto.get("dcn_data", 1) > 1 else "flat")
    fewest = ", fewest bytes" if (auto.get("trial") or {}).get("taken", "").endswith(
        "fewest bytes") else ""
    return f"{route}{fewest}: {', '.join(coded) or 'all raw'}"


def auto_section(net: dict) -> tuple[str, list[str]]:
    """(markdown, claims) for network_auto.json (experiments/network.py --hops with
    compression.auto beside the policies it must match): per rate, each
    policy's step (median over runs), auto's against the fastest and the
    baseline, what it chose, and its predicted step time against the measured.

    The prediction is the probe's: compute + the chosen communication (the
    decision's seconds). Compute is the baseline's step in one process
    (`--procs 1`: the same 8 devices and program, nothing between processes,
    its collectives over gloo on its own loopback), the median of those rows
    whatever their commit; without them, the
    unthrottled baseline's step less the communication the unthrottled probe
    predicts for it (the decision's raw seconds). The rig's link figure is the
    per-hop probe's 'dcn' bandwidth per device times the devices of a process
    (all of them cross at once), against tc's rate."""
    one = [r for r in net["rows"] if "error" not in r and r["settings"]["procs"] == 1
           and r["settings"]["policy"] == "baseline" and r["settings"]["kind"] == "sweep"]
    commit = _main_commit({"rows": [r for r in net["rows"] if r["settings"]["procs"] > 1]})
    if commit is None:
        return "No successful network.py run with compression.auto yet.", []
    rows = [r for r in _rows(net, commit) if r["settings"]["kind"] == "sweep"
            and r["settings"]["procs"] > 1]
    groups: dict = {}
    for r in rows:
        groups.setdefault(r["settings"]["rate"], {}).setdefault(r["settings"]["policy"], []).append(r)
    med = lambda rs, k: statistics.median(r[k] for r in rs)
    unthrottled = groups.get("unthrottled", {})
    compute, compute_from = None, ""
    if one:
        compute = med(one, "median_step_s")
        compute_from = (f"the baseline in one process, median of {len(one)} runs at "
                        f"{', '.join(sorted({r['commit'][:7] for r in one}))}")
    elif "baseline" in unthrottled and AUTO_POLICY in unthrottled:
        compute = med(unthrottled["baseline"], "median_step_s") - statistics.median(
            r["auto"]["predicted_raw_s"] for r in unthrottled[AUTO_POLICY])
        compute_from = ("the unthrottled baseline's step less the communication the "
                        "unthrottled probe predicts for it")
    s0 = rows[0]["settings"]
    per_process = 8 // s0["procs"]
    # Policies run beside the rivals are shown, not weighed against.
    shown = (*AUTO_RIVALS, *sorted({r["settings"]["policy"] for r in rows}
                                    - {AUTO_POLICY, *AUTO_RIVALS}))
    table, claims = [], []
    for rate, pol in groups.items():
        if AUTO_POLICY not in pol:
            continue
        steps = {p: med(rs, "median_step_s") for p, rs in pol.items()}
        rivals = {p: steps[p] for p in AUTO_RIVALS if p in steps}
        fastest = min(rivals, key=rivals.get) if rivals else None
        a = steps[AUTO_POLICY]
        autos = pol[AUTO_POLICY]
        choices = sorted({_choice(r["auto"]) for r in autos})
        tried = [r["auto"] for r in autos if "trial_step_s" in r["auto"]]
        if tried:  # compression.trial: the taken candidate's trial is the prediction
            predicted = statistics.median(a["trial_step_s"] for a in tried)
            model = statistics.median(a["trial"]["predicted_s"][a["trial"]["taken"]]
                                      for a in tried)
        else:
            predicted = (compute + statistics.median(r["auto"]["predicted_s"] for r in autos)
                         if compute is not None else None)
            model = predicted
        dcn = [links["dcn"]["bytes_per_s"] for r in autos
               for route, links in r["auto"].get("route_links", {}).items()
               if route.startswith("per hop") and "dcn" in links]
        bits = rate_bits(rate)
        link = statistics.median(dcn) * per_process if dcn else None
        table.append([rate] + [_f(steps.get(p), ".3f") for p in shown]
                     + [_f(a, ".3f"), _f(a / rivals[fastest], ".3f") if fastest else "n/a",
                        _f(a / steps["baseline"], ".3f") if "baseline" in steps else "n/a",
                        "; ".join(choices), _f(predicted, ".3f"),
                        _f(predicted / a, ".2f") if predicted else "n/a",
                        _f(model / a, ".2f") if model else "n/a",
                        _f(link and link / 1e6, ".2f"),
                        _f(link * 8 / bits, ".2f") if link and bits else "n/a"])
        if fastest:
            ok = a <= rivals[fastest] * (1 + AUTO_WITHIN_FASTEST) and (
                "baseline" not in steps or a <= steps["baseline"] * (1 + AUTO_OVER_BASELINE))
            pred_ok = predicted is not None and abs(predicted / a - 1) <= AUTO_PREDICTION
            claims.append(
                f"compression.auto at {rate}: {a:.3f} s per step, {a / rivals[fastest]:.3f}x the "
                f"fastest of {', '.join(rivals)} ({fastest}, {rivals[fastest]:.3f} s) and "
                + (f"{a / steps['baseline']:.3f}x the baseline: " if "baseline" in steps
                   else "no baseline run: ")
                + f"{'PASS' if ok else 'FAIL'} (within {AUTO_WITHIN_FASTEST:.0%} of the fastest"
                + (f", at most {AUTO_OVER_BASELINE:.0%} over the baseline" if "baseline" in steps
                   else "") + "); predicted "
                + (f"{predicted:.3f} s, {predicted / a:.2f}x measured: "
                   f"{'PASS' if pred_ok else 'FAIL'} (within {AUTO_PREDICTION:.0%})"
                   if predicted is not None else "n/a (no unthrottled baseline and auto rows)")
                + f"; chose {'; '.join(choices)}.")
    runs = sorted({len(rs) for pol in groups.values() for rs in pol.values()})
    out = [f"{s0['procs']} processes x {per_process} CPU devices of {s0['config']}, two hops as "
           f"above, {s0['steps']} steps per run, medians over the steps after the first "
           f"{net.get('warm_steps', 2)}, then over {'-'.join(map(str, runs))} runs per row, "
           f"repeat-major. Commit {commit[:7]}. auto: compression.auto=on with the probe at "
           "start (links of the mesh as given and of its per-hop split, codecs on every "
           "device at once), then the route and codecs of least predicted communication, or "
           "with compression.trial the fastest of the uncompressed step and the candidates "
           "predicted close to the best, each timed for a few steps at start. "
           f"Predicted: compute ({compute_from or 'not measured'}"
           f"{'' if compute is None else f': {compute:.3f} s'}"
           ") plus the chosen communication as the probe at that rate predicts it; with "
           "compression.trial (its runs' decisions have a trial), the taken candidate's time "
           "in the trial at start, and model: compute from the uncompressed trial plus the "
           "predicted communication. Probed "
           f"link: the per-hop probe's 'dcn' bandwidth per device x {per_process} devices "
           "crossing at once, against tc's rate.", "",
           _table(["link"] + [f"{p} s" for p in shown]
                  + ["auto s", "x fastest", "x baseline", "auto's choice", "predicted s",
                     "predicted/measured", "model/measured", "probed link MB/s", "x tc rate"],
                  table)]
    return "\n".join(out), claims
