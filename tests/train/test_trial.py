"""jcomp.train.auto.trial: timed steps of a candidate run, dropped afterwards."""
import jax
import numpy as np
import pytest

from jcomp.gpt import mesh as mesh_lib
from jcomp.train.settings import runspec
from jcomp.train.auto import trial
from tests.train.tinyconfig import tiny_config


def _tiny():
    run = runspec.validate(tiny_config(), 8)
    mesh = mesh_lib.make_mesh(run.mesh_shape, dcn_data=run.mesh_split())
    rows = np.random.default_rng(0).integers(
        0, run.model.vocab_size, (run.train.batch_size, run.data.seq_len + 1), np.int32)
    return run, mesh, rows


@pytest.mark.slow
def test_step_seconds_times_the_runs_step_and_leaves_nothing_behind():
    run, mesh, rows = _tiny()
    live = {id(a) for a in jax.live_arrays()}
    seconds = trial.step_seconds(run, mesh, rows, steps=2)
    assert 0.0 < seconds < 60.0
    # The trial's state is dropped: no array it made outlives it.
    assert not [a for a in jax.live_arrays() if id(a) not in live and a.size > 1000]


@pytest.mark.parametrize("kw,named", [({"steps": 0}, "steps must be an int >= 1; got 0"),
                                      ({"steps": 2, "warmup": -1}, "warmup must be"),
                                      ({"steps": True}, "steps must be an int")])
def test_bad_counts_are_refused_naming_the_argument(kw, named):
    run, mesh, rows = _tiny()
    with pytest.raises(ValueError, match=named):
        trial.step_seconds(run, mesh, rows, **kw)


def test_a_stop_is_answered_before_the_compile_and_between_steps():
    """trial.Signals notes a signal and passes it on to the StopFlag in place
    (train.py's); step_seconds asks `stop` before compiling: a stop asked for
    is answered there, with nothing built."""
    import os
    import signal

    from jcomp.train.run import faults
    run, mesh, rows = _tiny()
    with faults.StopFlag() as flag, trial.Signals() as signals:
        assert not signals.agreed()
        os.kill(os.getpid(), signal.SIGTERM)
        assert signals.seen and flag.requested and signals.agreed()
        asked = []
        with pytest.raises(trial.Stopped) as e:
            trial.step_seconds(run, mesh, rows, steps=3, stop=lambda: asked.append(1) or True)
    assert e.value.code == 0 and asked == [1]
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # both handlers taken out
    # A StopFlag set before the trial began counts too.
    with faults.StopFlag() as flag:
        flag.requested = True
        with trial.Signals() as signals:
            assert signals.agreed() and not signals.seen


@pytest.mark.slow
def test_an_outer_candidate_is_timed_with_its_syncs(monkeypatch):
    """An outer loop's trial times its inner steps and its syncs, per inner step:
    the sync's own seconds (each fragment's median of 3 after one untimed, over
    outer.every) are added to the steps', where the model used to price them."""
    cfg = tiny_config()
    cfg.mesh.dcn_data = 2
    cfg.outer.update(every=4, codec="int8", fragments=2)
    run = runspec.validate(cfg, 8)
    mesh = mesh_lib.make_mesh(run.mesh_shape, dcn_data=run.mesh_split())
    rows = np.random.default_rng(0).integers(
        0, run.model.vocab_size, (run.train.batch_size, run.data.seq_len + 1), np.int32)
    seen = []
    real = trial.sync_seconds

    def spy(*args, **kw):
        seen.append(real(*args, **kw))
        return seen[-1]

    monkeypatch.setattr(trial, "sync_seconds", spy)
    with_syncs = trial.step_seconds(run, mesh, rows, steps=2)
    assert len(seen) == 1 and 0.0 < seen[0] < 60.0
    monkeypatch.setattr(trial, "sync_seconds", lambda *a, **k: 1000.0)
    assert trial.step_seconds(run, mesh, rows, steps=2) >= 1000.0 > with_syncs
