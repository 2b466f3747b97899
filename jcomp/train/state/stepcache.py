"""The compiled programs of a run, one per compression phase: the train step
with what it sends (`jcomp.meter.wire`), and the eval step.

    steps = StepCache(run, mesh, tx, shapes)
    exe, report = steps.train(phase, state, batch)   # compiled when first reached
    state, m = exe(state, batch)
    val = steps.val_loss(None, state["params"], val_batches)   # the exact forward
    val_c = steps.val_loss(phase, state["params"], val_batches)  # phase's forward codecs

A phase the run never reaches costs nothing: each program is compiled the
first time its phase comes up, then kept for the rest of the run.
"""
from __future__ import annotations

import jax
import numpy as np
from jax.sharding import NamedSharding

from jcomp.gpt import messages, policy, sharding, step
from jcomp.meter import wire
from jcomp.train.outer import driver
from jcomp.train.outer import islands as outer


def global_batch(mesh, local_rows, global_rows: int):
    """This process's rows int32 [B / processes, L + 1] as the global batch
    [global_rows, L + 1], sharded over the mesh's data axes."""
    rows = NamedSharding(mesh, sharding.batch_spec(sharding.data_axes(mesh)))
    local = np.asarray(local_rows, np.int32)
    return jax.make_array_from_process_local_data(rows, local, (global_rows,) + local.shape[1:])


class StepCache:
    """Train and eval programs by phase (a `jcomp.gpt.policy.Policy` from `run.phases`).
    The train state is laid out for `run.policy`, whatever the phase."""

    def __init__(self, run, mesh, tx, params_shapes):
        self.run, self.mesh, self.tx, self.shapes = run, mesh, tx, params_shapes
        self._train: dict = {}  # phase -> (compiled executable, wire.WireReport, jitted fn)
        self._eval: dict = {}

    def train(self, phase, state, batch):
        """-> (executable: (state, batch) -> (state, metrics), its wire report)."""
        if phase not in self._train:
            fn = step.make_train_step(self.run.model, self.mesh, self.run.plan(phase), self.tx,
                                      self.shapes, **self.run.step_options())
            exe = fn.lower(state, batch).compile()
            self._train[phase] = (exe, wire.measure_compiled(exe, self.mesh), fn)
        return self._train[phase][:2]

    def train_fn(self, phase):
        """`phase`'s train step as a jitted function, to trace into a larger program
        (`jcomp.train.outer.delay.carry`); compiled by `train` already."""
        return self._train[phase][2]

    def train_report(self, phase) -> wire.WireReport:
        """The wire report of `phase`'s compiled train step (compiled already)."""
        return self._train[phase][1]

    def train_reports(self) -> dict:
        """phase -> wire report, for the phases whose train step is compiled."""
        return {phase: report for phase, (_, report, _) in self._train.items()}

    def val_loss(self, phase, params, val_batches) -> float:
        """Mean loss over the local validation batches, each made global, through the
        forward messages of `phase`; phase None: the exact forward, every message
        uncompressed (the model as it is used after training)."""
        rows = self.run.train.batch_size
        return float(np.mean([float(self._one(self._eval_step(phase)(
            params, global_batch(self.mesh, b, rows)))) for b in val_batches]))

    def _eval_step(self, phase):
        """`phase`'s jitted eval step (None: the exact forward), made once."""
        if phase not in self._eval:
            plan = self.exact_plan() if phase is None else self.run.plan(phase)
            self._eval[phase] = step.make_eval_step(
                self.run.model, self.mesh, plan, self.shapes,
                microbatches=self.run.train.microbatches,
                **({"islands": outer.AXIS} if self.run.outer else {}))
        return self._eval[phase]

    def val_bytes_across(self, params, val_batches) -> float:
        """Bytes one device sends across islands (outer.AXIS) in one exact
        `val_loss` of an outer run: each batch's eval step and the mean of its
        island losses, read from their compiled programs."""
        fn = self._eval_step(None)
        batch = global_batch(self.mesh, val_batches[0], self.run.train.batch_size)
        per_batch = wire.measure(fn, params, batch, mesh=self.mesh).by_axis().get(outer.AXIS, 0.0)
        # The island mean is metered on the eval's own [I] losses (their layout
        # decides what crosses), so the eval runs once here.
        per_batch += driver.island_mean_bytes({"loss": fn(params, batch)}, self.mesh)
        return float(per_batch) * len(val_batches)

    def _one(self, loss):
        """An outer run's [I] island losses -> their mean (each island's over its
        share of the rows: the whole batch's mean loss where the islands agree)."""
        return driver.island_mean({"loss": loss})["loss"] if self.run.outer else loss

    def exact_plan(self) -> messages.Plan:
        return messages.plan(policy.preset("baseline"), self.run.model.n_layers,
                             self.run.plan_sizes())

    def forward_compressed(self, phase) -> bool:
        """Whether `phase` codes a forward message: then its loss differs from the exact one."""
        return any(m.compressed() and m.direction == "forward"
                   for m in self.run.plan(phase).messages())
