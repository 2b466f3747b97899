"""Profiling a few train steps: `StepProfiler((A, B), logdir)` runs a
`jax.profiler` trace from the start of step A to the end of step B (steps
counted from 1, as in metrics.jsonl; train.profile_steps, read by
jcomp.train.settings.sections); TensorBoard's profile plugin or Perfetto read
what it writes under logdir/plugins/profile/.
"""
from __future__ import annotations


class StepProfiler:
    """A jax.profiler trace of steps [first, last] (see the module doc); inert for
    steps=None. Leaving the `with` block stops a trace still running."""

    def __init__(self, steps, logdir: str):
        self.steps, self.logdir, self.active = steps, logdir, False

    def step_starting(self, step_no: int):
        """Called before step `step_no` (from 1) runs."""
        if self.steps and not self.active and self.steps[0] <= step_no <= self.steps[1]:
            import jax
            jax.profiler.start_trace(self.logdir)
            self.active = True

    def step_done(self, step_no: int):
        """Called once step `step_no` has finished (its result waited on)."""
        if self.active and step_no >= self.steps[1]:
            self.close()

    def close(self):
        if self.active:
            import jax
            self.active = False
            jax.profiler.stop_trace()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
