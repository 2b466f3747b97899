"""jcomp.train.state.resume: what a checkpoint records of the optimizer, and what a resume
that changes it is told."""
import dataclasses
import types

from jcomp.train.state import resume
from jcomp.train.settings import sections


def _run(**optim):
    base = dict(name="adamw", lr=3e-3, warmup_steps=20, min_lr_ratio=0.1, b1=0.9, b2=0.95,
                eps=1e-8, weight_decay=0.1, clip_norm=1.0, zero_stage=1)
    return types.SimpleNamespace(optim=sections.OptimSettings(**{**base, **optim}))


def test_changed_optim_fields_are_named_with_both_values():
    saved = {"optim": dataclasses.asdict(_run().optim)}
    assert resume.optim_changes(_run(), saved) == []
    assert resume.optim_changes(_run(lr=1e-3, b2=0.99), saved) == [
        "optim.lr=0.001 (checkpoint: 0.003)", "optim.b2=0.99 (checkpoint: 0.95)"]


def test_a_checkpoint_without_optim_settings_is_not_a_change():
    """Checkpoints written before the settings were recorded resume as before."""
    assert resume.optim_changes(_run(lr=1.0), {"step": 4}) == []
