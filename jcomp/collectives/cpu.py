"""XLA's CPU runtime and collectives over several groups of devices.

The CPU runtime runs a program's ready thunks concurrently, collectives
included: their start is ordered, their end is not. Its default scheduler
(concurrency-optimized) may place a collective between two loops that hold
collectives of their own, such as a reduce-scatter of the first gradients
between the backward passes of two microbatches. On emulated devices the
devices of one program then sometimes reach collectives over different device
groups in different orders, and each ends up waiting in another one until the
runtime aborts the process (`rendezvous.cc ... Termination timeout`). Every
collective JAX emits carries the same channel id, which is what the runtime
keys its rendezvous by, so nothing tells those collectives apart.

The trainer's two-hop step (a reduce-scatter over the fast hop, then one over
the slow hop, between tensor-parallel layer loops) stopped this way in 2 of 2
runs of 150 tiny steps on an idle machine and in 6 of 6 runs of 200 on a
loaded one; with XLA's other scheduler, which keeps those collectives after the
loops, in none of 10 runs. `FLAG` selects it. It is a
process-wide option read when the CPU backend starts (XLA ignores it as a
per-program compiler option), so train.py and the test suite add it to
XLA_FLAGS first, and hop-by-hop collectives traced for CPU devices without it
warn (`SchedulerWarning`). GPU and TPU runtimes issue collectives in program order and do not
read it.
"""
from __future__ import annotations

import os
import warnings

import jax

OPTION = "xla_cpu_enable_concurrency_optimized_scheduler"
FLAG = f"--{OPTION}=false"


class SchedulerWarning(UserWarning):
    """A collective over several device groups traced for CPU devices whose XLA
    scheduler may deadlock it."""


def add_flag(environ=os.environ) -> None:
    """Puts FLAG into environ["XLA_FLAGS"] unless the option is set there already
    (either way). Call it before JAX starts its CPU backend."""
    flags = environ.get("XLA_FLAGS", "")
    if OPTION not in flags:
        environ["XLA_FLAGS"] = f"{flags} {FLAG}".strip()


def check_scheduler(what: str) -> None:
    """Warns when `what` (a collective over several mesh axes, hop by hop) is
    traced for CPU devices and XLA_FLAGS does not choose the scheduler."""
    if OPTION in os.environ.get("XLA_FLAGS", "") or jax.default_backend() != "cpu":
        return
    warnings.warn(
        f"{what} on CPU devices: XLA's default CPU scheduler can stop a program that "
        "runs collectives over several device groups (each device waiting in a "
        f"different one); start the process with XLA_FLAGS containing {FLAG} "
        "(jcomp.collectives.cpu)", SchedulerWarning, stacklevel=3)
