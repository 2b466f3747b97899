"""compression.auto (jcomp.train.auto.decide), its byte model (jcomp.train.auto.stepbytes)
and the planning CLI (jcomp.train.plan): in process with made-up profiles, then
train.py in subprocesses (marked e2e). Two processes deciding as one are in
experiments/checks/test_auto_long.py."""
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from jcomp import tune
from jcomp.train.auto import basis, decide as auto, pick as autopick, stepbytes
from jcomp.train.auto import table as auto_table
from jcomp.train.settings import auto as auto_settings, runspec
from tests.train.tinyconfig import tiny_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
H100 = os.path.join(ROOT, "configs", "profiles", "h100_8x_nvlink_400g.json")
AXES = ("dcn", "data", "tensor", "pipeline")
CODECS = ("bf16", "int8", "int4:rot")


def profile(bytes_per_s, latency_s=1e-6, codec_s_per_byte=1e-13) -> tune.Profile:
    cost = tune.CodecCost(codec_s_per_byte, codec_s_per_byte)
    return tune.Profile(links={a: tune.Link(latency_s, bytes_per_s) for a in AXES},
                        codecs={c: cost for c in CODECS}, device="made up")


FAST, SLOW = profile(1e13), profile(1e8, latency_s=1e-5)


def write(path, prof):
    tune.save(prof, str(path))
    return str(path)


def uncompressed_run(**overrides):
    cfg = tiny_config(**{"compression.auto": "on", **overrides})
    return cfg, runspec.build(runspec.read(cfg, 8).uncompressed())


# ------------------------------------------------------------------ deciding

def test_a_fast_profile_sends_raw_and_a_slow_one_compresses_and_the_run_takes_it():
    cfg, run = uncompressed_run()
    fast = auto.choose(run, FAST, None, 0.0, "test")
    assert set(auto.overrides(fast).values()) == {"none"}
    assert set(fast["entries"]) == {"data.grad", "data.param", "tensor.act", "tensor.act_grad",
                                    "pipeline.act", "pipeline.act_grad"}
    slow = auto.choose(run, SLOW, None, 0.0, "test")
    chosen = auto.overrides(slow)
    assert chosen["data.grad"] == "int4:rot" and chosen["data.param"] == "int8"
    assert {chosen[e] for e in ("tensor.act", "tensor.act_grad", "pipeline.act",
                                "pipeline.act_grad")} == {"int8"}
    assert slow["seconds"] < slow["raw_seconds"]
    e = slow["entries"]["data.grad"]
    assert e["coded_bytes"] < e["raw_bytes"] and e["bytes_per_s"] == 1e8
    assert slow["profile"] == SLOW.to_dict()
    final = runspec.build(auto.with_decision(runspec.read(cfg, 8), slow))
    for entry, codec in chosen.items():
        assert str(final.policy[tuple(entry.split("."))]) == codec


def test_budget_and_overlap_move_the_choice():
    _, run = uncompressed_run()
    capped = auto.overrides(auto.choose(run, SLOW, auto_settings.parse_budget("grad=int8,act=none"),
                                        0.0, "test"))
    assert capped["data.grad"] == "int8" and capped["tensor.act"] == "none"
    assert capped["tensor.act_grad"] == "int8"  # a budget names one kind only
    hidden = auto.choose(run, SLOW, None, 1.0, "test")  # all link time hidden: codecs only cost
    assert set(auto.overrides(hidden).values()) == {"none"}


def test_the_dcn_hop_gets_entries_of_its_own():
    _, run = uncompressed_run(**{"mesh.data": 4, "mesh.pipeline": 1, "mesh.dcn_data": 2})
    slow_dcn = tune.Profile(links={**FAST.links, "dcn": tune.Link(1e-5, 1e8)},
                            codecs=FAST.codecs, device="fast inside, slow between")
    chosen = auto.overrides(auto.choose(run, slow_dcn, None, 0.0, "test"))
    assert chosen["dcn.grad"] == "int4:rot" and chosen["data.grad"] == "none"


def test_the_per_hop_route_is_taken_only_where_it_predicts_less():
    """Two processes joined by a slow link: the flat data axis crosses it, the
    split mesh keeps half of the data ranks inside a process."""
    cfg, run = uncompressed_run(**{"mesh.data": 4, "mesh.pipeline": 1})
    k = auto.split_for(run, processes=2)
    assert k == 2
    split_run = runspec.build(runspec.read(cfg, 8).with_split(k).uncompressed())
    slow_data = tune.Profile(links={**FAST.links, "data": tune.Link(1e-5, 1e8)},
                             codecs=FAST.codecs, device="flat: the data ring crosses the link")
    slow_dcn = tune.Profile(links={**FAST.links, "dcn": tune.Link(1e-5, 1e8)},
                            codecs=FAST.codecs, device="split: fast inside, slow between")
    flat = auto.choose(run, slow_data, None, 0.0, "test")
    split = auto.choose(split_run, slow_dcn, None, 0.0, "test")
    taken = autopick.pick_route(flat, {auto.per_hop(k): {**split, "dcn_data": k}})
    assert taken["dcn_data"] == 2 and split["seconds"] < flat["seconds"]
    assert taken["raw_seconds"] == flat["raw_seconds"]  # against the mesh as given, raw
    assert set(taken["routes"]) == {"as given", "per hop (mesh.dcn_data=2)"}
    final = runspec.build(auto.with_decision(runspec.read(cfg, 8), taken))
    assert final.mesh_split() == 2 and str(final.policy["dcn", "grad"]) == "int4:rot"
    assert "route taken: per hop, mesh.dcn_data=2" in auto_table.table(taken)
    # Everything fast: both routes send raw, and a tie keeps the mesh as given.
    same = autopick.pick_route(auto.choose(run, FAST, None, 0.0, "test"),
                           {auto.per_hop(k): {**auto.choose(split_run, FAST, None, 0.0, "test"),
                                              "dcn_data": k}})
    assert "dcn_data" not in same or same["dcn_data"] == 1
    assert runspec.build(auto.with_decision(runspec.read(cfg, 8), same)).mesh_split() == 1


def _routes_on_a_slow_link():
    cfg, run = uncompressed_run(**{"mesh.data": 4, "mesh.pipeline": 1})
    split_run = runspec.build(runspec.read(cfg, 8).with_split(2).uncompressed())
    slow_data = tune.Profile(links={**FAST.links, "data": tune.Link(1e-5, 1e8)},
                             codecs=FAST.codecs, device="flat")
    slow_dcn = tune.Profile(links={**FAST.links, "dcn": tune.Link(1e-5, 1e8)},
                            codecs=FAST.codecs, device="split")
    return (cfg, auto.choose(run, slow_data, None, 0.0, "test"),
            {**auto.choose(split_run, slow_dcn, None, 0.0, "test"), "dcn_data": 2})


def _timer(seconds_by_route):
    """time_of for weigh_by_trial from made-up seconds, keyed by the route a
    decision takes: what it was asked to time, in order."""
    asked = []

    def time_of(d):
        name = ("uncompressed" if set(auto.overrides(d).values()) == {"none"} else
                "per hop" if d.get("dcn_data", 1) > 1 else "as given")
        asked.append(name)
        return seconds_by_route[name]
    return time_of, asked


def test_a_trial_takes_the_fastest_measured_route_not_the_models_pick():
    cfg, flat, split = _routes_on_a_slow_link()
    assert autopick.pick_route(flat, {auto.per_hop(2): split})["dcn_data"] == 2  # the model's pick
    # Measured, the mesh as given steps faster than per hop (as on the rig at 1 Gbit/s).
    time_of, asked = _timer({"uncompressed": 1.0, "as given": 0.30, "per hop": 0.36})
    taken = autopick.weigh_by_trial(flat, {auto.per_hop(2): split}, time_of, 3, margin=100.0)
    assert asked == ["uncompressed", "as given", "per hop"]  # the uncompressed step first
    assert taken["trial"]["taken"] == "as given" and taken.get("dcn_data", 1) == 1
    assert auto.overrides(taken) == auto.overrides(flat)
    assert taken["step_s"] == 0.30 and taken["raw_step_s"] == 1.0
    assert taken["trial"]["compute_s"] == pytest.approx(1.0 - flat["raw_seconds"])
    assert set(taken["routes"]) == {"as given", "per hop (mesh.dcn_data=2)"}
    assert runspec.build(auto.with_decision(runspec.read(cfg, 8), taken)).mesh_split() == 1
    text = auto_table.table(taken)
    assert "trial (3 steps each, median): uncompressed 1 s, as given 0.3 s" in text
    assert "taken: as given" in text and "predicted step: 0.3 s (its trial)" in text

    # Uncompressed measured fastest: every entry sends raw on the mesh as given.
    time_of, _ = _timer({"uncompressed": 0.2, "as given": 0.30, "per hop": 0.36})
    raw = autopick.weigh_by_trial(flat, {auto.per_hop(2): split}, time_of, 3, margin=100.0)
    assert raw["trial"]["taken"] == "uncompressed" and _is_all_none(raw)
    assert raw["seconds"] == raw["raw_seconds"] == flat["raw_seconds"]
    assert runspec.build(auto.with_decision(runspec.read(cfg, 8), raw)).mesh_split() == 1


def _is_all_none(d):
    return set(auto.overrides(d).values()) == {"none"} and d.get("dcn_data", 1) == 1


def test_a_trial_times_only_candidates_the_model_puts_within_its_margin():
    cfg, flat, split = _routes_on_a_slow_link()
    assert flat["seconds"] > 1.25 * split["seconds"]  # per hop sends less across
    # Compute 0: the uncompressed trial equals its predicted communication.
    time_of, asked = _timer({"uncompressed": flat["raw_seconds"], "as given": 0.0,
                             "per hop": 0.0})
    autopick.weigh_by_trial(flat, {auto.per_hop(2): split}, time_of, 3, margin=0.25)
    assert asked == ["uncompressed", "per hop"]  # as given predicts > 1.25x per hop's
    # A fast link: the mesh as given sends raw, which is the uncompressed run, timed once.
    _, run = uncompressed_run(**{"mesh.data": 4, "mesh.pipeline": 1})
    fast = auto.choose(run, FAST, None, 0.0, "test")
    time_of, asked = _timer({"uncompressed": 0.5})
    taken = autopick.weigh_by_trial(fast, {}, time_of, 3)
    assert asked == ["uncompressed"] and taken["trial"]["taken"] == "uncompressed"
    assert "routes" not in taken


def test_a_trial_weighs_the_budgets_most_compressed_codecs_beside_the_models_pick(tmp_path):
    path = write(tmp_path / "fast.json", FAST)
    cfg, run = uncompressed_run(**{"compression.profile": path, "compression.trial": 3})
    s = runspec.read(cfg, 8).auto
    flat, others, _ = auto._candidates(runspec.read(cfg, 8), s, run, mesh=None)
    assert set(auto.overrides(flat).values()) == {"none"}  # the model: raw on a fast link
    name = autopick.AS_GIVEN + autopick.FEWEST
    assert list(others) == [name]
    most = auto.overrides(others[name])
    assert most["data.grad"] == "int4:rot" and most["data.param"] == "int8"
    assert {most[e] for e in ("tensor.act", "tensor.act_grad")} == {"int8"}
    assert others[name]["seconds"] > flat["seconds"]  # slower, by the model

    # Measured, it steps fastest: the trial takes it, and the run trains with it.
    def time_of(d):
        return 0.8 if auto.overrides(d) == most else 1.0
    taken = autopick.weigh_by_trial(flat, others, time_of, 3)
    assert taken["trial"]["taken"] == name and taken["step_s"] == 0.8
    assert set(taken["trial"]["measured_s"]) == {autopick.RAW, name}  # raw as given: one run
    assert "codecs taken: the budget's most compressed on that route" in auto_table.table(taken)
    assert "codecs taken" not in auto_table.table(flat)
    final = runspec.build(auto.with_decision(runspec.read(cfg, 8), taken))
    for entry, codec in most.items():
        assert str(final.policy[tuple(entry.split("."))]) == codec

    # The budget caps it; where it is the model's pick already, nothing more is timed;
    # without a trial the model alone decides and no variant is weighed.
    capped = runspec.read(tiny_config(**{"compression.auto": "on", "compression.profile": path,
                                          "compression.trial": 3, "compression.budget":
                                          "grad=int8,act=none,act_grad=none"}), 8).auto
    _, others, _ = auto._candidates(runspec.read(cfg, 8), capped, run, mesh=None)
    assert set(auto.overrides(others[name]).values()) == {"int8", "none"}
    slow = runspec.read(tiny_config(**{"compression.auto": "on", "compression.trial": 3,
                                        "compression.profile": write(tmp_path / "slow.json",
                                                                     SLOW)}), 8).auto
    assert auto._candidates(runspec.read(cfg, 8), slow, run, mesh=None)[1] == {}
    assert auto._candidates(runspec.read(cfg, 8), dataclasses.replace(s, trial=0), run, mesh=None)[1] == {}


def _outer_allowed(budget="outer=10", dcn_bytes_per_s=1e5):
    cfg, run = uncompressed_run(**{"mesh.data": 4, "mesh.pipeline": 1, "train.steps": 40})
    split_run = runspec.build(runspec.read(cfg, 8).with_split(2).uncompressed())
    slow_dcn = tune.Profile(links={**FAST.links, "dcn": tune.Link(1e-5, dcn_bytes_per_s)},
                            codecs=FAST.codecs, device="split")
    b = auto_settings.parse_budget(budget)
    split = {**auto.choose(split_run, slow_dcn, b, 0.0, "test"), "dcn_data": 2}
    return cfg, split, auto.outer_candidate(runspec.read(cfg, 8), b, 0.0, 2, slow_dcn)


def test_an_outer_loop_is_a_candidate_only_where_the_budget_allows_it():
    _, _, none = _outer_allowed(budget="grad=int4:rot")
    assert none is None
    cfg, split, outer = _outer_allowed()
    assert outer["outer"] == {"every": 10, "codec": "int4:rot"} and outer["dcn_data"] == 2
    sync = outer["entries"]["dcn.outer"]
    assert sync["codec"] == "int4:rot" and sync["coded_bytes"] < sync["raw_bytes"] / 6
    # Nothing crosses the slow hop between syncs: no dcn.grad or dcn.param entry.
    assert not {e for e in outer["entries"] if e.startswith("dcn.")} - {"dcn.outer"}
    # On a very slow hop the outer loop predicts least and is taken; the run trains
    # under it, the inner codecs as chosen.
    taken = autopick.pick_route(split, {auto.outer_name(outer): outer})
    assert taken["outer"] and taken["seconds"] == outer["seconds"] < split["seconds"]
    run = runspec.build(auto.with_decision(runspec.read(cfg, 8), taken))
    assert run.outer.every == 10 and run.outer.codec == "int4:rot" and run.mesh_split() == 2
    assert run.outer.lr == 1.0 and run.outer.momentum == 0.0
    assert "route taken: an outer loop across mesh.dcn_data=2 islands, syncing every 10" \
        in auto_table.table(taken)
    # On a fast hop it sends less still, but saves under OUTER_GAIN of a step with
    # 10 ms of compute: the every-step route is kept.
    _, split, outer = _outer_allowed(dcn_bytes_per_s=1e13)
    assert outer["seconds"] < split["seconds"]
    assert not autopick.pick_route(split, {auto.outer_name(outer): outer}, 0.01).get("outer")
    # A trial takes it only where it measured OUTER_GAIN faster than the best other.
    name = auto.outer_name(outer)
    for outer_s, taken in ((0.85, "as given"), (0.7, name)):
        times = iter([1.0, 0.9, outer_s])  # timed in this order: raw, as given, outer
        d = autopick.weigh_by_trial(split, {name: outer}, lambda d: next(times), 3, margin=100.0)
        assert d["trial"]["measured_s"] == {"uncompressed": 1.0, "as given": 0.9, name: outer_s}
        assert d["trial"]["taken"] == taken and bool(d.get("outer")) == (taken == name)
    # A run too short for one sync cannot take it.
    cfg3, _ = uncompressed_run(**{"mesh.data": 4, "mesh.pipeline": 1, "train.steps": 5})
    assert auto.outer_candidate(runspec.read(cfg3, 8), {"outer": 10}, 0.0, 2, FAST) is None


def test_an_allowed_outer_loop_that_is_not_weighed_says_why_in_the_table():
    """compression.budget's outer=H is never silently dropped: a written profile,
    a mesh with no split to make, or a run that cannot take the loop each gives
    its reason in the decision, which the table prints."""
    cfg, run = uncompressed_run(**{"mesh.data": 4, "mesh.pipeline": 1})
    s = auto_settings.AutoSettings(mode="on", profile=FAST, profile_path="fast.json",
                                   budget={"outer": 10}, overlap=0.0, compute_s=0.0, trial=0)
    flat, others, note = auto._candidates(runspec.read(cfg, 8), s, run, mesh=None)
    assert others == {} and note == ("no outer loop weighed (compression.budget allows "
                                     "outer=10): a written profile has no figures for another "
                                     "mesh than the run's")
    assert note in auto_table.table({**flat, "not_weighed": note})
    _, no_outer = auto._candidates(runspec.read(cfg, 8), dataclasses.replace(s, budget={"grad": "int8"}), run, mesh=None)[1:]
    assert no_outer is None  # nothing allowed, nothing to explain
    assert auto.no_split(run, 1) == "one process, so no slow hop lies between islands"
    assert auto.no_split(run, 4) == ("mesh.data=4 does not give each of the 4 processes two "
                                     "data ranks or more")
    assert auto.no_split(run, 2) is None
    _, split = uncompressed_run(**{"mesh.data": 4, "mesh.pipeline": 1, "mesh.dcn_data": 2})
    assert auto.no_split(split, 2) == "the data axis is split already (mesh.dcn_data=2)"
    short, _ = uncompressed_run(**{"mesh.data": 4, "mesh.pipeline": 1, "train.steps": 5})
    why = auto.outer_unfit(runspec.read(short, 8), 2, 10)
    assert why and "train.steps" in why, why
    assert auto.outer_unfit(runspec.read(cfg, 8), 2, 10) is None


def test_budget_outer_is_parsed_apart_from_the_codec_kinds():
    assert auto_settings.parse_budget("grad=int8,outer=10") == {"grad": "int8", "outer": 10}
    assert auto.codec_budget({"grad": "int8", "outer": 10}) == {"grad": "int8"}
    assert auto.codec_budget({"outer": 10}) is None
    for bad in ("outer=1", "outer=x", "outer=-3", "outer=10:x"):
        with pytest.raises(runspec.UsageError, match=rf"^compression.budget='{bad}': outer="):
            auto_settings.parse_budget(bad)


def test_budget_outer_beyond_the_measured_interval_needs_an_opt_in():
    """The outer loop's loss rests on H=10 (and H=50, much worse): H up to 10 is
    admitted, a larger H only as outer=H:extrapolate, and the refusal names the
    evidence and the opt-in."""
    assert auto_settings.parse_budget(f"outer={auto_settings.MEASURED_OUTER_H}") == {"outer": auto_settings.MEASURED_OUTER_H}
    assert auto_settings.parse_budget("outer=4") == {"outer": 4}
    with pytest.raises(runspec.UsageError, match=r"outer=11 is beyond the interval .*"
                                                 r"H=10: \+2.16% .* outer=11:extrapolate"):
        auto_settings.parse_budget("outer=11")
    assert auto_settings.parse_budget("grad=int8,outer=50:extrapolate") == {"grad": "int8", "outer": 50}


@pytest.mark.slow
def test_outer_sync_bytes_match_the_compiled_sync():
    """stepbytes.outer_sync against the meter's reading of the compiled
    uncompressed sync of the tiny model across 2 islands: within 2%."""
    import jax

    from jcomp.gpt import mesh as mesh_lib
    from jcomp.train.outer import delay as outerdelay
    from jcomp.train.state import resume
    cfg, _ = uncompressed_run(**{"mesh.data": 4, "mesh.pipeline": 1, "train.steps": 40})
    out = runspec.read(cfg, 8).with_outer(2, 10)
    run = runspec.build(dataclasses.replace(out, outer=dataclasses.replace(out.outer, codec="none")))
    mesh = mesh_lib.make_mesh(run.mesh_shape, dcn_data=run.mesh_split())
    tx = run.optim.tx(run.train.steps)
    make = resume.init_params(run)
    shapes = jax.eval_shape(make)
    syncs = outerdelay.syncs_for(run, mesh, shapes, tx)
    syncs.prepare(resume.init_state(run, make(), mesh, tx, shapes))
    t = stepbytes.outer_sync(run)
    assert t.raw_bytes * 10 == pytest.approx(syncs.bytes_per_sync[0], rel=0.02)


def test_no_route_is_weighed_where_there_is_no_split_to_make():
    _, run = uncompressed_run(**{"mesh.data": 4, "mesh.pipeline": 1})
    assert auto.split_for(run, processes=1) is None  # nothing slow between processes
    assert auto.split_for(run, processes=4) is None  # one data rank per process
    _, split = uncompressed_run(**{"mesh.data": 4, "mesh.pipeline": 1, "mesh.dcn_data": 2})
    assert auto.split_for(split, processes=2) is None  # the user split it already


def test_compute_seconds_turn_communication_into_a_predicted_step():
    _, run = uncompressed_run()
    slow = auto.choose(run, SLOW, None, 0.0, "test")
    unknown = auto.with_compute(slow, 0.0)
    assert unknown["step_s"] is None and "predicted step" not in auto_table.table(unknown)
    known = auto.with_compute(slow, 0.25)
    assert known["step_s"] == pytest.approx(0.25 + slow["seconds"])
    assert known["raw_step_s"] == pytest.approx(0.25 + slow["raw_seconds"])
    assert "predicted step: " in auto_table.table(known)


@pytest.mark.parametrize("field,value,named", [
    ("compression.compute_s", -1.0, "compression.compute_s=-1.0"),
    ("compression.compute_s", float("inf"), "compression.compute_s=inf"),
    ("compression.trial", -1, "compression.trial=-1"),
    ("compression.trial", True, "compression.trial=True"),
    ("compression.trial", 10 ** 9, "compression.trial=1000000000; allowed: an int in [0, 100]"),
    ("compression.trial", 101, "compression.trial=101; allowed: an int in [0, 100]"),
    ("compression.auto", "maybe", "compression.auto='maybe'"),
    ("compression.budget", "grad=int2", "compression.budget='grad=int2'"),
    ("compression.budget", "grad", "compression.budget='grad'"),
    ("compression.budget", "weights=int8", "compression.budget='weights=int8'"),
    ("compression.overlap", 1.5, "compression.overlap=1.5"),
    ("compression.overlap", float("nan"), "compression.overlap=nan"),
    ("compression.data.grad", "int8", "compression.data.grad='int8'"),
    ("compression.policy", "hybrid", "compression.policy='hybrid'"),
    ("compression.schedule.data.grad", "int8@2", "compression.schedule.data.grad='int8@2'"),
])
def test_bad_settings_name_their_field(field, value, named):
    with pytest.raises(runspec.UsageError) as e:
        runspec.read(tiny_config(**{"compression.auto": "on", field: value}), 8).auto
    assert str(e.value).startswith(named)


def test_a_trial_and_a_given_compute_time_are_refused_together():
    with pytest.raises(runspec.UsageError, match=r"^compression.compute_s=0.3 with "
                       r"compression.trial=3: the trial measures"):
        runspec.read(tiny_config(**{"compression.auto": "on", "compression.trial": 3,
                                     "compression.compute_s": 0.3}), 8).auto


def test_auto_off_is_none_and_a_bare_schedule_start_is_kept():
    assert runspec.read(tiny_config(), 8).auto is None
    s = runspec.read(tiny_config(**{"compression.auto": "on",
                                     "compression.schedule.data.grad": "@2"}), 8).auto
    assert s.mode == "on" and s.profile is None and s.overlap == 0.0


def test_a_profile_without_an_axis_of_the_mesh_is_refused_naming_the_profile(tmp_path):
    _, run = uncompressed_run()
    partial = tune.Profile(links={"data": tune.Link(1e-6, 1e9)}, codecs=FAST.codecs, device="x")
    with pytest.raises(runspec.UsageError, match=r"^compression.profile .*no link for mesh axis"):
        auto.choose(run, partial, None, 0.0, "profile x")


def _mesh8():
    from jcomp.gpt import mesh as mesh_lib
    _, run = uncompressed_run()
    return mesh_lib.make_mesh(run.mesh_shape, dcn_data=run.mesh_split())


def _checkpoint(workdir, step, decision):
    d = workdir / "checkpoints" / str(step)
    (d / "meta").mkdir(parents=True)
    (d / "meta" / "metadata").write_text(json.dumps({"auto": decision}))
    (d / "commit_success.txt").write_text("")


def test_a_resume_keeping_its_decision_reads_no_profile(tmp_path):
    """docs/trainer.md: a resume keeps the checkpoint's decision and does not read
    the profile file, which may be gone; a fresh run reads it and names it."""
    missing = str(tmp_path / "gone.json")
    cfg, run = uncompressed_run(**{"compression.profile": missing})
    s = runspec.read(cfg, 8).auto  # the file is not read here
    assert s.profile_path == missing and s.profile is None
    with pytest.raises(runspec.UsageError, match=r"^compression.profile='.*gone.json': No such"):
        auto.decide(runspec.read(cfg, 8), s, run, _mesh8(), str(tmp_path / "fresh"))
    workdir = tmp_path / "w"
    _checkpoint(workdir, 4, auto.choose(run, SLOW, None, 0.0, "profile gone.json"))
    chosen, summary = auto.decide(runspec.read(cfg, 8), s, run, _mesh8(), str(workdir))
    assert summary["source"] == "kept from the checkpoint of step 4"
    assert str(chosen.policy["data", "grad"]) == "int4:rot"
    # reprobe decides afresh, so it reads the file.
    with pytest.raises(runspec.UsageError, match=r"^compression.profile='.*gone.json'"):
        auto.decide(runspec.read(cfg, 8), dataclasses.replace(s, mode="reprobe"), run, _mesh8(), str(workdir))


def test_a_profile_with_absurd_figures_is_refused_naming_the_field(tmp_path):
    path = tmp_path / "absurd.json"
    data = FAST.to_dict()
    data["links"]["data"] = {"latency_s": 1e308, "bytes_per_s": 5e-324}
    path.write_text(json.dumps(data))
    cfg, run = uncompressed_run(**{"compression.profile": str(path)})
    with pytest.raises(runspec.UsageError) as e:
        auto.decide(runspec.read(cfg, 8), runspec.read(cfg, 8).auto, run, _mesh8(), str(tmp_path / "w"))
    assert str(e.value).startswith(f"compression.profile={str(path)!r}: profile.links['data']: "
                                   "Link.latency_s must be a number in [0, 60]"), str(e.value)


def test_saved_reads_the_newest_complete_checkpoints_decision(tmp_path):
    assert basis.saved(str(tmp_path)) is None
    for step, codec, done in ((2, "int8", True), (4, "bf16", True), (6, "none", False)):
        d = tmp_path / "checkpoints" / str(step)
        (d / "meta").mkdir(parents=True)
        (d / "meta" / "metadata").write_text(json.dumps(
            {"auto": {"entries": {"data.grad": {"codec": codec}}}}))
        if done:
            (d / "commit_success.txt").write_text("")
    step, summary = basis.saved(str(tmp_path))
    assert step == 4 and auto.overrides(summary) == {"data.grad": "bf16"}


# ------------------------------------------------------------------ bytes

def test_step_bytes_match_the_compiled_uncompressed_step():
    """The shapes-only count against the meter's reading of the compiled tiny step:
    every (axis, kind) within 2% (the compiled one adds small reductions XLA
    folds into the messages' collectives)."""
    import jax
    import numpy as np

    from jcomp.gpt import mesh as mesh_lib
    from jcomp.train.state import resume
    from jcomp.train.state.stepcache import StepCache, global_batch
    _, run = uncompressed_run()
    mesh = mesh_lib.make_mesh(run.mesh_shape, dcn_data=run.mesh_split())
    tx = run.optim.tx(run.train.steps)
    make = resume.init_params(run)
    shapes = jax.eval_shape(make)
    state = resume.init_state(run, make(), mesh, tx, shapes)
    rows = np.zeros((run.train.batch_size, run.data.seq_len + 1), np.int32)
    _, report = StepCache(run, mesh, tx, shapes).train(
        run.phases[-1][1], state, global_batch(mesh, rows, run.train.batch_size))
    plan = run.plan(run.phases[-1][1])
    kinds = {m.name: m.entry.partition(".")[2] for m in plan.messages()}
    measured = tune.messages_from(report, kinds)
    mine = stepbytes.by_entry(run)
    assert set(measured) == set(mine)
    for key, t in mine.items():
        assert t.raw_bytes == pytest.approx(measured[key].raw_bytes, rel=0.02), key
    assert mine["data", "grad"].raw_bytes == measured["data", "grad"].raw_bytes


def test_neox20b_is_planned_from_shapes_on_more_devices_than_exist():
    from configs import neox20b
    cfg = neox20b.get_config()
    run = runspec.build(runspec.read(cfg, 192).uncompressed())
    msgs = stepbytes.by_entry(run)
    # The layers' parameters split over tensor 4 x pipeline 4, the untied embedding
    # and head over tensor only; float32, (12-1)/12 of them sent each way.
    d, f, n_layers, vocab = 6144, 24576, 44, 50432
    layers, embed = n_layers * (4 * d * d + 2 * d * f), 2 * vocab * d
    expected = (layers / 16 + embed / 4) * 4 * 11 / 12
    assert msgs["data", "grad"].raw_bytes == pytest.approx(expected, rel=0.01)
    assert msgs["tensor", "act"].dtype == "bfloat16" and msgs["tensor", "act"].row == 6144


def test_plan_states_a_standard_bf16_step_beside_jcomps_own():
    from configs import neox20b
    from jcomp.train import plan
    cfg = neox20b.get_config()
    run = runspec.build(runspec.read(cfg, 192).uncompressed())
    mine, std, per = stepbytes.by_entry(run), plan.standard_bf16(run), stepbytes.by_message(run)
    # bf16 gradients, the embedding and head on one of the 4 stages each.
    d, f, n_layers, vocab = 6144, 24576, 44, 50432
    layers, embed = n_layers * (4 * d * d + 2 * d * f), 2 * vocab * d
    expected = (layers / 16 + embed / 4 / 4) * 2 * 11 / 12
    for kind in ("grad", "param"):
        assert std["data", kind].raw_bytes == pytest.approx(expected, rel=0.01)
        assert std["data", kind].dtype == "bfloat16"
        assert std["data", kind].collectives == mine["data", kind].collectives
    # No output all-reduce over the pipeline: only the stages' sends.
    assert std["pipeline", "act"].raw_bytes == pytest.approx(per["stage_send"][0])
    assert std["pipeline", "act_grad"].raw_bytes == pytest.approx(per["stage_send_grad"][0])
    # The embedding's tensor all-reduce runs on its stage only.
    assert std["tensor", "act"].raw_bytes == pytest.approx(
        mine["tensor", "act"].raw_bytes - per["embed_sum"][0] * 3 / 4)
    prof = tune.load(H100)
    text = plan.plan_text(runspec.read(cfg, 192), prof, {}, 0.0)
    (line,) = [l for l in text.splitlines() if l.startswith("baselines:")]
    std_s = sum(tune.predict(prof, a, t, "none", 0.0) for (a, _), t in std.items())
    raw_s = sum(tune.predict(prof, a, t, "none", 0.0) for (a, _), t in mine.items())
    assert f"{raw_s * 1e3:.4g} ms" in line and "standard bf16" in line
    assert f"{std_s * 1e3:.4g} ms" in line and std_s < raw_s


# ------------------------------------------------------------------ the CLIs

def _cli(*args, timeout=120):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.e2e
def test_plan_cli_on_neox20b_prints_the_table_beside_hybrid_paper():
    r = _cli("-m", "jcomp.train.plan", f"--profile={H100}", "--config=configs/neox20b.py")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert "mesh data=12, tensor=4, pipeline=4" in lines[0]
    body = {l.split()[0]: l.split() for l in lines[2:8]}
    assert set(body) == {"data.grad", "data.param", "tensor.act", "tensor.act_grad",
                         "pipeline.act", "pipeline.act_grad"}
    assert body["data.grad"][-2] == "int4"  # hybrid_paper's codec beside auto's
    assert "hybrid_paper" in lines[8] and "uncompressed" in lines[8]


@pytest.mark.e2e
def test_plan_cli_bad_profile_is_one_line_exit_2(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"device": "x", "links": {"data": {"latency_s": -1, "bytes_per_s": 1}}, '
                   '"codecs": {}}')
    r = _cli("-m", "jcomp.train.plan", f"--profile={bad}", "--config=configs/neox20b.py")
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("plan: error: --profile=")
    assert "latency_s" in r.stderr


@pytest.mark.e2e
@pytest.mark.parametrize("args,named", [
    (["--devices=1000000000000000"], "--devices=1000000000000000; allowed: 1 to 1048576"),
    (["--devices=0"], "--devices=0; allowed: 1 to 1048576"),
    (["--devices=abc"], "argument --devices: invalid int value: 'abc'"),
    (["--overlap"], "argument --overlap: expected one argument"),
    (["--no-such-flag=1"], "unrecognized arguments: --no-such-flag=1"),
])
def test_plan_cli_bad_arguments_are_one_line_exit_2(args, named):
    r = _cli("-m", "jcomp.train.plan", f"--profile={H100}", "--config=configs/neox20b.py",
             *args, timeout=60)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.count("\n") == 1 and r.stderr.startswith(f"plan: error: {named}"), r.stderr
    missing = _cli("-m", "jcomp.train.plan", f"--profile={H100}", timeout=60)
    assert missing.returncode == 2 and missing.stderr.count("\n") == 1
    assert missing.stderr.startswith("plan: error: the following arguments are required: "
                                     "--config"), missing.stderr


@pytest.mark.e2e
@pytest.mark.parametrize("text,named", [
    ("def get_config(:\n", "SyntaxError at line 1"),
    ("def get_config():\n    return undefined_name\n",
     "get_config() raised NameError: name 'undefined_name' is not defined (line 2)"),
    ("def get_config():\n    return None\n",
     "get_config() returned None (a missing return statement?), not a ConfigDict"),
])
def test_plan_cli_broken_config_file_is_one_line_exit_2(tmp_path, text, named):
    bad = tmp_path / "broken.py"
    bad.write_text(text)
    r = _cli("-m", "jcomp.train.plan", f"--profile={H100}", f"--config={bad}", timeout=60)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith(f"plan: error: --config={bad}: {named}"), r.stderr


# ------------------------------------------------------------------ train.py

TINY = ["--config=configs/tiny.py", "--config.compression.auto=on", "--config.train.steps=4",
        "--config.train.log_every=1", "--config.checkpoint.every=2",
        "--config.train.eval_every=4"]


def _train_env():
    return dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=(
        "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"))


def _train(workdir, *args, timeout=300):
    return subprocess.run([sys.executable, "train.py", f"--workdir={workdir}", *TINY, *args],
                          cwd=ROOT, env=_train_env(), capture_output=True, text=True,
                          timeout=timeout)


def _records(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def _auto_records(workdir):
    return [r["auto"] for r in _records(workdir) if "auto" in r]


@pytest.fixture(scope="module")
def auto_runs(tmp_path_factory):
    """A run on a fast profile and one on a slow profile, side by side."""
    base = tmp_path_factory.mktemp("auto")
    fast, slow = write(base / "fast.json", FAST), write(base / "slow.json", SLOW)
    runs = {"fast": (str(base / "w_fast"), fast), "slow": (str(base / "w_slow"), slow)}
    procs = {name: subprocess.Popen(
        [sys.executable, "train.py", f"--workdir={w}", *TINY, f"--config.compression.profile={p}"],
        cwd=ROOT, env=_train_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for name, (w, p) in runs.items()}
    out = {}
    for name, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=400)
        assert proc.returncode == 0, stderr[-3000:]
        out[name] = {"workdir": runs[name][0], "profile": runs[name][1], "stdout": stdout}
    return out


@pytest.mark.e2e
def test_a_fast_profile_trains_uncompressed_and_records_the_decision(auto_runs):
    r = auto_runs["fast"]
    table = r["stdout"].split("compression.auto: codecs chosen", 1)[1].splitlines()
    assert "(profile " + r["profile"] + ")" in table[0]
    rows = {l.split()[0]: l.split() for l in table[2:8]}
    assert set(rows) == {"data.grad", "data.param", "tensor.act", "tensor.act_grad",
                         "pipeline.act", "pipeline.act_grad"}
    assert all(row[5] == "none" for row in rows.values())  # after "1 us, 1e+04 GB/s"
    assert "predicted communication per step" in table[8]
    records = _records(r["workdir"])
    decision = records[0]["auto"]  # before the first step's record
    assert set(auto.overrides(decision).values()) == {"none"}
    assert decision["profile"] == FAST.to_dict()
    assert records[1]["step"] == 1 and records[1]["compression"] == "none"


@pytest.mark.e2e
def test_a_slow_profile_trains_with_the_codecs_it_chose(auto_runs):
    r = auto_runs["slow"]
    [decision] = _auto_records(r["workdir"])
    chosen = auto.overrides(decision)
    assert chosen["data.grad"] == "int4:rot" and chosen["tensor.act"] == "int8"
    first = next(x for x in _records(r["workdir"]) if x.get("step") == 1)
    assert "data.grad_reduce=int4:rot" in first["compression"]
    assert "tensor.block_exit=int8" in first["compression"]
    assert first["compressed"] is True


@pytest.mark.e2e
def test_a_trial_times_the_candidates_and_trains_with_the_fastest(tmp_path):
    """The slow profile's codecs against the uncompressed step, each timed for a
    step on this machine: whichever was faster is what the run trains with."""
    prof = write(tmp_path / "slow.json", SLOW)
    workdir = str(tmp_path / "w")
    r = _train(workdir, f"--config.compression.profile={prof}", "--config.compression.trial=1")
    assert r.returncode == 0, r.stderr[-3000:]
    [decision] = _auto_records(workdir)
    t = decision["trial"]
    assert set(t["measured_s"]) == {"uncompressed", "as given"} and t["steps"] == 1
    assert t["taken"] == min(t["measured_s"], key=t["measured_s"].get)
    assert decision["step_s"] == t["measured_s"][t["taken"]]
    first = next(x for x in _records(workdir) if x.get("step") == 1)
    if t["taken"] == "uncompressed":
        assert set(auto.overrides(decision).values()) == {"none"}
        assert first["compression"] == "none"
    else:
        assert "data.grad_reduce=int4:rot" in first["compression"]
    assert f"taken: {t['taken']}" in r.stdout and "(its trial)" in r.stdout


def _free_port():
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _two_processes(workdir, flags, cwd=(ROOT, ROOT), env=None):
    """train.py as 2 processes x 4 CPU devices on 127.0.0.1, process i in cwd[i]."""
    port = _free_port()
    env = env or dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=(
        "--xla_force_host_platform_device_count=4 --xla_backend_optimization_level=0"))
    tiny = [a.replace("--config=configs/", f"--config={ROOT}/configs/") for a in TINY]
    return [subprocess.Popen([sys.executable, os.path.join(ROOT, "train.py"),
                              f"--workdir={workdir}", *tiny, *flags,
                              f"--coordinator_address=127.0.0.1:{port}", "--num_processes=2",
                              f"--process_id={i}", "--cpu_devices=4"],
                             cwd=cwd[i], env=env, text=True, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE) for i in range(2)]


def _outcomes(procs, timeout):
    try:
        return [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()


@pytest.mark.e2e
def test_two_processes_with_different_profile_files_are_refused_in_one_line(tmp_path):
    """One compression.profile path (the same config on every process) whose file
    holds other figures on each host: every process exits 2 with one line naming
    the profile and the process that differs, before anything is written, where
    each chose its own codecs, compiled another step and waited minutes for a
    gloo timeout."""
    workdir = tmp_path / "w"
    hosts = []
    for i, prof in enumerate((FAST, SLOW)):
        host = tmp_path / f"host{i}"
        host.mkdir()
        write(host / "profile.json", prof)
        hosts.append(str(host))
    procs = _two_processes(str(workdir), ["--config.compression.profile=profile.json"],
                           cwd=hosts)
    outs = _outcomes(procs, timeout=150)
    for p, (_, err) in zip(procs, outs):
        lines = [l for l in err.splitlines() if l.strip()]
        assert p.returncode == 2 and len(lines) == 1, err[-3000:]
        assert lines[0].startswith("train.py: error: compression.profile='profile.json' holds "
                                   "other figures on process 1 than on process 0"), lines[0]
    assert not workdir.exists()


_SLOW_TRIAL = r"""
import os, sys, time
root = sys.argv[1]
sys.path.insert(0, root)
import train  # first: its signal handlers go in before JAX loads, as in train.py
from jcomp.train.auto import trial

Real = trial.StepCache


class Slow:
    # The trial's steps, each 0.5 s longer; the first says it has begun.
    def __init__(self, *args, **kwargs):
        self.cache = Real(*args, **kwargs)

    def train(self, *args, **kwargs):
        exe, report = self.cache.train(*args, **kwargs)

        def slow(*a):
            if not os.environ.get("SAID"):
                os.environ["SAID"] = "1"
                print("TRIAL STEP", file=sys.stderr, flush=True)
            time.sleep(0.5)
            return exe(*a)
        return slow, report


trial.StepCache = Slow
train.run([os.path.join(root, "train.py"), *sys.argv[2:]])
"""


@pytest.mark.e2e
@pytest.mark.parametrize("processes", [1])  # 2: experiments/checks/test_auto_long.py
def test_a_signal_during_the_trial_is_answered_within_seconds(tmp_path, processes):
    """SIGTERM once compression.trial=100 times its first candidate (each step
    slowed to 0.5 s: 50 s a candidate): the trial stops between two steps and
    the run ends as a stop before the first step does, exit 0 and nothing
    written; on two processes, the one signalled and the other stop together."""
    script = tmp_path / "slowtrial.py"
    script.write_text(_SLOW_TRIAL)
    prof = write(tmp_path / "slow.json", SLOW)
    workdir = tmp_path / "w"
    flags = [f"--workdir={workdir}",
             *[a.replace("--config=configs/", f"--config={ROOT}/configs/") for a in TINY],
             f"--config.compression.profile={prof}", "--config.compression.trial=100"]
    env = _train_env()
    if processes == 1:
        procs = [subprocess.Popen([sys.executable, str(script), ROOT, *flags], cwd=ROOT,
                                  env=env, text=True, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE)]
    else:
        env["XLA_FLAGS"] = ("--xla_force_host_platform_device_count=4 "
                            "--xla_backend_optimization_level=0")
        port = _free_port()
        procs = [subprocess.Popen([sys.executable, str(script), ROOT, *flags,
                                   f"--coordinator_address=127.0.0.1:{port}",
                                   "--num_processes=2", f"--process_id={i}", "--cpu_devices=4"],
                                  cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE) for i in range(2)]
    try:
        said = []
        while not said or said[-1] and not said[-1].startswith("TRIAL STEP"):
            said.append(procs[-1].stderr.readline())  # to its first trial step
        assert said[-1].startswith("TRIAL STEP"), "".join(said)[-3000:]
        procs[-1].send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        outs = _outcomes(procs, timeout=30)
        took = time.monotonic() - t0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert took < 20, took
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
        assert "Traceback" not in err
    assert "stop requested during compression.trial" in outs[-1][1]
    assert not workdir.exists()


@pytest.mark.e2e
def test_a_resume_keeps_the_decision_and_reprobe_re_decides(auto_runs):
    r = auto_runs["fast"]
    write(r["profile"], SLOW)  # the profile file now argues for compressing
    steps_before = sorted(os.listdir(os.path.join(r["workdir"], "checkpoints")))
    again = _train(r["workdir"], "--config.compression.auto=reprobe",
                   f"--config.compression.profile={r['profile']}", "--config.train.steps=6")
    assert again.returncode == 2
    assert again.stderr.count("\n") == 1
    assert again.stderr.startswith("train.py: error: compression.auto='reprobe' chose ")
    assert "data.grad=int4:rot (checkpoint: none)" in again.stderr
    assert sorted(os.listdir(os.path.join(r["workdir"], "checkpoints"))) == steps_before
    assert len(_auto_records(r["workdir"])) == 1

    os.remove(r["profile"])  # a resume keeping its decision does not read it
    kept = _train(r["workdir"], f"--config.compression.profile={r['profile']}",
                  "--config.train.steps=6")
    assert kept.returncode == 0, kept.stderr[-3000:]
    first, second = _auto_records(r["workdir"])
    assert auto.overrides(second) == auto.overrides(first)
    assert set(auto.overrides(second).values()) == {"none"}
    assert second["profile"] == FAST.to_dict()  # the saved profile, not the file's
    assert second["source"] == "kept from the checkpoint of step 4"
    assert "kept from the checkpoint of step 4" in kept.stdout
    assert max(x.get("step", 0) for x in _records(r["workdir"])) == 6


@pytest.mark.e2e
@pytest.mark.parametrize("arg,named", [
    ("--config.compression.profile=/no/such/profile.json",
     "compression.profile='/no/such/profile.json': No such file"),
    ("--config.compression.budget=grad=int2", "compression.budget='grad=int2'"),
    ("--config.compression.overlap=1.5", "compression.overlap=1.5"),
    ("--config.compression.data.grad=int8", "compression.data.grad='int8'"),
    ("--config.compression.trial=1000000000",
     "compression.trial=1000000000; allowed: an int in [0, 100]"),
    ("--config.compression.profile={absurd}",
     "compression.profile='{absurd}': profile.links['data']: Link.latency_s must be a number "
     "in [0, 60]"),
])
def test_bad_auto_input_is_one_line_exit_2_and_nothing_written(tmp_path, arg, named):
    absurd = tmp_path / "absurd.json"
    data = FAST.to_dict()
    data["links"]["data"] = {"latency_s": 1e308, "bytes_per_s": 5e-324}
    absurd.write_text(json.dumps(data))
    arg, named = arg.format(absurd=absurd), named.format(absurd=absurd)
    workdir = tmp_path / "w"
    r = _train(str(workdir), arg, timeout=120)
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and r.stderr.startswith(f"train.py: error: {named}")
    assert not workdir.exists()
