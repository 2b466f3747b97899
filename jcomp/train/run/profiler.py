"""Profiling a few train steps: `StepProfiler(parse_profile_steps("A-B", total),
logdir)` runs a `jax.profiler` trace from the start of step A to the end of
step B (steps counted from 1, as in metrics.jsonl); TensorBoard's profile
plugin or Perfetto read what it writes under logdir/plugins/profile/.
"""
from __future__ import annotations


def parse_profile_steps(spec: str, total_steps: int, field: str = "train.profile_steps"):
    """"A-B" -> (A, B) with 1 <= A <= B <= total_steps; "" -> None. ValueError
    naming `field` otherwise."""
    if spec is None or spec == "":
        return None
    parts = spec.split("-") if isinstance(spec, str) else []
    if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
        raise ValueError(f"{field}={spec!r}: want FIRST-LAST step numbers, e.g. '5-7', or ''")
    first, last = (int(p) for p in parts)
    if not 1 <= first <= last <= total_steps:
        raise ValueError(f"{field}={spec!r}: need 1 <= FIRST <= LAST <= train.steps "
                         f"({total_steps})")
    return first, last


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
