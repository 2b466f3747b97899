"""A few timed steps of a candidate run: what compression.trial measures.

    seconds = step_seconds(run, mesh, rows, steps=3)   # median of 3 after the compile

The cost model (jcomp.tune) prices links and codecs apart; what it cannot see
is how they share the machine with compute (processes contending for the
same cores, a collective's transfer overlapping the next layer's matmul).
compression.auto therefore lets a short trial settle the candidates the model
cannot tell apart (jcomp.train.autopick.weigh_by_trial), as XLA's autotuner and
cuDNN's benchmark mode time their kernel candidates instead of predicting them.

Each trial starts from the run's own initial parameters on its own mesh, steps
the first batch of the run's data, and is then dropped: nothing it computes
reaches the run. Every process of a cluster runs the same trials in the same
order (their collectives are joint) and takes process 0's timing, so all of
them take the same candidate.
"""
from __future__ import annotations

import statistics
import time

import jax

from jcomp import tune
from jcomp.train import outer, resume
from jcomp.train.stepcache import StepCache, global_batch


def step_seconds(run, mesh, rows, steps: int, warmup: int = 1) -> float:
    """Median seconds of `steps` train steps of `run` on `mesh` (an outer loop's
    inner steps, without its syncs), after `warmup`
    steps (the first pays for page faults and lazy buffers; the compile is
    before any), the steps being of `run`'s last phase (the one it trains in
    longest) on this process's `rows` [B / processes, L + 1]."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be an int >= 1; got {steps!r}")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"warmup must be an int >= 0; got {warmup!r}")
    make_params = resume.init_params(run)
    shapes = jax.eval_shape(make_params)
    tx = run.optim.tx(run.train.steps)
    # An outer loop's inner step takes the state less its outer part (the loop's
    # syncs are not timed here: compression.auto prices them per step).
    state = outer.inner_state(resume.init_state(run, make_params(), mesh, tx, shapes))
    batch = global_batch(mesh, rows, run.train.batch_size)
    exe, _ = StepCache(run, mesh, tx, shapes).train(run.phases[-1][1], state, batch)
    times = []
    for _ in range(warmup + steps):
        t0 = time.perf_counter()
        state, m = exe(state, batch)
        jax.block_until_ready(m["loss"])  # waits for the step (per island in an outer loop)
        times.append(time.perf_counter() - t0)
    # Process 0's figure on every process: the trials' choice must be one.
    [seconds] = tune.agree([statistics.median(times[warmup:])])
    return seconds

