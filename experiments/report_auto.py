"""RESULTS.md's sections on compression.auto across the two-hop rig
(experiments/network.py --hops, policy auto: network_auto*.json): per rate,
auto's step against the fastest of the policies it must match and the
baseline, what it chose, and its predicted step against the measured;
report.py calls auto_section."""
from __future__ import annotations

import statistics

from experiments.report_network import _f, _main_commit, _rows, _table
from tools.netns import rate_bits


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
