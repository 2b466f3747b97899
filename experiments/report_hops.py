"""RESULTS.md's sections on the two-hop rig (experiments/network.py --hops): the
hops sweep (network_hops.json: per-hop policies against the flat hybrid) and
the outer-loop sweep (network_outer.json: each sync's bytes on the link, the
time to the baseline's loss); report.py calls these. compression.auto's
sections are report_auto.py's, Streaming DiLoCo's report_streaming.py's."""
from __future__ import annotations

import statistics

from experiments import network_launch
from experiments.report_network import _f, _main_commit, _rows, _spread, _sweep, _table
from tools.netns import BURST, rate_bits


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
