"""How compression.auto picks among its candidate decisions: by the model's
prediction (`pick_route`) or by a short trial (`weigh_by_trial`).

    best = pick_route(flat, {"per hop (mesh.dcn_data=2)": split, ...}, compute_s)
    best = weigh_by_trial(flat, others, time_of, steps)   # time_of(d) -> seconds

A decision is compression.auto's summary dict (jcomp.train.auto.decide): per entry
its codec and predicted seconds, the total `seconds`, the uncompressed
`raw_seconds`, and for another route than the mesh as given its `dcn_data`
and, for an outer loop, `outer`. Nothing here probes, compiles or reads a
config: these are the rules alone, so they can be tested on made-up figures.
"""
from __future__ import annotations

RAW = "uncompressed"       # the trial's name for the run sending raw on the mesh as given
AS_GIVEN = "as given"      # the decision for the mesh as given, by predicted time
OUTER_ENTRY = "dcn.outer"  # the decision's entry for an outer loop's syncs
FEWEST = ", fewest bytes"  # a route's variant at the budget's most compressed codecs
# An outer loop costs loss (compression.budget's outer=H accepts it), so it is
# taken only where it saves at least this share of the step: less is within
# the run-to-run spread of step times measured here (up to 19% on the two-hop
# rig at fast rates).
OUTER_GAIN = 0.2
# A trial times a candidate predicted within this share of the best: the
# model's error reached 27% on the two-hop rig, so a tighter cut could drop
# the winner.
TRIAL_MARGIN = 0.5


def overrides(summary: dict) -> dict:
    """{"data.grad": codec, ...}: the decision as policy entries."""
    return {entry: e["codec"] for entry, e in summary["entries"].items()}


def _routes(flat: dict, others: dict) -> dict:
    return {name: {"seconds": d["seconds"], "links": d["profile"]["links"]}
            for name, d in {AS_GIVEN: flat, **others}.items()}


def pick_route(flat: dict, others: dict, compute_s: float = 0.0) -> dict:
    """Of the decision for the mesh as given and `others` ({name: decision} of
    other routes: per hop, an outer loop), the one of least predicted
    communication (a tie keeps the mesh as given, then the earlier named), an
    outer loop only where it saves OUTER_GAIN of the step (compute_s plus the
    communication; compute_s 0: not known, communication alone), with every
    route's seconds and links; its uncompressed reference is the mesh as
    given's."""
    best = flat
    for d in others.values():
        if not d.get("outer") and d["seconds"] < best["seconds"]:
            best = d
    for d in others.values():
        if d.get("outer") and _outer_pays(compute_s + d["seconds"], compute_s + best["seconds"]):
            best = d
    out = {k: v for k, v in best.items() if k != "routes"}
    return {**out, "raw_seconds": flat["raw_seconds"], "routes": _routes(flat, others)}


def _outer_pays(outer_s: float, every_step_s: float) -> bool:
    return outer_s < (1.0 - OUTER_GAIN) * every_step_s


def as_raw(d: dict) -> dict:
    """The decision `d` with every entry sending raw: the uncompressed run."""
    entries = {e: {**v, "codec": "none", "coded_bytes": v["raw_bytes"],
                   "seconds": v["raw_seconds"]} for e, v in d["entries"].items()}
    return {**d, "entries": entries, "seconds": d["raw_seconds"]}


def _is_raw(d: dict) -> bool:
    return set(overrides(d).values()) <= {"none"} and d.get("dcn_data", 1) == 1


def weigh_by_trial(flat: dict, others: dict, time_of, steps: int,
                   margin: float = TRIAL_MARGIN) -> dict:
    """The decision a trial takes among the uncompressed run, `flat` (the mesh as
    given) and `others` ({name: decision}: per hop, an outer loop). time_of(d) ->
    measured seconds per step of decision d. The uncompressed step is timed
    first: compute = its time less its predicted communication. A candidate is
    timed where compute + its predicted communication is within `margin` of the
    best such prediction; one sending raw on the mesh as given is the
    uncompressed run, not timed twice. The fastest measured is taken (a tie
    keeps the uncompressed run, then the mesh as given), an outer loop only
    where it saves OUTER_GAIN of the fastest every-step candidate's time."""
    cands = {AS_GIVEN: flat, **others}
    raw = as_raw(flat)
    measured = {RAW: time_of(raw)}
    compute = max(measured[RAW] - flat["raw_seconds"], 0.0)
    predicted = {RAW: compute + flat["raw_seconds"],
                 **{name: compute + d["seconds"] for name, d in cands.items()}}
    best = min(predicted.values())
    for name, d in cands.items():
        if not _is_raw(d) and predicted[name] <= best * (1 + margin):
            measured[name] = time_of(d)
    every_step = [n for n in measured if n == RAW or not cands[n].get("outer")]
    taken = min(every_step, key=measured.get)
    for name in measured:
        if name not in every_step and _outer_pays(measured[name], measured[taken]):
            taken = name
    out = {k: v for k, v in (raw if taken == RAW else cands[taken]).items() if k != "routes"}
    if others:
        out["routes"] = _routes(flat, others)
    return {**out, "raw_seconds": flat["raw_seconds"], "compute_s": compute,
            "step_s": measured[taken], "raw_step_s": measured[RAW],
            "trial": {"steps": steps, "margin": margin, "compute_s": compute,
                      "predicted_s": predicted, "measured_s": measured, "taken": taken}}
