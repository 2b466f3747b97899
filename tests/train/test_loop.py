"""Tests for jcomp.train.loop's own logic outside a run: what the returned
record says about the last step's bytes. (Whole runs are in test_train.py.)"""
import types

import jax.numpy as jnp
import pytest

from jcomp.meter import wire
from jcomp.train import loop
from jcomp.train.settings import runspec
from jcomp.train.run import traffic
from tests.train.tinyconfig import tiny_config


def _report(scale):
    """A step's report in the tiny model's messages, every figure times `scale`."""
    c = lambda axes, message, b: wire.Collective(
        kind="all-reduce", dtype="f32", shape=(2, 32, 32), group_size=2, axes=axes,
        bytes_per_device=b * scale, count=1, name=message or "x", message=message)
    return wire.WireReport([c(("data",), "grad_reduce", 17056.0),
                            c(("data",), "param_gather", 17056.0),
                            c(("tensor",), "block_exit", 49152.0),
                            c(("pipeline",), "stage_send", 8192.0),
                            c(("data",), "", 8.0)])


def _steps(reports):
    """A StepCache stand-in holding these compiled phases' reports."""
    return types.SimpleNamespace(train_report=reports.__getitem__,
                                 train_reports=lambda: dict(reports))


def test_an_uncompressed_last_step_adds_its_bytes_only():
    run = runspec.validate(tiny_config(), 8)
    out = loop._with_traffic({"step": 12, "loss": 3.0}, run, _steps({run.policy: _report(1)}))
    assert out == {"step": 12, "loss": 3.0, "wire_bytes_total": _report(1).total()}


def test_a_compressed_step_after_an_uncompressed_phase_uses_its_measured_bytes():
    run = runspec.validate(tiny_config(**{"compression.policy": "hybrid",
                                          "compression.warmup_steps": 4}), 8)
    (_, warm), (_, hybrid) = run.phases
    steps = _steps({warm: _report(1), hybrid: _report(0.2)})
    out = loop._with_traffic({"step": 12}, run, steps)
    assert out == {"step": 12, "wire_bytes_total": _report(0.2).total(),
                   "uncompressed_bytes_total": _report(1).total(),
                   "uncompressed_measured": True}
    # the last step in the warm-up phase: uncompressed itself
    assert "uncompressed_bytes_total" not in loop._with_traffic({"step": 4}, run, steps)


def test_a_compressed_step_alone_estimates_the_uncompressed_bytes():
    run = runspec.validate(tiny_config(**{"compression.policy": "hybrid"}), 8)
    report = _report(0.2)
    out = loop._with_traffic({"step": 12}, run, _steps({run.policy: report}))
    exact = traffic.preset_plan("baseline", 2, {"data": 2, "tensor": 2, "pipeline": 2})
    guess = traffic.estimate(report, run.plan(run.policy), exact, 32, jnp.float32).total()
    assert out["uncompressed_measured"] is False
    assert out["uncompressed_bytes_total"] == pytest.approx(guess)
    assert guess > 3 * report.total()
