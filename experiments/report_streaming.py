"""RESULTS.md's sections on Streaming DiLoCo across the two-hop rig: the
streaming sweep (experiments/network.py --hops with the policies diloco_f2 and
streaming) and experiments/overlap.py's probe of what can hide behind compute."""
from __future__ import annotations

import statistics

from experiments.report_network import _main_commit, _rows, _table


def _streaming_run(r: dict, warm: int) -> dict:
    """One outer-loop run's figures after its first `warm` steps: its median step,
    the amortized step (every step, sync run alone and merge over the steps), the
    steps carrying a start (less each run's first, which also pays for the
    program's first execution), the plain steps, the syncs run alone."""
    t = r["step_times_s"]
    carried = set(r.get("outer_carried_steps", []))
    later = lambda d: [v for s, v in sorted(d.items(), key=lambda kv: int(kv[0]))
                       if int(s) > warm]
    syncs, merges = later(r.get("outer_sync_s_by_step", {})), later(r.get("outer_apply_s_by_step", {}))
    steps = list(range(warm + 1, len(t) + 1))
    return {"step": r["median_step_s"],
            "amortized": (sum(t[warm:]) + sum(syncs) + sum(merges)) / len(steps),
            "plain": [t[s - 1] for s in steps if s not in carried],
            "carried": [t[s - 1] for s in sorted(carried) if s > warm][1:],
            "alone": syncs, "merges": merges,
            # A start on a thread beside its step's, timed there (first left out too).
            "threaded": later(r.get("outer_start_s_by_step", {}))[1:]}


def streaming_section(net: dict, warm: int = 2) -> tuple[str, list[str]]:
    """(markdown, claims) for network_streaming.json (experiments/network.py --hops
    with the policies baseline, diloco_f2 and streaming): per policy the median
    step and the amortized one (medians over the runs), the step carrying a
    start against a plain step plus a blocking sync (what the carried start
    hid: plain + sync alone - carried; where the start ran on a thread of its
    own, its time there beside), and the time to the baseline's loss."""
    commit = _main_commit(net)
    if commit is None:
        return "No rows.", []
    by = {}
    for r in _rows(net, commit):
        if r["settings"]["kind"] == "sweep":
            by.setdefault(r["settings"]["policy"], []).append(_streaming_run(r, warm))
    med = statistics.median
    pooled = lambda runs, k: [v for x in runs for v in x[k]]
    rows = []
    for name, runs in by.items():
        car, alone, mer, thr = (pooled(runs, k) for k in ("carried", "alone", "merges",
                                                           "threaded"))
        rows.append([name, str(len(runs)), f"{med(x['step'] for x in runs):.3f} s",
                     f"{med(x['amortized'] for x in runs):.3f} s",
                     f"{med(pooled(runs, 'plain')):.3f} s",
                     f"{med(car):.3f} s" if car else "-",
                     f"{med(thr):.3f} s" if thr else "-",
                     f"{med(alone):.3f} s" if alone else "-",
                     f"{med(mer):.3f} s" if mer else "-"])
    first = next(r for r in _rows(net, commit))
    s = first["settings"]
    per_process = first.get("devices", 8) // s["procs"]
    out = [f"At {commit[:7]}, {s['rate']}, {s['procs']} processes x {per_process} CPU "
           f"device{'s' if per_process > 1 else ''}, medians over the runs (steps after the "
           f"first {warm}): a step carrying a start leaves out each run's first such step, "
           "which also pays for the program's first execution.", "",
           _table(["policy", "runs", "median step", "amortized step", "plain step",
                   "step carrying a start", "the start on its thread", "sync run alone",
                   "merge"], rows)]
    claims = []
    f2, st = by.get("diloco_f2"), by.get("streaming")
    if f2 and st and pooled(st, "carried") and pooled(f2, "alone"):
        plain, carrying = med(pooled(st, "plain")), med(pooled(st, "carried"))
        hidden = plain + med(pooled(f2, "alone")) - carrying
        out += ["", f"Hidden by carrying: a plain step {plain:.3f} s plus diloco_f2's sync "
                f"{med(pooled(f2, 'alone')):.3f} s, against the carrying step "
                f"{carrying:.3f} s: {hidden:+.3f} s."]
        if pooled(st, "threaded"):
            out[-1] += (f" The start took {med(pooled(st, 'threaded')):.3f} s on its thread "
                        "(any wait for the step's program included).")
        claims.append(
            f"Streaming (2 fragments, delay 1) across a {s['rate']} link: its amortized step "
            f"is {med(x['amortized'] for x in st):.3f} s against {med(x['amortized'] for x in f2):.3f} s "
            f"for the same fragments blocking; the step carrying a start hid {hidden:+.3f} s "
            "of the blocking sync's time.")
    ttl = (net.get("ttl_by_rate") or {}).get(s["rate"])
    if ttl:
        pol = ttl["policies"]

        def hit(n, p):
            if not p["reached"]:
                return f"{n} not reached"
            spread = (f", {min(p['times_s']):.2f}-{max(p['times_s']):.2f} s over "
                      f"{len(p['times_s'])} runs" if p.get("times_s") else "")
            return f"{n} {p['time_s']:.2f} s (step {p['step']}{spread})"
        runs = "the median of its runs" if any("times_s" in p for p in pol.values()) else \
            "one run each"
        out += ["", f"Time to the baseline's val_loss {ttl['target_val_loss']:.4f} ({runs}; "
                "syncs and merges counted): " + ", ".join(hit(n, p) for n, p in pol.items())
                + "."]
    return "\n".join(out), claims


def overlap_section(ov: dict) -> str:
    """experiments/overlap.py's rows: does the exchange hide behind compute?"""
    threads = all("two_threads_s" in r for r in ov["rows"])
    rows = [[str(r["devices_per_process"]), "yes" if r["local_collective"] else "no",
             f"{r['compute_s']:.3f} s", f"{r['exchange_s']:.3f} s", f"{r['one_program_s']:.3f} s",
             f"{r['two_programs_s']:.3f} s"]
            + ([f"{r['two_threads_s']:.3f} s"] if threads else [])
            + [f"{r['hidden_s']:.3f} s"]
            + ([f"{r['hidden_threads_s']:.3f} s"] if threads else []) for r in ov["rows"]]
    return "\n".join([
        f"`{ov['command']}` at {ov['commit'][:7]}: {ov['rate']} (bucket {ov['burst']}), "
        f"{ov['exchange_mb']} MB per device exchanged, medians of {ov['repeats']}. hidden = "
        "compute + exchange - one program" + (" (or - two threads: the exchange's program "
                                              "dispatched from a thread of its own)"
                                              if threads else "") + ".", "",
        _table(["devices per process", "collective in the compute", "compute", "exchange",
                "one program", "two programs"] + (["two threads"] if threads else [])
               + ["hidden in one program" if threads else "hidden"]
               + (["hidden in two threads"] if threads else []), rows)])
