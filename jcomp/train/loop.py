"""The training loop behind `train.py`.

    train_and_evaluate(config, workdir, stop=None, hooks=None)

A run is: the config read once into frozen settings and built into a
`RunSpec` (`jcomp.train.settings.runspec.read`, `build`); the workdir checked
and locked; the data loaded; the state restored from the newest usable
checkpoint or initialised (`jcomp.train.state.resume`); then per step a batch,
the step compiled for its compression phase and kept
(`jcomp.train.state.stepcache`), what runs around it (`jcomp.train.outer.driver`:
nothing, or an outer loop's syncs), its metrics record (`jcomp.train.run.record`),
and a checkpoint every checkpoint.every steps. Once the first step is compiled,
a table of what it sends goes above the progress bar (`jcomp.train.run.traffic`).
The caller's hooks (`jcomp.train.run.hooks`) run before each batch, after each step
and during each save.

Bad configuration and bad input raise `UsageError` (a ValueError) before any
file in the workdir is touched; `train.py` turns it into one line on stderr
and exit code 2. A write that fails mid-run (disk full) raises `WriteError`
naming the step that is safe to resume from. One trainer at a time: the
workdir is locked (`jcomp.train.run.faults.WorkdirLock`) before anything in it is read
for resuming or written.
"""
from __future__ import annotations

import contextlib
import errno
import logging
import os
import time

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from jcomp.train.auto import decide as auto_lib
from jcomp.train.auto import table as auto_table
from jcomp.train.run import checkpoint, cluster, data, faults, record as steprecord
from jcomp.train.state import resume
from jcomp.train.run import hooks as hooks_lib
from jcomp.gpt import mesh as mesh_lib
from jcomp.train.run import metrics as metrics_lib
from jcomp.train.outer import islands as outer_lib
from jcomp.train.outer import driver
from jcomp.train.run import profiler as profiler_lib
from jcomp.train.run import traffic
from jcomp.gpt import schedule as schedule_lib
from jcomp.gpt import sharding as sharding_lib
from jcomp.train.settings import runspec
from jcomp.train.settings.runspec import RunSpec, validate
from jcomp.train.state.stepcache import StepCache, global_batch

__all__ = ["train_and_evaluate", "validate", "load_data", "RunSpec", "UsageError",
           "WriteError", "NonFiniteError"]
_log = logging.getLogger(__name__)


UsageError = faults.UsageError  # a configuration or input the user must fix
WriteError = faults.WriteError  # a write failed mid-run (disk full, I/O error)


class NonFiniteError(RuntimeError):
    """Training stopped on a non-finite loss or gradient (train.nonfinite="stop")."""


def load_data(run: RunSpec, rows_sharding=None):
    """-> (corpus, training Dataset, this process's validation batches: the rows its
    devices hold under `rows_sharding` (`batch_sharding(mesh)`), or without one an
    equal share per process)."""
    d, vocab = run.data, run.model.vocab_size
    try:
        corpus = data.load(d.source, val_permille=d.val_permille, tokenizer=d.tokenizer,
                           token_dtype=d.token_dtype, vocab_size=vocab if d.tokens else None)
        if corpus.vocab_size > vocab:
            raise ValueError(f"the tokenizer has {corpus.vocab_size} tokens but "
                             f"model.vocab_size={vocab}")
        train = data.Dataset(corpus.train, d.seq_len, run.train.batch_size, seed=run.seed,
                             vocab_size=vocab)
        val = _val_batches(run, corpus, rows_sharding)
    except (OSError, ValueError, ImportError) as e:
        raise UsageError(f"data.source={d.source!r}: {e}") from None
    return corpus, train, val


def _val_batches(run: RunSpec, corpus, rows_sharding) -> list:
    if not len(corpus.val):
        return []
    where = ({"sharding": rows_sharding} if rows_sharding is not None else
             {"process_index": jax.process_index(), "process_count": jax.process_count()})
    return data.val_batches(corpus.val, run.data.seq_len, run.train.batch_size,
                            run.data.eval_batches, vocab_size=run.model.vocab_size, **where)


def batch_sharding(mesh) -> NamedSharding:
    """How `global_batch` lays a batch out on `mesh`: which rows each process loads
    (`data.Dataset.process_batch`), whichever mesh axes cross processes."""
    return NamedSharding(mesh, sharding_lib.batch_spec(sharding_lib.data_axes(mesh)))


def train_and_evaluate(cfg, workdir: str, stop: faults.StopFlag | None = None,
                       hooks: hooks_lib.Hooks | None = None) -> dict:
    """Trains per `cfg`, resuming from `workdir` when it holds checkpoints.
    Returns the last step's metrics record ({} when stopped before the first
    step) with what its compiled step sends added (`_with_traffic`), and with an
    outer loop what its syncs send across islands per inner step.
    `stop`: signal handling installed by the caller (otherwise installed here).
    `hooks`: a `jcomp.train.run.hooks.Hooks` the loop calls at its defined points."""
    # The config is read here, once, and never again: below this line the run
    # sees frozen settings (jcomp.train.settings), not the ConfigDict.
    settings = runspec.read(cfg, len(jax.devices()))
    own_stop = stop is None
    stop = faults.StopFlag().install() if own_stop else stop
    locks = []  # the workdir lock once taken, released however the run ends
    created = not os.path.exists(workdir)
    try:
        last = _train(settings, workdir, stop, hooks or hooks_lib.Hooks(), locks)
    except checkpoint.SaveError as e:
        where = f"saving the checkpoint of step {e.step} to {e.directory}"
        raise faults.write_failed(where, e.last_complete, e.reason, e.disk_full) from None
    finally:
        for lock in filter(None, locks):
            lock.release()
        if own_stop:
            stop.uninstall()
    if created and not last and stop.requested and jax.process_index() == 0:
        faults.remove_empty_workdir(workdir)  # stopped before its first step: nothing written
    return last


def _train(settings: runspec.Settings, workdir: str, stop: faults.StopFlag,
           hooks: hooks_lib.Hooks, locks: list) -> dict:
    auto = settings.auto  # None with compression.auto off
    run = runspec.build(settings.uncompressed() if auto else settings)
    faults.check_workdir(workdir)
    mesh = mesh_lib.make_mesh(run.mesh_shape, dcn_data=run.mesh_split())
    # The data is the same whatever auto chooses; which rows a process loads is not.
    corpus, train_ds, val = load_data(run, batch_sharding(mesh))
    decision = None  # compression.auto's summary: printed, logged and checkpointed
    if auto:
        rows = train_ds.process_batch(0, batch_sharding(mesh))
        run, decision = auto_lib.decide(settings, auto, run, mesh, workdir, rows=rows)
        if run.mesh_split() != mesh.shape.get(mesh_lib.DCN, 1):  # auto took the per-hop route
            mesh = mesh_lib.make_mesh(run.mesh_shape, dcn_data=run.mesh_split())
            val = _val_batches(run, corpus, batch_sharding(mesh))
    rows_sharding = batch_sharding(mesh)
    tx = run.optim.tx(run.train.steps)
    make_params = resume.init_params(run)
    shapes = jax.eval_shape(make_params)

    locks.append(faults.lock_workdir(workdir))
    if jax.process_count() > 1 and cluster.supervised():
        cluster.divert_stderr(workdir, jax.process_index())
    ckpt = resume.open_checkpoints(run, workdir)
    start = resume.restore_or_init(run, ckpt, mesh, tx, shapes, make_params, train_ds)
    state, streak = start.state, start.streak
    steps = StepCache(run, mesh, start.tx, shapes)
    outer = driver.for_run(run, mesh, shapes, start.tx, start.outer_pending)

    def stopped_before_any_step(i):
        # A signal during setup or the first compile: nothing new exists to save.
        # Alone only: processes of a cluster agree on a step to stop at, below.
        if i == start.step and stop.requested and jax.process_count() == 1:
            _log.warning("stop requested before the first step: nothing saved")
            return True
        return False

    def evaluates(done):
        return bool(val) and (done % t.eval_every == 0 or done == t.steps)

    metrics_path = os.path.join(workdir, "metrics.jsonl")
    try:
        writer = (metrics_lib.MetricsWriter(metrics_path, tensorboard=True)
                  if jax.process_index() == 0 else None)
    except OSError as e:
        raise faults.write_failed(f"opening {metrics_path}", ckpt.latest_step(), e.strerror,
                                  e.errno == errno.ENOSPC) from None
    profiler = profiler_lib.StepProfiler(
        run.train.profile_steps, os.path.join(workdir, "profile", f"process{jax.process_index()}"))
    t = run.train
    tokens_per_step = t.batch_size * run.data.seq_len
    lr_at = run.optim.schedule(start.schedule_steps)
    logged_phase = None  # the phase whose static metrics were last logged
    last, sent = {}, 0.0  # sent: bytes per device per step of the step running now
    if decision and jax.process_index() == 0:
        print(auto_table.table(decision), flush=True)
    with metrics_lib.Progress(t.steps, start.step) as bar, _finishing(ckpt, writer), profiler:
        for i in range(start.step, t.steps):
            done = i + 1
            ckpt.poll()  # a failed background save stops the run here
            rows = train_ds.process_batch(i, rows_sharding)
            rows = hooks.before_batch(done, rows, run.model.vocab_size)
            batch = global_batch(mesh, rows, t.batch_size)
            phase = schedule_lib.phase_at(run.phases, i)
            if stopped_before_any_step(i):
                break
            exe, report = steps.train(phase, outer_lib.inner_state(state), batch)
            if stopped_before_any_step(i):
                break
            profiler.step_starting(done)
            t0 = time.perf_counter()
            state, m = outer.step(exe, phase, steps, state, batch, i)
            m, skipped = outer.metrics(m, state)
            # Waiting on every step also keeps emulated CPU devices from deadlocking.
            loss = float(m["loss"])
            dt = time.perf_counter() - t0
            profiler.step_done(done)
            streak = 0 if bool(m["finite"]) else streak + 1
            if streak:
                _nonfinite(t, done, loss, streak, ckpt)
            record = steprecord.step_record(done, m, loss, dt, lr_at(i), tokens_per_step, phase,
                                            skipped)
            if "ef_norm" in record and 0 < t.ef_reset_norm < record["ef_norm"]:
                state = _reset_ef(state)
                record["ef_reset"] = True
                _log.warning("step %d: error-feedback residual norm %.4g exceeds "
                             "train.ef_reset_norm=%g: residuals reset to zero",
                             done, record["ef_norm"], t.ef_reset_norm)
            state = outer.after_step(done, state, record, phase, steps, batch, evaluates)
            if logged_phase != phase:
                record.update(steprecord.phase_record(phase, run.plan(phase), logged_phase, report,
                                                       state))
                sent = record["wire_bytes_total"]
                if logged_phase is None:
                    if decision and writer:
                        _append(writer, {"auto": decision}, metrics_path, done, ckpt, nested=True)
                    bar.write(_start_table(run, phase, report))
                    lines, figures = outer.first_phase(state, steps, phase, batch, report, val,
                                                       mesh)
                    for line in lines:
                        bar.write(line)
                    record.update(figures)
                if "compression_changes" in record:
                    _log.info("step %d: compression schedule: %s", done,
                              record["compression_changes"])
                logged_phase = phase
            if evaluates(done):
                model = outer.eval_params(state)
                record["val_loss"] = steps.val_loss(None, model, val)
                record.update(outer.island_losses(steps, state, val))
                if steps.forward_compressed(phase):
                    record["val_loss_compressed"] = steps.val_loss(phase, model, val)
            if writer and (steprecord.due(record, done, t.log_every, t.steps)
                           or "outer_applied" in record):
                _append(writer, record, metrics_path, done, ckpt)
            bar.update(done, loss=loss, tokens_per_s=record["tokens_per_s"], bytes_per_step=sent)
            last = record
            hooks.after_step(done, record)
            stopping = stop.agreed(done)
            meta = resume.checkpoint_meta(run, train_ds, done, start.schedule_steps, streak,
                                          auto=decision, outer_pending=outer.pending)
            if ckpt.maybe_save(done, state, meta, force=stopping or done == t.steps):
                hooks.during_save(done, os.fspath(ckpt.directory), stop)
            if stopping:
                _log.warning("stop requested: saved step %d", done)
                break
    if not last:
        return last
    return outer.final(_with_traffic(last, run, steps))


def _append(writer, record, metrics_path, done, ckpt, nested=False):
    try:
        faults.append_record(writer, record, nested)
    except OSError as e:
        raise faults.write_failed(f"writing {metrics_path} at step {done}", ckpt.latest_step(),
                                  e.strerror, e.errno == errno.ENOSPC) from None


def _start_table(run, phase, report) -> str:
    return traffic.start_text(report, run.plan(phase), n_layers=run.model.n_layers,
                              mesh_shape=_mesh_sizes(run), row=run.model.d_model,
                              act_dtype=run.model.dtype)


def _mesh_sizes(run) -> dict:
    return run.plan_sizes()


def _with_traffic(last: dict, run, steps: StepCache) -> dict:
    """`last` with what the last step's compiled program sends (wire_bytes_total,
    as logged on its phase's first step) and, for a compressed step, the
    uncompressed step's bytes (uncompressed_bytes_total): measured where this run
    compiled an uncompressed phase (uncompressed_measured True), else estimated
    from the message plan; absent where neither is known."""
    phase = schedule_lib.phase_at(run.phases, last["step"] - 1)
    report, plan = steps.train_report(phase), run.plan(phase)
    out = {**last, "wire_bytes_total": float(report.total())}
    if not traffic.compresses(plan):
        return out
    measured = [r for p, r in steps.train_reports().items()
                if not traffic.compresses(run.plan(p))]
    if measured:
        return {**out, "uncompressed_bytes_total": float(measured[0].total()),
                "uncompressed_measured": True}
    exact = traffic.preset_plan("baseline", run.model.n_layers, _mesh_sizes(run))
    guess = traffic.estimate(report, plan, exact, run.model.d_model, run.model.dtype)
    if guess is None:
        return out
    return {**out, "uncompressed_bytes_total": guess.total(), "uncompressed_measured": False}


def _nonfinite(t, done: int, loss: float, streak: int, ckpt):
    """Step `done` gave a non-finite loss or gradient norm, the `streak`-th in a
    row: NonFiniteError when train.nonfinite or its limit says stop, else a warning."""
    msg = f"non-finite loss or gradient norm at step {done} (loss={loss})"
    if t.nonfinite == "stop":
        raise NonFiniteError(msg)
    if streak >= t.nonfinite_limit:
        raise NonFiniteError(
            f"{msg}: {streak} updates in a row skipped (steps "
            f"{done - streak + 1}-{done}), train.nonfinite_limit={t.nonfinite_limit}; "
            f"the last checkpoint is step {ckpt.latest_step()}")
    _log.warning("%s: update skipped", msg)


def _reset_ef(state):
    """The state with its error-feedback residuals zeroed (shardings kept)."""
    zero = dict(state["zero"])
    zero["ef"] = jax.tree.map(jnp.zeros_like, zero["ef"])
    return {**state, "zero": zero}


@contextlib.contextmanager
def _finishing(ckpt, writer):
    """However the loop ends (done, stopped, an error), the save in flight is
    completed and the files are closed, so the last checkpoint stays usable."""
    try:
        yield
    finally:
        try:
            ckpt.wait()
            ckpt.close()
        finally:
            if writer:
                writer.close()
