"""The metrics record of one training step, as `metrics.jsonl` and TensorBoard
get it, and when a step's record is written.

    record = step_record(step_no, m, loss, dt, lr, tokens_per_step, phase, skipped)
    record.update(phase_record(phase, previous_phase, report, state))  # a phase's first step
    if due(record, step_no, log_every, total_steps): writer.write(record)

The key order is the file's: step, loss, grad_norm, lr, step_time_s,
tokens_per_s, compressed, skipped_updates, then ef_norm (and ef_reset, set by
the loop) with error feedback, then on a phase's first step what its compiled
program sends and what the state takes per device, then val_loss.
"""
from __future__ import annotations

import jax

from jcomp.gpt import schedule as schedule_lib
from jcomp.gpt import step
from jcomp.meter import wire


def step_record(step_no: int, m, loss: float, step_time_s: float, lr: float,
                tokens_per_step: int, phase, skipped: int) -> dict:
    """What every step logs; `m` is the train step's metrics, `loss` float(m["loss"])."""
    record = {"step": step_no, "loss": loss, "grad_norm": float(m["grad_norm"]),
              "lr": float(lr), "step_time_s": step_time_s,
              "tokens_per_s": tokens_per_step / step_time_s,
              "compressed": schedule_lib.is_compressed(phase),
              "skipped_updates": skipped}
    if "ef_norm" in m:
        record["ef_norm"] = float(m["ef_norm"])
    return record


def phase_record(phase, plan, previous, report: wire.WireReport, state) -> dict:
    """What the first step of a phase adds: the compiled step's traffic, the
    state's size, the phase's compression by message (its `messages.Plan`) and
    (after the first phase) which policy entries changed."""
    out = static_metrics(report, state)
    out["compression"] = plan.describe()
    if previous is not None:
        out["compression_changes"] = schedule_lib.changes(previous, phase)
    return out


def static_metrics(report: wire.WireReport, state) -> dict:
    """What the compiled step sends per axis, and what state sits on a device."""
    out = {f"wire_bytes_{axis}": float(v) for axis, v in report.by_axis().items()}
    out["wire_bytes_total"] = float(report.total())
    # Collective executions per step (mesh average): what a per-message latency costs.
    out["wire_collectives"] = float(sum(c.count * c.share for c in report.collectives))
    if report.notes:
        out["wire_notes"] = " | ".join(report.notes)
    return {**out,
            "param_bytes_per_device": step.device_bytes(state["params"]),
            "opt_state_bytes_per_device": step.device_bytes(state["zero"]),
            "devices": jax.device_count()}


def due(record: dict, step_no: int, log_every: int, total_steps: int) -> bool:
    """Every log_every steps, the last step, and any step whose record carries
    something rarer: a validation loss, a phase's traffic, an error-feedback reset,
    an outer loop's sync."""
    return (step_no % log_every == 0 or "val_loss" in record or step_no == total_steps
            or "wire_bytes_total" in record or "ef_reset" in record
            or "outer_fragment" in record or "outer_carried" in record)
