"""A delayed, overlapped outer sync (outer.delay = tau > 0): Streaming DiLoCo's
overlapping communication in the trainer's outer loop (`jcomp.train.outer.islands`).

Fragment f's sync falls in two parts. The start (`outer.make_sync(...,
stage="start")`, due after step n) forms the pseudo-gradient from the
islands' masters at n, averages it across islands and steps the outer
optimizer into the anchor, the residuals and the outer state, leaving the
islands' params alone. The merge (`make_apply`, after step n + tau) sets each
island's master of the fragment to mix * its own + (1 - mix) * the anchor's
(the paper's mixing factor, the islands' share; 0.5 as there) and gathers its
working params anew.

The start overlaps step n + 1 where it can, as `overlap_for` picks:

- "program" (GPU, TPU): the start rides in step n + 1's program (`carry`). The
  step and the start read the same state and neither reads what the other
  writes, so the compiler may run the exchange across islands while the step
  computes; such a backend runs a program's collectives asynchronously to its
  compute. Dispatched back to back as two programs, they would run one after
  the other on a device.
- "thread" (CPU): the start's own program is dispatched from a thread of its
  own while the main thread runs the step, on a copy of the masters it reads
  (the step donates them). A CPU client runs a program over several devices in
  the thread that dispatches it, and a program's collectives one at a time in
  order, so in one program the step's first collective would wait for the
  exchange (docs/experiments.md has what the rig shows).
- "serial" (CPU, where an island spans several processes): the start runs
  alone on the main thread, then the step; nothing overlaps. There the step's
  collectives cross processes too, and two threads would issue the two
  programs' cross-process collectives in an order each process picks for
  itself; the CPU runtime keys a rendezvous by a channel id that does not
  tell them apart, and stops when devices meet in different ones
  (`jcomp.collectives.cpu`). With an island per process the step sends
  nothing between processes, and the thread is safe.

Every way, the state after step n + 1 is the same, bit for bit, as the start
run alone after step n and then the step. After a step that is evaluated, or
the run's last, the start runs alone (`Syncs.run_sync`), so that the global
model evaluated there holds it.

The pending result is the anchor itself, part of the checkpointed state;
whether a merge is due is a function of the step alone
(`fragments.applied`); a start due but not yet carried is named in the
checkpoint's metadata (outer_pending) and carried by the resumed run's first
step. So a save with a sync in flight resumes bit for bit. outer.delay < H,
so a fragment's next start comes after its last merge. A start whose merge
would fall after train.steps leaves the islands' params without it; the
global model (the anchor) has it. With delay 0 the sync is the blocking one,
unchanged.
"""
from __future__ import annotations

import concurrent.futures
import textwrap
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jcomp.meter import wire
from jcomp.train.outer import fragments
from jcomp.train.outer.islands import (AXIS, Syncs, cast_islands, inner_state, is_spec, make_sync,
                               master_specs, part_shapes, plan_of)
from jcomp.train.run.traffic import WIDTH


def make_apply(run, mesh, params_shapes, tx, fragment: int):
    """fn(state) -> state: fragment `fragment` of every island's master merged
    with the anchor (mix * own + (1 - mix) * anchor, outer.mix), its working
    params gathered anew; the outer state unchanged."""
    specs, zspecs = master_specs(run, params_shapes, tx)
    zleaves, ztree = jax.tree.flatten(zspecs, is_leaf=is_spec)
    pleaves = jax.tree.leaves(specs, is_leaf=is_spec)
    parts = plan_of(run, params_shapes)[fragment]
    info = part_shapes(run, params_shapes, mesh, tx, parts)
    shapes = jax.tree.leaves(params_shapes)
    own, other = jnp.float32(run.outer.mix), jnp.float32(1.0 - run.outer.mix)

    def merge(m_IxX, a, spec):
        return jax.shard_map(lambda m, x: own * m + other * x[None], mesh=mesh,
                             in_specs=(P(AXIS, *spec), spec), out_specs=P(AXIS, *spec))(m_IxX, a)

    def apply(state):
        masters = jax.tree.leaves(state["zero"]["master"])
        anchor = jax.tree.leaves(state["outer"]["anchor"])
        params, ptree = jax.tree.flatten(state["params"])
        for j, part in enumerate(parts):
            i, spec = part.leaf, info[j][2]
            if part.layers is None:
                masters[i] = merge(masters[i], anchor[i], spec)
                m = fragments.to_param(masters[i], pleaves[i], zleaves[i], shapes[i].shape,
                                       mesh, AXIS)
            else:
                a, b = part.layers
                m = fragments.to_param(masters[i], pleaves[i], zleaves[i], shapes[i].shape,
                                       mesh, AXIS)
                an = fragments.to_param(anchor[i], pleaves[i], zleaves[i], shapes[i].shape,
                                        mesh)
                m = m.at[:, a:b].set(merge(m[:, a:b], an[a:b], spec))
                masters[i] = fragments.to_zero(m, pleaves[i], zleaves[i], run.zero.multiple,
                                               mesh, AXIS)
            params[i] = cast_islands(m, shapes[i].dtype, pleaves[i], mesh)
        zstate = {**state["zero"], "master": jax.tree.unflatten(ztree, masters)}
        return {**state, "params": jax.tree.unflatten(ptree, params), "zero": zstate}

    return apply


def carry(train_fn, start_fn):
    """fn(inner, batch, outer, n) -> (inner after the step, its metrics, outer
    after the start): one inner step and a fragment's sync start, due after
    step n (`inner`'s state), in one program. Neither reads what the other
    writes, so the compiler may run the start's exchange across islands while
    the step computes; as two programs, one device runs them one after the other.
    The start reads the islands' state before the step, as it would alone."""
    def fused(inner, batch, outer, n):
        new_inner, metrics = train_fn(inner, batch)
        return new_inner, metrics, start_fn(outer, inner, n)
    return jax.jit(fused, donate_argnums=(0, 2))


OVERLAPS = ("program", "thread", "serial")

# New buffers of the same values and layout, on every process (a copy the
# program makes, since it may not hand back the buffers it was given).
_copy = jax.jit(lambda tree: jax.tree.map(jnp.copy, tree))


def overlap_for(backend: str, island_processes: int = 1) -> str:
    """How a carried start overlaps its step on `backend` (module docstring):
    "program" off CPU; on CPU "thread", where a program runs in its dispatching
    thread and its collectives one at a time, or "serial" where an island spans
    `island_processes` > 1 processes (no overlap: two threads' cross-process
    collectives, in orders the processes pick apart, deadlock the CPU runtime)."""
    if backend != "cpu":
        return "program"
    return "thread" if island_processes <= 1 else "serial"


def island_processes(mesh) -> int:
    """The most processes whose devices one island of `mesh` (an index of its
    'dcn' axis) holds."""
    devices = np.asarray(mesh.devices)
    axis = list(mesh.axis_names).index(AXIS)
    rows = np.moveaxis(devices, axis, 0).reshape(devices.shape[axis], -1)
    return max(len({d.process_index for d in row}) for row in rows)


def compile_all(run, mesh, params_shapes, tx, state):
    """-> (every fragment's compiled start: fn(outer, rest, step) -> outer, its
    compiled merge: fn(state) -> state, its bytes per device across islands,
    its start as a jitted function, for `carry`)."""
    step_no = jnp.zeros((), jnp.int32)
    keep = jax.tree.map(lambda x: x.sharding, state)
    rest = inner_state(state)
    starts, applies, sent, fns = [], [], [], []
    for f in range(run.outer.fragments):
        sync = make_sync(run, mesh, params_shapes, tx, f, stage="start")
        # Only the outer state is donated and returned: the islands' state stays
        # the next inner step's, so that step need not wait for this one.
        start = jax.jit(lambda outer, rest, n, sync=sync: sync({**rest, "outer": outer},
                                                               n)["outer"],
                        donate_argnums=0, out_shardings=keep["outer"])
        exe = start.lower(state["outer"], rest, step_no).compile()
        starts.append(exe)
        fns.append(start)
        sent.append(float(wire.measure_compiled(exe, mesh).by_axis().get(AXIS, 0.0)))
        apply = make_apply(run, mesh, params_shapes, tx, f)
        applies.append(jax.jit(apply, donate_argnums=0, out_shardings=keep).lower(state)
                       .compile())
    return starts, applies, sent, fns


class DelayedSyncs(Syncs):
    """`Syncs` whose fragments start overlapped with the next inner step
    (`run_carried`), or alone after an evaluated or the last step
    (`compile_all`'s starts), and merge outer.delay steps later (its merges).
    `overlap`: one of OVERLAPS; None: `overlap_for` the default backend and
    `mesh`'s islands. "thread" is refused where an island spans several
    processes."""

    def __init__(self, run, mesh, params_shapes, tx, overlap: str | None = None):
        super().__init__(run, mesh, params_shapes, tx)
        self.island_processes = island_processes(mesh)
        if overlap is None:
            overlap = overlap_for(jax.default_backend(), self.island_processes)
        if overlap not in OVERLAPS:
            raise ValueError(f"overlap={overlap!r}; allowed: {', '.join(OVERLAPS)}")
        if overlap == "thread" and self.island_processes > 1:
            raise ValueError(f"overlap='thread' with islands of {self.island_processes} "
                             "processes: the step's and the start's collectives across "
                             "processes would run in no agreed order; allowed: serial, program")
        self.overlap = overlap
        self._pool = None

    def start_line(self, inner_bytes: float) -> str:
        line = super().start_line(inner_bytes)
        if self.overlap != "serial":
            return line
        return line + "\n" + textwrap.fill(
            f"outer.delay={self.run.outer.delay}: each island spans "
            f"{self.island_processes} processes, so on CPU a sync's start runs before the "
            "next step, not beside it (two threads' collectives across processes can "
            "deadlock the CPU runtime).", WIDTH, subsequent_indent="  ")

    def _compile(self, state):
        self._exe, self._apply, self.bytes_per_sync, self._start_fns = compile_all(
            self.run, self.mesh, self.shapes, self.tx, state)
        self._carried = {}  # (phase, fragment) -> compiled `carry` program

    def prepare_carried(self, phase, steps, state, batch):
        """Compiles what carrying a start in `phase` needs (once), so that no
        compile falls inside a step. `steps`: the run's StepCache."""
        self.prepare(state)
        inner = inner_state(state)
        steps.train(phase, inner, batch)
        if self.overlap != "program":
            return
        n = jnp.zeros((), jnp.int32)
        for f in range(self.run.outer.fragments):
            if (phase, f) not in self._carried:
                fn = carry(steps.train_fn(phase), self._start_fns[f])
                self._carried[phase, f] = fn.lower(inner, batch, state["outer"], n).compile()

    def run_carried(self, fragment: int, phase, steps, state, batch, started_after: int):
        """-> (state after one inner step on `batch` with fragment `fragment`'s
        sync start, due after step `started_after` (`state`'s), overlapped with
        it; the step's metrics; with overlap "thread" or "serial", the start's
        own seconds, else None). `steps`: the run's StepCache."""
        self.prepare_carried(phase, steps, state, batch)
        inner = inner_state(state)
        n = jnp.asarray(started_after, jnp.int32)
        if self.overlap == "program":
            inner, metrics, outer = self._carried[phase, fragment](inner, batch, state["outer"], n)
            return {**inner, "outer": outer}, metrics, None
        if self.overlap == "serial":
            # Done before the step is dispatched, so every process issues the
            # start's collectives, then the step's, in the same order.
            t0 = time.perf_counter()
            outer = jax.block_until_ready(self._exe[fragment](state["outer"], inner, n))
            seconds = time.perf_counter() - t0
            exe, _ = steps.train(phase, inner, batch)
            inner, metrics = exe(inner, batch)
            return {**inner, "outer": outer}, metrics, seconds
        # The start reads the masters the step donates: it gets a copy of its own.
        masters = _copy(inner["zero"]["master"])
        rest = {**inner, "zero": {**inner["zero"], "master": masters}}

        def start():
            t0 = time.perf_counter()
            outer = jax.block_until_ready(self._exe[fragment](state["outer"], rest, n))
            return outer, time.perf_counter() - t0

        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(1, "outer-start")
        started = self._pool.submit(start)
        exe, _ = steps.train(phase, inner, batch)
        inner, metrics = exe(inner, batch)
        jax.block_until_ready(inner)
        outer, seconds = started.result()
        return {**inner, "outer": outer}, metrics, seconds


def syncs_for(run, mesh, params_shapes, tx):
    """The run's sync programs: delayed where outer.delay > 0, else blocking."""
    return (DelayedSyncs if run.outer.delay else Syncs)(run, mesh, params_shapes, tx)
