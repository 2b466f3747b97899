"""The long form of tests/train/test_outer_delay.py: a start carried by the next
step, in one program, on a thread or before the step, leaves the state the
start run alone does (about 1 minute on two cores)."""
import jax
import numpy as np
import pytest

from jcomp.train.outer import delay as outerdelay
from jcomp.train.outer import islands as outer
from jcomp.train.outer import driver, fragments
from tests.train.test_outer import _np, _Run
from tests.train.test_outer_delay import _step


@pytest.mark.slow  # compiles whole train steps, syncs and carried steps
def test_a_start_carried_by_the_next_step_equals_the_start_run_alone():
    """Fragment 1's start (due after step 2) overlapped with step 3, in one
    program (outerdelay.carry) or on a thread beside the step's, or run before
    the step ("serial"), leaves the same state, bit for bit, as the start run
    alone after step 2 and then step 3; the one program holds the step's
    collectives and the start's exchange across islands; the thread and the
    serial start time the start."""
    kw = {"outer.every": 4, "outer.fragments": 2, "outer.delay": 1,
          "outer.codec": "int4:rot", "outer.error_feedback": "on"}
    alone = _Run(**kw)
    carried = {overlap: _Run(**kw) for overlap in outerdelay.OVERLAPS}
    for overlap, r in carried.items():
        r.syncs.overlap = overlap
    for r in (alone, *carried.values()):
        _step(r, 1)
        r.inner_step(2)
    assert fragments.due(2, alone.run.outer) == [1]
    masters = _np(alone.state["zero"]["master"])
    alone.state, _ = alone.syncs.run_sync(1, alone.state, 2)
    alone.inner_step(3)
    # The step moved the masters, so a start that read them after it would differ.
    assert not all(np.array_equal(x, y) for x, y in
                   zip(jax.tree.leaves(masters),
                       jax.tree.leaves(_np(alone.state["zero"]["master"]))))
    for overlap, r in carried.items():
        phase = r.run.phases[0][1]
        r.state, m, seconds = r.syncs.run_carried(1, phase, r.steps, r.state, r.batch(3), 2)
        for x, y in zip(jax.tree.leaves(_np(alone.state)), jax.tree.leaves(_np(r.state))):
            assert np.array_equal(x, y), overlap
        assert np.isfinite(float(driver.island_mean(m)["loss"]))
        if overlap != "program":
            assert seconds > 0 and r.syncs._carried == {}
            continue
        assert seconds is None
        from jcomp.meter import wire
        sent = wire.measure_compiled(r.syncs._carried[phase, 1], r.mesh).by_axis()
        assert sent.get(outer.AXIS, 0) == pytest.approx(r.syncs.bytes_per_sync[1])
