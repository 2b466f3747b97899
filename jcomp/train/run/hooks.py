"""Points in the training loop where a caller may act: before a batch goes to
the devices, after a step, and while a checkpoint save is in flight.

    class Slow(Hooks):
        def after_step(self, step_no, record):
            time.sleep(1.0)

    trainer.train_and_evaluate(cfg, workdir, hooks=Slow())

Each method of `Hooks` does nothing; a subclass overrides the ones it needs.
`step_no` is the 1-based number of the step (the `step` of its metrics
record). The fault tests inject their faults through these (`tests/faultinject.py`);
the loop reads no environment for them.
"""
from __future__ import annotations


class Hooks:
    """Called by the loop in this order for each step: `before_batch`, then
    (the step runs, its record is written) `after_step`, then `during_save`
    when that step starts a checkpoint save."""

    def before_batch(self, step_no: int, rows_BxL1, vocab_size: int):
        """-> the rows this process feeds to step `step_no` (int32 [B / processes,
        seq_len + 1]); `vocab_size` bounds the ids. Default: `rows_BxL1` as given."""
        return rows_BxL1

    def after_step(self, step_no: int, record: dict) -> None:
        """Step `step_no` is done and `record` (its metrics) logged; before the loop
        asks whether to stop and saves."""

    def during_save(self, step_no: int, directory: str, stop) -> None:
        """The asynchronous save of step `step_no` into `directory` (the checkpoint
        directory) has started and may still be writing; `stop` is the run's
        `faults.StopFlag`."""
