"""`compression.auto`: the trainer picks each message's codec from measured links.

    settings = runspec.read(cfg, n_devices)   # settings.auto: the AutoSettings, None if off
    run = runspec.build(settings.uncompressed())
    run, summary = decide(settings, settings.auto, run, mesh, workdir)  # the chosen policy
    print(table(summary))

With compression.auto="on" the run's uncompressed message plan is priced per
(mesh axis, kind): its bytes and collectives per step (jcomp.train.auto.stepbytes,
counted from shapes, not read from a compiled step: the choice must come
before the step it chooses for is compiled, a baseline compile of a large
model would cost minutes and memory for nothing else, and the planning CLI,
jcomp.train.plan, must price models no machine here holds), with rows of
d_model for activations. The links and codec costs come from
compression.profile (a JSON profile, jcomp.tune.load) or, with "", from
`tune.probe` on the run's own mesh at start. `tune.choose` picks per (axis,
kind) the codec of least predicted time within the default ladders cut by
compression.budget ("grad=int4:rot,act=int8"), with compression.overlap the
share of link time hidden behind compute. Its choices become policy entries
("data.grad": codec, ...) set on the run's settings
(`Settings.with_decision`), which are then built (`runspec.build`) as if the
user had written them.

With the probe and several processes, the per-hop route is weighed too
(`split_for`): the mesh split into one slow-hop group per process
(mesh.dcn_data) is probed and chosen for, and the route of less predicted
communication is taken (`autopick.pick_route`); the uncompressed reference stays the
mesh as given. compression.compute_s (seconds of a step's computation; 0:
unknown) turns the predicted communication into a predicted step time.

With compression.trial=N (N > 0) the model prunes and a short trial decides
(`autopick.weigh_by_trial`, jcomp.train.auto.trial): the uncompressed step is timed first
(N steps after one of warmup), which calibrates compute (its time less its
predicted communication); each candidate route whose predicted step is within
autopick.TRIAL_MARGIN of the best is then timed too, and the fastest measured is taken.
Beside each route's decision the trial weighs its variant at the budget's most
compressed codecs ("as given, fewest bytes"; `_fewest`): the model prices a
codec's work apart from the compute it shares the machine with, so it can drop
a codec the step measurably runs faster with.
The decision's predicted step is that trial's time. It is for what the model
cannot see: on two processes sharing CPU cores, the links' and codecs' work
contends with compute, and the model's error (up to ~27% on the two-hop rig)
exceeds the differences between the close candidates.

Entries the user sets are refused, not kept, when the fields are read
(jcomp.train.settings.auto).

A resume keeps the decision the newest checkpoint recorded (no probe, the
profile file unread) unless compression.auto="reprobe": that decides afresh,
and a policy other than the checkpoint's is refused (its state is laid out
for that policy; train the new choice in a new workdir).

The processes of a cluster must decide as one, or each compiles another step
and they wait on each other's collectives until a timeout: what a decision
rests on (the profile file's figures, the checkpoint's decision kept) is
compared across processes before it is used, and a difference is refused on
every process in one line (`jcomp.train.auto.basis`); the probe's and the trial's
timings are process 0's on every process, and a stop asked for during the
trial is agreed by all (jcomp.train.auto.trial).
"""
from __future__ import annotations

import logging

import jax

from jcomp import tune
from jcomp.gpt import mesh as mesh_lib
from jcomp.train.run import faults
from jcomp.train.auto import basis, stepbytes, trial
from jcomp.train.auto.pick import (AS_GIVEN, FEWEST, OUTER_ENTRY, overrides, pick_route,
                                   weigh_by_trial)
from jcomp.train.settings.auto import OUTER, OUTER_CODEC
from jcomp.train.settings.runspec import build

UsageError = faults.UsageError
_log = logging.getLogger(__name__)


def codec_budget(budget) -> dict | None:
    """The budget's codec kinds alone (what tune.choose takes)."""
    out = {k: v for k, v in (budget or {}).items() if k != OUTER}
    return out or None


# ------------------------------------------------------------------ deciding

def choose(run, profile: tune.Profile, budget, overlap: float, source: str,
           by: str = "time") -> dict:
    """The decision for `run` (its uncompressed RunSpec) as a summary dict: per
    entry the codec, the link figures used, raw and coded bytes and predicted
    seconds vs raw; the totals; and the profile itself. by: tune.choose's ("bytes":
    every entry at the most compressed codec the budget allows)."""
    msgs = stepbytes.by_entry(run)
    try:
        d = tune.choose(profile, msgs, budget=codec_budget(budget), overlap=overlap, by=by)
    except (TypeError, ValueError) as e:
        raise UsageError(f"compression.profile ({source}): {str(e).splitlines()[0]}") from None
    return summarize(d, profile, budget, source)


def summarize(d: tune.Decision, profile: tune.Profile, budget, source: str) -> dict:
    entries = {}
    for c in d.choices:
        link = profile.link(c.axis)
        entries[f"{c.axis}.{c.kind}"] = {
            "codec": c.codec, "latency_s": link.latency_s, "bytes_per_s": link.bytes_per_s,
            "raw_bytes": c.traffic.raw_bytes, "coded_bytes": c.coded_bytes,
            "collectives": c.traffic.collectives, "seconds": c.seconds,
            "raw_seconds": c.raw_seconds}
    return {"source": source, "device": d.device, "overlap": d.overlap, "budget": budget or {},
            "seconds": d.seconds, "raw_seconds": d.raw_seconds, "entries": entries,
            "profile": profile.to_dict()}


def with_compute(summary: dict, compute_s: float) -> dict:
    """The summary with predicted step seconds: compute_s plus the chosen and the
    uncompressed communication (None where compute_s is 0, not known)."""
    known = compute_s > 0
    return {**summary, "compute_s": compute_s,
            "step_s": compute_s + summary["seconds"] if known else None,
            "raw_step_s": compute_s + summary["raw_seconds"] if known else None}


def split_for(run, processes: int) -> int | None:
    """The mesh.dcn_data of the per-hop route auto weighs beside the mesh as
    given: one slow-hop group per process. None where there is none to weigh:
    the user split the data axis already, an outer loop runs, one process, or a
    process would hold fewer than two data ranks (the fast hop would be empty)."""
    return None if no_split(run, processes) else processes


def no_split(run, processes: int) -> str | None:
    """Why `split_for` has no split to weigh, or None where it has one."""
    d = run.mesh_shape[0]
    if run.dcn_data != 1:
        return f"the data axis is split already (mesh.dcn_data={run.dcn_data})"
    if run.outer:
        return f"an outer loop is set already (outer.every={run.outer.every})"
    if processes < 2:
        return "one process, so no slow hop lies between islands"
    if d % processes or d // processes < 2:
        return (f"mesh.data={d} does not give each of the {processes} processes two data "
                "ranks or more")
    return None


def with_decision(settings, summary: dict):
    """`settings` with the decision's codecs set as its compression entries, on
    its route (mesh.dcn_data, and its outer loop where it chose one)."""
    entries = {e: c for e, c in overrides(summary).items() if e != OUTER_ENTRY}
    return settings.with_decision(entries, summary.get("dcn_data", 1),
                                  (summary.get("outer") or {}).get("every", 0))


def decide(settings, s, run, mesh, workdir, rows=None):
    """-> (the RunSpec of `settings` (jcomp.train.settings.runspec.Settings) with
    the decision's policy, the decision's summary). `s`: its AutoSettings; `run`
    the uncompressed RunSpec of `settings`, `mesh` the run's mesh (probed when
    compression.profile is ''), `rows` this process's first batch rows (for
    compression.trial)."""
    kept, s = basis.basis(s, workdir)
    if kept is not None and s.mode == "on":
        step, summary = kept
        summary = {**summary, "source": f"kept from the checkpoint of step {step}"}
    else:
        flat, others, note = _candidates(settings, s, run, mesh)
        if s.trial:
            if rows is None:
                raise ValueError("compression.trial needs the run's first rows (rows=)")
            summary = _by_trial(settings, s, mesh, rows, flat, others)
        else:
            summary = pick_route(flat, others, s.compute_s) if others else flat
            summary = with_compute(summary, s.compute_s)
        if note:
            summary = {**summary, "not_weighed": note}
    chosen = build(with_decision(settings, summary))
    if s.mode == "reprobe":
        basis.check_reprobe(kept, summary)
    return chosen, summary


def _by_trial(settings, s, mesh, rows, flat: dict, others: dict) -> dict:
    with trial.Signals() as signals:
        def time_of(d):
            # An outer loop's trial times its inner steps and its syncs
            # (trial.sync_seconds), per inner step.
            cand = build(with_decision(settings, d))
            on = mesh_lib.make_mesh(cand.mesh_shape, dcn_data=cand.mesh_split())
            return trial.step_seconds(cand, on, rows, s.trial, stop=signals.agreed)
        try:
            return weigh_by_trial(flat, others, time_of, s.trial)
        except trial.Stopped:
            _log.warning("stop requested during compression.trial: nothing written")
            if jax.process_count() > 1:
                # Every process stops here (the stop was agreed); leaving the
                # cluster together keeps the coordination service, on process
                # 0, up until the others are gone.
                jax.distributed.shutdown()
            raise


def _probe(mesh, codecs=tune.DEFAULT_CODECS) -> tune.Profile:
    try:
        return tune.probe(mesh, codecs=codecs)
    except ValueError as e:
        raise UsageError(f"compression.profile='' (probe at start): {e}") from None


def _candidates(settings, s, run, mesh) -> tuple[dict, dict, str | None]:
    """(the decision for the mesh as given, {name: decision} of the other routes,
    a note where the budget allows an outer loop that is not weighed). The other
    routes are weighed only with the probe (a written profile has no figures for
    a mesh it was not written for) and where `split_for` offers a split, whose
    links are probed on the split mesh: the per hop route, and an outer loop
    across the split where the budget allows one (`outer_candidate`). With a
    trial, each route's fewest-bytes variant is among the others (`_fewest`)."""
    every = (s.budget or {}).get(OUTER)
    written = s.profile
    if written is None and s.profile_path:
        written = basis.load_profile(s.profile_path)
    if written is not None:
        source = f"profile {s.profile_path}"
        flat = choose(run, written, s.budget, s.overlap, source)
        return flat, _fewest(s, AS_GIVEN, flat, run, written, source), _not_weighed(
            every, "a written profile has no figures for another mesh than the run's")
    profile = _probe(mesh)
    flat = choose(run, profile, s.budget, s.overlap, "probed at start")
    fewest = _fewest(s, AS_GIVEN, flat, run, profile, "probed at start")
    k = split_for(run, jax.process_count())
    if k is None:
        return flat, fewest, _not_weighed(every, no_split(run, jax.process_count()))
    split_run = build(settings.with_split(k).uncompressed())
    links = _probe(mesh_lib.make_mesh(split_run.mesh_shape, dcn_data=k), codecs=()).links
    split_profile = tune.Profile(links=links, codecs=profile.codecs,
                                 device=f"{profile.device}; per hop: mesh.dcn_data={k}")
    split = {**choose(split_run, split_profile, s.budget, s.overlap, "probed at start"),
             "dcn_data": k}
    others = {**fewest, per_hop(k): split,
              **_fewest(s, per_hop(k), split, split_run, split_profile, "probed at start")}
    outer = outer_candidate(settings, s.budget, s.overlap, k, split_profile)
    if outer is not None:
        others[outer_name(outer)] = outer
    return flat, others, _not_weighed(every, outer is None and outer_unfit(settings, k, every))


def _fewest(s, name: str, d: dict, run, profile: tune.Profile, source: str) -> dict:
    """{name + FEWEST: the route's decision with every entry at the most compressed
    codec the budget allows} where a trial runs and it differs from `d` (the
    route's decision by predicted time); {} otherwise. The trial times it because
    the model prices codecs apart from compute, which on a shared machine they
    contend with or overlap: it can drop a codec that the step runs faster with."""
    if not s.trial:
        return {}
    most = choose(run, profile, s.budget, s.overlap, source, by="bytes")
    if overrides(most) == overrides(d):
        return {}
    return {name + FEWEST: {**most, **{k: d[k] for k in ("dcn_data",) if k in d}}}


def _not_weighed(every, why) -> str | None:
    """The decision's note where compression.budget allows an outer loop that
    was not weighed, saying why; None where it was, or is not allowed."""
    if not every or not why:
        return None
    return f"no outer loop weighed (compression.budget allows outer={every}): {why}"


def outer_unfit(settings, k: int, every: int) -> str | None:
    """Why the run cannot train under an outer loop across k islands syncing every
    `every` steps (`Settings.with_outer`), or None where it can."""
    return _outer_run(settings, k, every)[1]


def _outer_run(settings, k: int, every: int):
    """(the uncompressed RunSpec under that outer loop, None) or (None, why not)."""
    try:
        return build(settings.with_outer(k, every).uncompressed()), None
    except UsageError as e:
        return None, str(e)


def per_hop(k: int) -> str:
    return f"per hop (mesh.dcn_data={k})"


def outer_name(d: dict) -> str:
    return f"outer loop (every {d['outer']['every']}, mesh.dcn_data={d['dcn_data']})"


def outer_candidate(settings, budget, overlap: float, k: int,
                    split_profile: tune.Profile) -> dict | None:
    """The decision for training under an outer loop across the k slow-hop groups
    (`Settings.with_outer`), where the budget allows one (outer=H): codecs for the inner
    step's messages, which stay inside an island, and the sync's OUTER_CODEC
    bytes across the slow hop averaged over its H steps (stepbytes.outer_sync)
    as the entry OUTER_ENTRY. None where the budget does not allow it or the
    run cannot take it (e.g. train.steps < H)."""
    every = (budget or {}).get(OUTER)
    orun = _outer_run(settings, k, every)[0] if every else None
    if orun is None:
        return None
    d = choose(orun, split_profile, budget, overlap, "probed at start")
    sync = stepbytes.outer_sync(orun)
    link = split_profile.link(mesh_lib.DCN)
    seconds = tune.predict(split_profile, mesh_lib.DCN, sync, OUTER_CODEC, overlap)
    entry = {"codec": OUTER_CODEC, "latency_s": link.latency_s, "bytes_per_s": link.bytes_per_s,
             "raw_bytes": sync.raw_bytes, "coded_bytes": sync.coded_bytes(OUTER_CODEC),
             "collectives": sync.collectives, "seconds": seconds,
             "raw_seconds": tune.predict(split_profile, mesh_lib.DCN, sync, "none", overlap)}
    return {**d, "entries": {**d["entries"], OUTER_ENTRY: entry},
            "seconds": d["seconds"] + seconds, "dcn_data": k,
            "outer": {"every": every, "codec": OUTER_CODEC}}


