"""A cost model of the throttled link of experiments/network.py, calibrated from
its own measurements and checked against every other row of its sweep.

    profile = calibrate(rows, calibration_rate="100mbit")
    predict(profile, policy, rate_bits) -> {"additive": s, "overlapped": s}

Every row is the median of its repeated runs (`combine`). Inputs, per policy,
from the unthrottled row only: its median step time C (the
compute, with a loopback that is fast next to it), the kernel's bytes per
step K (headers included: tbf meters whole packets) and the collectives per
step M that jcomp.meter.wire counts in the compiled step. The link: beta = the tbf
rate / 8 bytes/s, and alpha, a per-collective latency, calibrated on one
throttled run (the baseline at the calibration rate) as what its step time
holds beyond C and K / beta. Two models:

  additive    T = C + K / beta + alpha_add * M         (projection.py's NeoX model:
                                                        no overlap)
  overlapped  T = max(C, K / beta + alpha_ovl * M)     (compute hides behind the
                                                        link, or the link behind it)

alpha is calibrated separately for each, from the same run. A latency cannot
be negative: where the calibration run took less than a model's other terms
(the additive model's C + K / beta, when compute and transfer overlap), that
model cannot explain the run, its alpha is set to 0 and the value the run
asked for is kept as alpha_calibrated_s. The crossover of a policy is the
highest link rate at which it is faster than the baseline: measured, the
highest swept rate where its median step time is below the baseline's; and
predicted, where the model's two step times are equal (bisection on the rate).
"""
from __future__ import annotations

import math
import statistics

MODELS = ("additive", "overlapped")


def _rate_bits(rate: str):
    if rate == "unthrottled":
        return None
    units = {"gbit": 1e9, "mbit": 1e6, "kbit": 1e3, "bit": 1.0}
    for unit, mult in units.items():
        if rate.endswith(unit):
            return float(rate[: -len(unit)]) * mult
    raise ValueError(f"rate {rate!r}: want 'unthrottled' or a number with a unit in "
                     f"{', '.join(units)}")


def sweep_rows(network: dict, commit: str | None = None) -> list[dict]:
    """The successful sweep rows of network.json (of `commit`, or of the newest
    commit with the most of them: a rerun after a change replaces the old sweep),
    one per rate and policy: `combine` of its repeated runs."""
    rows = [r for r in network["rows"] if r["settings"]["kind"] == "sweep" and "error" not in r]
    if commit is None and rows:
        commit = main_commit(rows)
    runs = {}
    for r in rows:
        if r["commit"] == commit:
            runs.setdefault((r["settings"]["rate"], r["settings"]["policy"]), []).append(r)
    return [combine(rs) for rs in runs.values()]


def _median(values):
    """statistics.median of the values that are not None; None if there are none."""
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def combine(runs: list[dict]) -> dict:
    """One row from the repeated runs of one rate and policy: the median of their
    median step times and of their kernel and payload bytes per step (the step's
    bytes are the same in every run; its time is not), with every run's median
    step time kept in `repeat_step_s`. The rest (losses, meter bytes) is the first
    run's: training is deterministic."""
    runs = sorted(runs, key=lambda r: r["settings"].get("repeat", 0))
    row = dict(runs[0], settings={k: v for k, v in runs[0]["settings"].items() if k != "repeat"})
    row["repeats"] = len(runs)
    row["repeat_step_s"] = [r["median_step_s"] for r in runs]
    row["median_step_s"] = _median(row["repeat_step_s"])
    meter = row.get("meter_bytes_per_step")
    for key, ratio in (("kernel_bytes_per_step", "kernel_over_meter"),
                       ("tcp_payload_per_step", "payload_over_meter")):
        row[key] = _median(r.get(key) for r in runs)
        row[ratio] = row[key] / meter if row[key] is not None and meter else None
    return row


def main_commit(rows: list[dict]) -> str:
    """The commit with the most rows; among equals, the one whose rows are newest."""
    counts, newest = {}, {}
    for r in rows:
        counts[r["commit"]] = counts.get(r["commit"], 0) + 1
        newest[r["commit"]] = max(newest.get(r["commit"], ""), r.get("date", ""))
    return max(counts, key=lambda c: (counts[c], newest[c]))


def calibrate(rows: list[dict], calibration_rate: str) -> dict:
    """The link profile (see the module doc) from the unthrottled rows and the
    baseline's row at `calibration_rate`."""
    beta = _rate_bits(calibration_rate)
    if beta is None:
        raise ValueError("the calibration rate must be a throttled one")
    beta /= 8
    at = {(r["settings"]["rate"], r["settings"]["policy"]): r for r in rows}
    free = {p: r for (rate, p), r in at.items() if rate == "unthrottled"}
    if "baseline" not in free or ("baseline" not in {p for (rt, p) in at if rt == calibration_rate}):
        raise ValueError(f"calibration needs the baseline's unthrottled row and its "
                         f"{calibration_rate} row")
    policies = {}
    for p, r in free.items():
        if r.get("kernel_bytes_per_step") is None:
            raise ValueError(f"the unthrottled {p} row has no kernel bytes")
        policies[p] = dict(compute_s=r["median_step_s"], kernel_bytes=r["kernel_bytes_per_step"],
                           collectives=r.get("collectives_per_step"))
    b = policies["baseline"]
    t_cal = at[(calibration_rate, "baseline")]["median_step_s"]
    m = b["collectives"] or 0.0
    transfer = b["kernel_bytes"] / beta
    raw = {"additive": (t_cal - b["compute_s"] - transfer) / m if m else 0.0,
           "overlapped": (t_cal - transfer) / m if m else 0.0}
    alpha = {k: max(v, 0.0) for k, v in raw.items()}
    return dict(calibration_rate=calibration_rate, beta_bytes_per_s=beta, alpha_s=alpha,
                alpha_calibrated_s=raw,
                calibration_step_s=t_cal, calibration_transfer_s=transfer,
                effective_bytes_per_s=b["kernel_bytes"] / t_cal,
                latency_counted=bool(m), policies=policies)


def predict(profile: dict, policy: str, rate_bits) -> dict:
    """{model: predicted step seconds} of `policy` on a link of `rate_bits` (None:
    unthrottled, where both models give the compute time)."""
    p = profile["policies"][policy]
    if rate_bits is None:
        return {m: p["compute_s"] for m in MODELS}
    beta = rate_bits / 8
    msgs = p["collectives"] or 0.0
    link = p["kernel_bytes"] / beta
    return {"additive": p["compute_s"] + link + profile["alpha_s"]["additive"] * msgs,
            "overlapped": max(p["compute_s"], link + profile["alpha_s"]["overlapped"] * msgs)}


def compare(profile: dict, rows: list[dict]) -> list[dict]:
    """Every row with its predictions and predicted / measured per model."""
    out = []
    for r in rows:
        s = r["settings"]
        if s["policy"] not in profile["policies"]:
            continue
        pred = predict(profile, s["policy"], _rate_bits(s["rate"]))
        role = ("compute" if s["rate"] == "unthrottled" else
                "calibration" if (s["rate"], s["policy"]) == (profile["calibration_rate"],
                                                              "baseline") else "predicted")
        out.append(dict(rate=s["rate"], policy=s["policy"], measured_s=r["median_step_s"],
                        role=role, predicted_s=pred,
                        ratio={m: pred[m] / r["median_step_s"] for m in MODELS}))
    return out


def _order(rate: str) -> float:
    bits = _rate_bits(rate)
    return math.inf if bits is None else bits


def measured_crossover(rows: list[dict], policy: str) -> dict:
    """The highest swept rate at which `policy` is faster than the baseline, and the
    next higher swept rate (where it is not), from the median step times."""
    t = {}
    for r in rows:
        t.setdefault(r["settings"]["rate"], {})[r["settings"]["policy"]] = r["median_step_s"]
    rates = sorted((rt for rt in t if {"baseline", policy} <= set(t[rt])), key=_order)
    wins = [rt for rt in rates if t[rt][policy] < t[rt]["baseline"]]
    if not wins:
        return dict(beats_baseline_up_to=None, loses_from=rates[0] if rates else None)
    best = wins[-1]
    higher = [rt for rt in rates if _order(rt) > _order(best)]
    return dict(beats_baseline_up_to=best, loses_from=higher[0] if higher else None,
                consistent=all(rt in wins for rt in rates if _order(rt) <= _order(best)))


def predicted_crossover(profile: dict, policy: str, model: str = "overlapped",
                        lo: float = 1e6, hi: float = 1e12) -> float | None:
    """Bits/s above which `policy` stops beating the baseline in `model`; inf if it
    wins even unthrottled, None if it never wins in [lo, hi]."""
    gap = lambda bits: (predict(profile, policy, bits)[model]
                        - predict(profile, "baseline", bits)[model])
    if gap(None) < 0:
        return math.inf
    if gap(lo) >= 0:
        return None
    if gap(hi) < 0:
        return math.inf
    for _ in range(100):  # in log space: the rates span six decades
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if gap(mid) < 0 else (lo, mid)
    return math.sqrt(lo * hi)


def crossovers(profile: dict, rows: list[dict]) -> dict:
    out = {}
    for policy in profile["policies"]:
        if policy == "baseline":
            continue
        out[policy] = dict(measured=measured_crossover(rows, policy),
                           predicted_bits={m: predicted_crossover(profile, policy, m)
                                           for m in MODELS})
    return out


def human_rate(bits) -> str:
    if bits is None:
        return "never"
    if math.isinf(bits):
        return "unthrottled"
    for unit, mult in (("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bits >= mult:
            return f"{bits / mult:.3g} {unit}"
    return f"{bits:.3g} bit/s"


def link_report(network: dict, calibration_rate: str = "100mbit") -> dict:
    """What projection.py stores: the profile, every row compared, crossovers."""
    rows = sweep_rows(network)
    profile = calibrate(rows, calibration_rate)
    compared = compare(profile, rows)
    cross = crossovers(profile, rows)
    for c in cross.values():  # JSON has no inf
        c["predicted"] = {m: human_rate(v) for m, v in c["predicted_bits"].items()}
        c["predicted_bits"] = {m: (None if v is None or math.isinf(v) else v)
                               for m, v in c["predicted_bits"].items()}
    return dict(commit=rows[0]["commit"], profile=profile, rows=compared, crossover=cross)
