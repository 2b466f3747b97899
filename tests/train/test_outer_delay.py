"""outer.delay (jcomp.train.outer.delay): a fragment's sync started after its
step and merged into the islands outer.delay steps later. In process on
configs/tiny.py's model (`tests.train.test_outer._Run`). A start carried by the
next step against the start run alone: experiments/checks/test_outer_delay_long.py."""
import jax
import numpy as np
import pytest

from jcomp.train.outer import islands as outer, delay as outerdelay
from jcomp.train.outer import fragments
from jcomp.train.settings import outer as outerconfig, runspec
from tests.train.test_outer import _Run, _np
from tests.train.tinyconfig import tiny_config


def _step(r, seed):
    """One inner step, then the merges and syncs due after it, as the loop runs them."""
    r.inner_step(seed)
    for f in fragments.applied(r.done, r.run.outer):
        r.state, _ = r.syncs.run_apply(f, r.state)
    for f in fragments.due(r.done, r.run.outer):
        r.state, _ = r.syncs.run_sync(f, r.state, r.done)


def test_merges_come_delay_steps_after_their_start():
    o = outerconfig.OuterSettings(every=6, codec="none", error_feedback=False, lr=1.0,
                                  momentum=0.0, fragments=3, delay=1)
    assert [fragments.due(n, o) for n in range(1, 8)] == [[], [1], [], [2], [], [0], []]
    assert [fragments.applied(n, o) for n in range(1, 8)] == [[], [], [1], [], [2], [], [0]]
    plain = outerconfig.OuterSettings(every=6, codec="none", error_feedback=False, lr=1.0,
                                      momentum=0.0)
    assert all(fragments.applied(n, plain) == [] for n in range(1, 8))
    assert "delay" not in plain.record() and o.record()["delay"] == 1


BAD = [
    ({"outer.every": 4, "outer.delay": -1}, "outer.delay=-1; allowed: an integer >= 0"),
    ({"outer.every": 4, "outer.delay": 4},
     "outer.delay=4 is not below outer.every=4: a fragment's next sync would start before "
     "its last result is merged; allowed: 0 to 3"),
    ({"outer.every": 4, "outer.fragments": 2, "outer.delay": 5}, "allowed: 0 to 3"),
    ({"outer.every": 4, "outer.delay": 1, "outer.mix": 1.5},
     "outer.mix=1.5; allowed: a number in [0, 1]"),
    ({"outer.every": 4, "outer.delay": 1, "outer.mix": -0.1},
     "outer.mix=-0.1; allowed: a number in [0, 1]"),
    ({"outer.every": 4, "outer.mix": 0.3}, "outer.mix=0.3 applies to a delayed sync only"),
    ({"outer.delay": 1}, "outer.delay=1 applies to an outer loop only"),
    ({"outer.mix": 0.2}, "outer.mix=0.2 applies to an outer loop only"),
]


@pytest.mark.parametrize("overrides,message", BAD)
def test_bad_delay_settings_are_refused_by_name(overrides, message):
    with pytest.raises(runspec.UsageError) as e:
        runspec.validate(tiny_config(**overrides), 8)
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


@pytest.mark.parametrize("delay", [1.5, True, "2"])
def test_a_delay_that_is_not_an_integer_is_refused(delay):
    """config.outer built by hand (the config file types the field as an integer)."""
    import ml_collections
    o = ml_collections.ConfigDict(dict(every=4, codec="none", error_feedback="off", lr=1.0,
                                       momentum=0.0, fragments=1, delay=delay, mix=0.5))
    with pytest.raises(runspec.UsageError) as e:
        outerconfig.settings(o)
    assert f"outer.delay={delay!r}; allowed: an integer >= 0" in str(e.value)


def test_delay_settings_are_read():
    o = runspec.validate(tiny_config(**{"outer.every": 4, "outer.delay": 3,
                                        "outer.mix": 0.0}), 8).outer
    assert (o.delay, o.mix) == (3, 0.0)
    o = runspec.validate(tiny_config(**{"outer.every": 4}), 8).outer
    assert (o.delay, o.mix) == (0, 0.5)


@pytest.mark.slow  # compiles whole train steps and syncs
def test_delay_0_is_the_blocking_sync_bit_for_bit():
    """outer.delay=0 set explicitly runs the same states as without the field,
    over three rounds of two fragments."""
    base = {"outer.every": 2, "outer.fragments": 2, "outer.codec": "topk:0.1",
            "outer.error_feedback": "on"}
    a, b = _Run(**base), _Run(**base, **{"outer.delay": 0, "outer.mix": 0.5})
    for t in range(1, 7):
        _step(a, t), _step(b, t)
    for x, y in zip(jax.tree.leaves(_np(a.state)), jax.tree.leaves(_np(b.state))):
        assert np.array_equal(x, y)


@pytest.mark.slow  # compiles whole train steps and syncs
def test_a_started_sync_is_merged_delay_steps_later():
    """every=4, delay=2, mix=0.25, one fragment: the start after step 4 leaves
    the islands' params alone and moves the anchor exactly as the blocking
    sync of the same state does; after step 6 every island's master is
    0.25 * its own (as step 6 left it) + 0.75 * that anchor, to 1 ulp of the
    leaf's largest |value| (numpy's float32 multiply-add against XLA's)."""
    r = _Run(**{"outer.every": 4, "outer.delay": 2, "outer.mix": 0.25})
    blocking = jax.jit(outer.make_sync(r.run, r.mesh, r.shapes, r.tx, 0))
    for t in range(1, 4):
        _step(r, t)
    held = _np(r.state)
    r.inner_step(4)
    want = _np(blocking(r.state, np.int32(4))["outer"]["anchor"])
    r.state, _ = r.syncs.run_sync(0, r.state, 4)
    after = _np(r.state)
    for x, y in zip(jax.tree.leaves(after["outer"]["anchor"]), jax.tree.leaves(want)):
        assert np.array_equal(x, y)
    assert any(not np.array_equal(p[0], p[1]) for p in jax.tree.leaves(after["params"]))
    assert not all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(held["params"]),
                                                        jax.tree.leaves(after["params"])))
    _step(r, 5)
    assert fragments.applied(6, r.run.outer) == [0]
    r.inner_step(6)
    own = jax.tree.leaves(_np(r.state["zero"]["master"]))
    r.state, _ = r.syncs.run_apply(0, r.state)
    got = jax.tree.leaves(_np(r.state["zero"]["master"]))
    for o, a, g in zip(own, jax.tree.leaves(want), got):
        ref = np.float32(0.25) * o + np.float32(0.75) * a[None]
        assert np.abs(g - ref).max() <= np.finfo(np.float32).eps * np.abs(ref).max()
    for p in jax.tree.leaves(_np(r.state["params"])):
        assert p.shape[0] == 2  # islands differ still: each kept its own share
    anchor_after = jax.tree.leaves(_np(r.state["outer"]["anchor"]))
    assert all(np.array_equal(x, y) for x, y in zip(anchor_after, jax.tree.leaves(want)))


def test_a_resume_cannot_drop_or_add_a_delay():
    """A checkpoint written with a sync in flight (delay > 0) cannot be resumed
    under delay 0 (its merge would be lost), nor one of delay 0 under delay > 0;
    each refusal names the field. Equal settings resume."""
    import types

    from jcomp.train.state import resume
    kw = dict(every=4, codec="none", error_feedback=False, lr=1.0, momentum=0.0)
    delayed = outerconfig.OuterSettings(**kw, delay=1)
    blocking = outerconfig.OuterSettings(**kw)
    check = lambda mine, saved: resume.outer_mismatch(types.SimpleNamespace(outer=mine))(
        {"outer": saved.record()})
    assert check(delayed, delayed) == [] and check(blocking, blocking) == []
    assert "outer.delay=1, this run has outer.delay=0" in check(blocking, delayed)[0]
    assert "outer.delay=0, this run has outer.delay=1" in check(delayed, blocking)[0]


def test_the_overlap_is_a_thread_on_cpu_one_program_elsewhere_and_named_when_bad():
    assert outerdelay.overlap_for("cpu") == "thread"
    assert outerdelay.overlap_for("gpu") == outerdelay.overlap_for("tpu") == "program"
    r = _Run(**{"outer.every": 4, "outer.delay": 1})
    assert r.syncs.overlap == outerdelay.overlap_for(jax.default_backend())
    with pytest.raises(ValueError, match="overlap='stream'; allowed: program, thread"):
        outerdelay.DelayedSyncs(r.run, r.mesh, r.shapes, r.tx, overlap="stream")


def _fake_mesh(processes):
    """A (dcn 2, data 2, tensor 2, pipeline 1) mesh's shape and axes whose 8
    devices belong to `processes` processes in row-major order."""
    import types
    per = 8 // processes
    devices = np.array([types.SimpleNamespace(process_index=i // per) for i in range(8)],
                       dtype=object).reshape(2, 2, 2, 1)
    return types.SimpleNamespace(devices=devices, axis_names=("dcn", "data", "tensor", "pipeline"))


def test_on_cpu_islands_that_span_processes_run_the_start_before_the_step():
    """With an island over several processes the step's collectives cross
    processes too, and a start on a thread of its own would issue its
    cross-process collectives in an order each process picks for itself: on CPU
    the start runs before the step instead ("serial"), said under the start
    table, and "thread" is refused by name. One process per island (or one
    process in all) keeps the thread."""
    from jcomp.train.state import resume
    run = runspec.validate(tiny_config(**{"outer.every": 4, "outer.delay": 1,
                                          "mesh.data": 4, "mesh.pipeline": 1,
                                          "mesh.dcn_data": 2}), 8)
    shapes = jax.eval_shape(resume.init_params(run))
    tx = run.optim.tx(run.train.steps)
    assert [outerdelay.island_processes(_fake_mesh(p)) for p in (1, 2, 4, 8)] == [1, 1, 2, 4]
    assert outerdelay.overlap_for("cpu", 2) == "serial"
    assert outerdelay.overlap_for("gpu", 2) == "program"
    for processes, want in ((1, "thread"), (2, "thread"), (4, "serial")):
        syncs = outerdelay.DelayedSyncs(run, _fake_mesh(processes), shapes, tx, overlap=(
            None if jax.default_backend() == "cpu" else outerdelay.overlap_for("cpu", processes)))
        assert syncs.overlap == want, processes
    syncs.bytes_per_sync = [1000.0]
    line = " ".join(syncs.start_line(0.0).split())
    assert ("outer.delay=1: each island spans 2 processes, so on CPU a sync's start runs "
            "before the next step, not beside it") in line, line
    with pytest.raises(ValueError, match="overlap='thread' with islands of 2 processes: .*"
                                         "allowed: serial, program"):
        outerdelay.DelayedSyncs(run, _fake_mesh(4), shapes, tx, overlap="thread")
