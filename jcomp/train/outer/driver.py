"""What runs around each inner step: the one object the training loop asks.

    outer = driver.for_run(run, mesh, params_shapes, tx, pending)  # NoOuter without one
    state, m = outer.step(exe, phase, steps, state, batch, i)
    m, skipped = outer.metrics(m, state)
    state = outer.after_step(done, state, record, phase, steps, batch, evaluates)

Without an outer loop (`NoOuter`) the step is the compiled train step and
nothing runs after it. With one (`Outer`), the islands' metrics are agreed
across islands every step; after a step, a delayed merge that falls due is
applied, and each fragment whose sync falls due is synced, or with
outer.delay its start is carried by the next step's program (`pending`).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jcomp.gpt import step as step_lib
from jcomp.meter import wire
from jcomp.train.outer import delay as delay_lib
from jcomp.train.outer import fragments
from jcomp.train.outer.islands import AXIS, inner_state
from jcomp.train.run import traffic


class NoOuter:
    """A run without an outer loop: the inner step is the whole step."""

    pending = None

    def step(self, exe, phase, steps, state, batch, i):
        """-> (state, metrics) after training step i."""
        return exe(state, batch)

    def metrics(self, m, state) -> tuple[dict, int]:
        """-> (the step's metrics, updates skipped so far)."""
        return m, int(state["skipped"])

    def after_step(self, done, state, record, phase, steps, batch, evaluates):
        return state

    def first_phase(self, state, steps, phase, batch, report, val, mesh) -> tuple[list, dict]:
        """-> (lines to print under the start table, figures for the record)."""
        return [], {}

    def eval_params(self, state):
        """The model the validation loss is taken of."""
        return state["params"]

    def island_losses(self, steps, state, val) -> dict:
        return {}

    def final(self, last: dict) -> dict:
        return last


class Outer(NoOuter):
    """A run with an outer loop (run.outer): the islands' state and its syncs."""

    def __init__(self, run, syncs, pending):
        self.run, self.syncs = run, syncs
        self.pending = pending     # a sync start the next step carries (outer.delay)
        self.across: dict = {}     # bytes across islands per inner step, counted at the start
        self._m_islands = None

    def step(self, exe, phase, steps, state, batch, i):
        carried, self.pending = self.pending, None
        self._carried, self._start_s = carried, None
        if carried is None:
            inner, m = exe(inner_state(state), batch)
            state = {**inner, "outer": state["outer"]}
        else:
            state, m, self._start_s = self.syncs.run_carried(carried, phase, steps, state,
                                                             batch, i)
        # One program across islands per step (the skip count rides along).
        self._m_islands = {**m, "skipped": state["skipped"]}
        return state, island_mean(self._m_islands)

    def metrics(self, m, state) -> tuple[dict, int]:
        return m, int(m["skipped"])

    def after_step(self, done, state, record, phase, steps, batch, evaluates):
        o, syncs = self.run.outer, self.syncs
        for f in fragments.applied(done, o):  # outer.delay > 0 only
            state, seconds = syncs.run_apply(f, state)
            record.update(outer_applied=f, outer_started_at=done - o.delay,
                          outer_apply_s=seconds)
        if self._carried is not None:
            record["outer_carried"] = self._carried
            if self._start_s is not None:  # its own seconds, on a thread beside the step's
                record["outer_start_s"] = self._start_s
        for f in fragments.due(done, o):
            # A sync can fall due after the first step, before the start table
            # compiles the syncs; a carried start compiles none here.
            syncs.prepare(state)
            if o.delay and done < self.run.train.steps and not evaluates(done):
                self.pending = f  # its start overlaps the next step
                record["outer_carried_by"] = done + 1
            else:
                state, seconds = syncs.run_sync(f, state, done)
                record["outer_sync_s"] = seconds
            record.update(outer_fragment=f, outer_bytes_per_sync=syncs.bytes_per_sync[f],
                          outer_bytes_per_step=syncs.bytes_per_step())
            if o.delay:
                record["outer_applies_at"] = done + o.delay
        return state

    def first_phase(self, state, steps, phase, batch, report, val, mesh) -> tuple[list, dict]:
        syncs = self.syncs
        syncs.prepare(state)
        if self.run.outer.delay:  # compiled now, not inside a carrying step
            syncs.prepare_carried(phase, steps, state, batch)
        lines = [syncs.start_line(report.by_axis().get(AXIS, 0.0))]
        self.across = self._across(steps, state, val, mesh, 2 + steps.forward_compressed(phase))
        lines.append(_across_line(self.across))
        return lines, {**self.across,
                       "outer_state_bytes_per_device": step_lib.device_bytes(state["outer"])}

    def _across(self, steps, state, val, mesh, evals_each: int) -> dict:
        """Every byte one device sends across islands per inner step, read from the
        compiled programs: the syncs (averaged over their interval), the islands'
        agreement on each step's metrics, and the `evals_each` evaluations at each
        eval step (the anchor's and the islands' exact ones, and the compressed
        forward's where the phase codes one; each crosses as the exact one does),
        averaged over eval_every."""
        island = island_mean_bytes(self._m_islands, mesh)
        evals = (evals_each * steps.val_bytes_across(self.syncs.global_params(state), val)
                 / self.run.train.eval_every if val else 0.0)
        sync = self.syncs.bytes_per_step()
        return {"outer_bytes_per_step": sync, "outer_island_bytes_per_step": island,
                "outer_eval_bytes_per_step": evals,
                "outer_across_bytes_per_step": sync + island + evals}

    def eval_params(self, state):
        # The global model is the anchor; the islands' own params are logged beside it.
        return self.syncs.global_params(state)

    def island_losses(self, steps, state, val) -> dict:
        return {"val_loss_islands": steps.val_loss(None, state["params"], val)}

    def final(self, last: dict) -> dict:
        return {**last, **self.across, "outer_bytes_per_step": self.syncs.bytes_per_step()}


def for_run(run, mesh, params_shapes, tx, pending=None) -> NoOuter:
    """The object the loop asks what runs around each step of `run`."""
    if not run.outer:
        return NoOuter()
    return Outer(run, delay_lib.syncs_for(run, mesh, params_shapes, tx), pending)


def _across_line(across) -> str:
    return (f"across islands per inner step: "
            f"{traffic.human(across['outer_across_bytes_per_step'])} per device (syncs "
            f"{traffic.human(across['outer_bytes_per_step'])}, metrics "
            f"{traffic.human(across['outer_island_bytes_per_step'])}, evaluation "
            f"{traffic.human(across['outer_eval_bytes_per_step'])})")


@functools.cache
def _reducer():
    return jax.jit(lambda m: {k: (jnp.sum(v) if k == "skipped" else
                                  jnp.all(v) if v.dtype == jnp.bool_ else jnp.mean(v))
                              for k, v in m.items()})


def island_mean(metrics: dict) -> dict:
    """The islands' [I] metrics as one value each: the mean (all for "finite",
    the sum for "skipped"), in a small program of its own (the inner step sends
    nothing across islands; this one does, every step: the islands agree on
    whether a step was finite, so that all stop together)."""
    return _reducer()(metrics)


def island_mean_bytes(metrics: dict, mesh) -> float:
    """Bytes one device sends across islands (AXIS) in `island_mean(metrics)`,
    read from its compiled program."""
    return float(wire.measure(_reducer(), metrics, mesh=mesh).by_axis().get(AXIS, 0.0))
