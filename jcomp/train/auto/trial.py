"""A few timed steps of a candidate run: what compression.trial measures.

    seconds = step_seconds(run, mesh, rows, steps=3)   # median of 3 after the compile

The cost model (jcomp.tune) prices links and codecs apart; what it cannot see
is how they share the machine with compute (processes contending for the
same cores, a collective's transfer overlapping the next layer's matmul).
compression.auto therefore lets a short trial settle the candidates the model
cannot tell apart (jcomp.train.auto.pick.weigh_by_trial), as XLA's autotuner and
cuDNN's benchmark mode time their kernel candidates instead of predicting them.

Each trial starts from the run's own initial parameters on its own mesh, steps
the first batch of the run's data, and is then dropped: nothing it computes
reaches the run. Every process of a cluster runs the same trials in the same
order (their collectives are joint) and takes process 0's timing, so all of
them take the same candidate.

A stop asked for while trials run (SIGTERM, SIGHUP, a first Ctrl-C; `Signals`)
is answered between two steps: `Stopped`, agreed by every process, since a
process leaving its trial alone would leave the others waiting in a collective.

    with Signals() as signals:
        seconds = step_seconds(run, mesh, rows, steps=3, stop=signals.agreed)
"""
from __future__ import annotations

import signal
import statistics
import threading
import time

import jax
import numpy as np

from jcomp import tune
from jcomp.train.run import faults
from jcomp.train.state import resume
from jcomp.train.outer import islands as outer
from jcomp.train.state.stepcache import StepCache, global_batch

SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)


class Stopped(SystemExit):
    """A stop asked for during a trial. Nothing of the run exists yet (the
    decision comes before the workdir is locked), so the process ends as after
    a stop before the first step: exit 0. A SystemExit, so that nothing on the
    way out takes it for a failure."""

    def __init__(self):
        super().__init__(0)


class Signals:
    """While entered, notes SIGTERM, SIGHUP and SIGINT and passes each on to the
    handler in place before (train.py's faults.StopFlag, which also keeps a
    second Ctrl-C's exit at once). A StopFlag set before it was entered counts
    too. Signals keep their own behaviour where no Python handler is in place
    (the default ends the process), and off the main thread nothing is
    installed."""

    def __init__(self):
        self.seen = False
        self._old = {}
        self._flags = []

    def __enter__(self) -> "Signals":
        if threading.current_thread() is not threading.main_thread():
            return self
        for sig in SIGNALS:
            old = signal.getsignal(sig)
            if isinstance(getattr(old, "__self__", None), faults.StopFlag):
                self._flags.append(old.__self__)
            if callable(old):
                self._old[sig] = old
                signal.signal(sig, self._passing_on(old))
        return self

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old = {}

    def _passing_on(self, old):
        def handle(signum, frame):
            self.seen = True
            old(signum, frame)
        return handle

    def requested(self) -> bool:
        """This process was asked to stop."""
        return self.seen or any(f.requested for f in self._flags)

    def agreed(self) -> bool:
        """Some process of the cluster was asked to stop: the same answer on every
        process (each must call it at the same points)."""
        mine = self.requested()
        if jax.process_count() == 1:
            return mine
        from jax.experimental import multihost_utils
        return bool(np.asarray(multihost_utils.process_allgather(np.int32(mine))).any())


def step_seconds(run, mesh, rows, steps: int, warmup: int = 1, stop=None) -> float:
    """Median seconds of `steps` train steps of `run` on `mesh` (an outer loop's
    inner steps, plus its syncs timed: `sync_seconds`), after `warmup`
    steps (the first pays for page faults and lazy buffers; the compile is
    before any), the steps being of `run`'s last phase (the one it trains in
    longest) on this process's `rows` [B / processes, L + 1]. `stop`: a callable
    asked before the compile and after each step (outside the timing); where it
    answers True, `Stopped` (every process must get the same answer:
    `Signals.agreed`)."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be an int >= 1; got {steps!r}")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"warmup must be an int >= 0; got {warmup!r}")
    if stop is not None and not callable(stop):
        raise TypeError(f"stop must be a callable returning a bool, or None; got {stop!r}")

    def check():
        if stop is not None and stop():
            raise Stopped()
    check()
    make_params = resume.init_params(run)
    shapes = jax.eval_shape(make_params)
    tx = run.optim.tx(run.train.steps)
    # An outer loop's inner step takes the state less its outer part; its syncs
    # are timed after the steps, on the state the steps left.
    full = resume.init_state(run, make_params(), mesh, tx, shapes)
    state = outer.inner_state(full)
    batch = global_batch(mesh, rows, run.train.batch_size)
    exe, _ = StepCache(run, mesh, tx, shapes).train(run.phases[-1][1], state, batch)
    check()
    times = []
    for _ in range(warmup + steps):
        t0 = time.perf_counter()
        state, m = exe(state, batch)
        jax.block_until_ready(m["loss"])  # waits for the step (per island in an outer loop)
        times.append(time.perf_counter() - t0)
        check()
    seconds = statistics.median(times[warmup:])
    if run.outer:
        seconds += sync_seconds(run, mesh, shapes, tx, {**state, "outer": full["outer"]},
                                max(1, min(steps, SYNC_REPEATS)), check)
    # Process 0's figure on every process: the trials' choice must be one.
    [seconds] = tune.agree([seconds])
    return seconds


SYNC_REPEATS = 3  # an outer candidate's syncs timed per fragment, after one untimed


def sync_seconds(run, mesh, shapes, tx, state, repeats: int, check=lambda: None) -> float:
    """Seconds per inner step of an outer loop's syncs: each fragment's sync run
    1 + `repeats` times on `state` (the first pays for its compile's lazy
    buffers), the median of the rest, summed over fragments, over the interval
    outer.every. A delayed start (outer.delay) is timed as the blocking sync it
    overlaps: an upper bound."""
    syncs = outer.Syncs(run, mesh, shapes, tx)
    syncs.prepare(state)
    total = 0.0
    for f in range(run.outer.fragments):
        times = []
        for r in range(1 + repeats):
            state, sec = syncs.run_sync(f, state, r)
            times.append(sec)
            check()
        total += statistics.median(times[1:])
    return total / run.outer.every

