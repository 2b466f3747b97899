"""The training loop behind `train.py`: config -> mesh and policy -> model and
step -> data, checkpoints and metrics.

    train_and_evaluate(config, workdir)

Bad configuration and bad input raise `UsageError` (a ValueError) before any
file in the workdir is touched; `train.py` turns it into one line on stderr
and exit code 2. A write that fails mid-run (disk full) raises `WriteError`
naming the step that is safe to resume from. One trainer at a time: the
workdir is locked (`jcomp.faults.WorkdirLock`) before anything in it is read
for resuming or written.

Test hooks. End-to-end fault tests inject faults into the real command through
these environment variables; all are unset in normal use:

    JCOMP_TEST_STEP_SLEEP=S          sleep S seconds after each step, so that a
                                     signal can land mid-run
    JCOMP_TEST_KILL_DURING_SAVE=K    SIGKILL this process once the asynchronous
                                     save of step K has its temporary directory
    JCOMP_TEST_NAN_STEP=K[,K2...]    give step K (each listed step) target ids
                                     outside [0, V), which the vocab-parallel loss
                                     turns into a NaN loss
    JCOMP_TEST_SIGINT_DURING_SAVE=K  send this process SIGINT twice (a double
                                     Ctrl-C) at the same point of step K's save
"""
from __future__ import annotations

import contextlib
import dataclasses
import errno
import functools
import gc
import json
import logging
import os
import signal
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from jcomp import autoencoder, checkpoint, data, faults, messages, optimizer, parallel, step, wire
from jcomp import mesh as mesh_lib
from jcomp import metrics as metrics_lib
from jcomp import model as gpt
from jcomp import policy as policy_lib
from jcomp import schedule as schedule_lib

_log = logging.getLogger(__name__)


UsageError = faults.UsageError  # a configuration or input the user must fix
WriteError = faults.WriteError  # a write failed mid-run (disk full, I/O error)


class NonFiniteError(RuntimeError):
    """Training stopped on a non-finite loss or gradient (train.nonfinite="stop")."""


# ------------------------------------------------------------------ config

def _positive(cfg, name, *, zero_ok=False, integer=True):
    value = cfg
    for part in name.split("."):
        value = value[part]
    kind = int if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kind):
        raise UsageError(f"{name} must be {'an integer' if integer else 'a number'}; got {value!r}")
    if not np.isfinite(value) or value < 0 or (value == 0 and not zero_ok):
        raise UsageError(f"{name} must be {'>= 0' if zero_ok else '> 0'}; got {value}")
    return value


def build_policy(comp) -> policy_lib.Policy:
    """config.compression -> Policy (ValueError naming the field on bad input)."""
    if comp.policy not in policy_lib.PRESETS:
        raise UsageError(f"compression.policy={comp.policy!r} is not one of "
                         f"{', '.join(policy_lib.PRESETS)}")
    if comp.error_feedback not in ("auto", "on", "off"):
        raise UsageError(f"compression.error_feedback={comp.error_feedback!r}; "
                         "allowed: auto, on, off")
    overrides = {}
    for axis, kind in policy_lib.MESSAGES:
        spec = comp[axis][kind]
        if spec:
            try:
                policy_lib.preset("baseline").replace({f"{axis}.{kind}": spec})
            except (TypeError, ValueError) as e:
                raise UsageError(f"compression.{axis}.{kind}: {e}") from None
            overrides[f"{axis}.{kind}"] = spec
    ef = {"auto": None, "on": True, "off": False}[comp.error_feedback]
    try:
        pol = policy_lib.build(comp.policy, overrides, ef)
    except (TypeError, ValueError) as e:
        raise UsageError(f"compression: {e}") from None
    for (axis, kind), place in policy_lib.PLACES.items():
        try:
            pol = pol.restrict({f"{axis}.{kind}": comp[place][axis][kind]})
        except (TypeError, ValueError) as e:
            raise UsageError(f"compression.{place}.{axis}.{kind}: {e}") from None
    return pol


def build_phases(comp) -> list:
    """config.compression -> [(first step, policy in force)] from step 0 (see
    `jcomp.schedule`); the last one lays out the train state."""
    base = build_policy(comp)
    specs = {f"{a}.{k}": comp.schedule[a][k] for a, k in policy_lib.MESSAGES}
    try:
        sched = schedule_lib.parse(specs, base=base, warmup_steps=comp.warmup_steps,
                                   prefix="compression.")
        return schedule_lib.phases(base, sched)
    except (TypeError, ValueError) as e:
        raise UsageError(str(e)) from None


def _model_config(cfg) -> gpt.ModelConfig:
    try:
        return gpt.ModelConfig(**cfg.model.to_dict())
    except (TypeError, ValueError) as e:
        raise UsageError(str(e).replace("ModelConfig.", "model.")) from None


def validate(cfg, n_devices: int):
    """Checks the whole config before anything runs. -> (model cfg, mesh shape, policy
    the train state is laid out for: the last phase of the compression schedule)."""
    model_cfg = _model_config(cfg)
    try:
        shape = mesh_lib.resolve_shape(cfg.mesh.to_dict(), n_devices)
    except (TypeError, ValueError) as e:
        raise UsageError(f"mesh: {e}") from None
    mesh_shape = dict(zip(mesh_lib.AXES, shape))
    for name in ("train.steps", "train.batch_size", "train.microbatches", "train.log_every",
                 "train.eval_every", "train.nonfinite_limit", "data.seq_len",
                 "data.eval_batches", "checkpoint.every", "checkpoint.keep"):
        _positive(cfg, name)
    for name in ("optim.warmup_steps", "compression.warmup_steps", "data.val_permille"):
        _positive(cfg, name, zero_ok=True)
    for name in ("optim.lr", "compression.bucket_mib"):
        _positive(cfg, name, integer=False)
    for name in ("optim.weight_decay", "optim.clip_norm", "optim.min_lr_ratio",
                 "train.ef_reset_norm"):
        _positive(cfg, name, zero_ok=True, integer=False)
    if cfg.optim.name not in optimizer.OPTIMIZERS:
        raise UsageError(f"optim.name={cfg.optim.name!r}; allowed: {', '.join(optimizer.OPTIMIZERS)}")
    if cfg.optim.zero_stage not in (1, 2):
        raise UsageError(f"optim.zero_stage={cfg.optim.zero_stage!r}; allowed: 1, 2")
    if cfg.train.nonfinite not in ("skip", "stop"):
        raise UsageError(f"train.nonfinite={cfg.train.nonfinite!r}; allowed: skip, stop")
    try:
        metrics_lib.parse_profile_steps(cfg.train.profile_steps, cfg.train.steps)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if cfg.data.seq_len > model_cfg.max_seq_len:
        raise UsageError(f"data.seq_len={cfg.data.seq_len} exceeds "
                         f"model.max_seq_len={model_cfg.max_seq_len}")
    try:
        parallel.check_layout(model_cfg, mesh_shape, cfg.train.batch_size, cfg.train.microbatches)
    except ValueError as e:
        raise UsageError(str(e).replace("batch_size", "train.batch_size")
                         .replace("microbatches=", "train.microbatches=")) from None
    if cfg.train.batch_size % jax.process_count():
        raise UsageError(f"train.batch_size={cfg.train.batch_size} is not divisible by the "
                         f"{jax.process_count()} processes")
    _check_data_fields(cfg.data)
    phases = build_phases(cfg.compression)
    _check_randomness(phases)
    pol = phases[-1][1]
    _check_compression_reaches_the_run(cfg, phases)
    try:
        optimizer.check_stage(pol, cfg.optim.zero_stage)
    except ValueError as e:
        raise UsageError(f"compression.data.grad: {e}") from None
    try:
        ae = autoencoder.dims(pol)
    except ValueError as e:
        raise UsageError(f"compression.tensor: {e}") from None
    for kind, dim in (("act", ae["out_dim"]), ("act_grad", ae["in_dim"])):
        if dim > model_cfg.d_model:
            raise UsageError(f"compression.tensor.{kind}: ae dim={dim} exceeds "
                             f"model.d_model={model_cfg.d_model}")
    try:
        pol.check_places(model_cfg.n_layers, mesh_shape[mesh_lib.AXES[2]])
    except ValueError as e:
        raise UsageError(f"compression.{e}") from None
    return model_cfg, shape, pol


def _check_randomness(phases):
    """Codecs that draw random numbers get a per-step key only where the optimizer
    sends (data.grad, data.param); inside the model they would have none."""
    keyed = (("data", "grad"), ("data", "param"))
    for _, pol in phases:
        for axis, kind in policy_lib.MESSAGES:
            spec = pol[axis, kind]
            if (axis, kind) not in keyed and getattr(spec, "needs_key", False):
                raise UsageError(
                    f"compression.{axis}.{kind}={spec}: codecs that draw random numbers "
                    "(stochastic rounding ':sr', randk) are supported at data.grad and "
                    "data.param only; use a deterministic codec here (e.g. int8)")


def _check_data_fields(d):
    """Fields that apply to one kind of source only are refused for the other,
    instead of being ignored."""
    tokens = isinstance(d.source, str) and d.source.startswith("tokens:")
    if tokens and d.tokenizer:
        raise UsageError(f"data.tokenizer={d.tokenizer!r} does not apply to data.source="
                         f"{d.source!r}: token files hold token ids already; pass "
                         "--config.data.tokenizer='' (and data.token_dtype)")
    if not tokens and d.token_dtype:
        raise UsageError(f"data.token_dtype={d.token_dtype!r} applies only to a 'tokens:' "
                         f"source; data.source={d.source!r} is text: pass "
                         "--config.data.token_dtype=''")


def _check_compression_reaches_the_run(cfg, phases):
    """A compression setting no step of the run would use is refused: error
    feedback with nothing lossy to feed back, or a warm-up or schedule whose
    compressed phases all start at or after train.steps."""
    comp, steps, final = cfg.compression, cfg.train.steps, phases[-1][1]
    if comp.error_feedback == "on" and not optimizer.uses_error_feedback(final):
        raise UsageError(
            "compression.error_feedback='on' has nothing to feed back: compression.data.grad "
            f"is {optimizer.grad_codec(final)} (lossless); error feedback corrects a lossy "
            "data.grad codec: set one (e.g. int8), or error_feedback='auto' or 'off'")
    starts = [s for s, pol in phases if schedule_lib.is_compressed(pol)]
    if starts and min(starts) >= steps:
        if comp.warmup_steps >= steps:
            raise UsageError(f"compression.warmup_steps={comp.warmup_steps} is not below "
                             f"train.steps={steps}: no step would be compressed; allowed: "
                             f"0 to {steps - 1}")
        raise UsageError(f"compression.schedule: the first compressed phase starts at step "
                         f"{min(starts)}, not below train.steps={steps}: no step would be "
                         "compressed")


def make_tx(cfg, total_steps=None):
    """AdamW (or SGD) for `cfg.optim`; its schedule spans `total_steps` (default train.steps)."""
    o = cfg.optim
    try:
        return optimizer.make_tx(name=o.name, lr=o.lr, warmup_steps=o.warmup_steps,
                                 total_steps=total_steps or cfg.train.steps,
                                 min_lr_ratio=o.min_lr_ratio, b1=o.b1, b2=o.b2, eps=o.eps,
                                 weight_decay=o.weight_decay, decay_mask=optimizer.decay_mask)
    except (TypeError, ValueError) as e:
        raise UsageError(f"optim: {e}") from None


def load_data(cfg, model_cfg):
    d = cfg.data
    try:
        tokens = d.source.startswith("tokens:")
        corpus = data.load(d.source, val_permille=d.val_permille,
                           tokenizer=(d.tokenizer or None) if not tokens else None,
                           token_dtype=(d.token_dtype or None) if tokens else None,
                           vocab_size=model_cfg.vocab_size if tokens else None)
        if corpus.vocab_size > model_cfg.vocab_size:
            raise ValueError(f"the tokenizer has {corpus.vocab_size} tokens but "
                             f"model.vocab_size={model_cfg.vocab_size}")
        train = data.Dataset(corpus.train, d.seq_len, cfg.train.batch_size, seed=cfg.seed,
                             vocab_size=model_cfg.vocab_size)
        val = data.val_batches(corpus.val, d.seq_len, cfg.train.batch_size, d.eval_batches,
                               jax.process_index(), jax.process_count(),
                               vocab_size=model_cfg.vocab_size) if len(corpus.val) else []
    except (OSError, ValueError, ImportError) as e:
        raise UsageError(f"data.source={d.source!r}: {e}") from None
    return corpus, train, val


# -------------------------------------------------------------- test hooks

_HOOKS = {"JCOMP_TEST_STEP_SLEEP": float, "JCOMP_TEST_KILL_DURING_SAVE": int,
          "JCOMP_TEST_NAN_STEP": "steps", "JCOMP_TEST_SIGINT_DURING_SAVE": int}


def _test_hooks() -> dict:
    """{name: value} of the test hooks that are set (see the module docstring)."""
    out = {}
    for name, kind in _HOOKS.items():
        raw = os.environ.get(name, "")
        if not raw:
            continue
        try:
            values = [int(v) for v in raw.split(",")] if kind == "steps" else [kind(raw)]
        except ValueError:
            values = [-1]
        if not all(np.isfinite(v) and v >= 0 for v in values):
            raise UsageError(f"environment variable {name}={raw!r} must be a "
                             f"{'number' if kind is float else 'step number'} >= 0")
        out[name] = set(values) if kind == "steps" else values[0]
    return out


def _await_temporary(ckpt, step_no: int, limit_s: float = 10.0):
    """Waits until the save of `step_no` has its temporary directory on disk (it
    is made by a background thread), so that a fault lands mid-save."""
    start = time.monotonic()
    while time.monotonic() - start < limit_s and not any(
            n.startswith(f"{step_no}{checkpoint.TMP_MARK}") for n in os.listdir(ckpt.directory)):
        time.sleep(0.005)


def _nan_batch(rows_BxL1, vocab_size: int):
    """Every id set to V: no vocabulary shard owns it, so the loss is NaN."""
    return np.full(np.shape(rows_BxL1), vocab_size, np.int32)


def _reset_ef(state):
    """The state with its error-feedback residuals zeroed (shardings kept)."""
    zero = dict(state["zero"])
    zero["ef"] = jax.tree.map(jnp.zeros_like, zero["ef"])
    return {**state, "zero": zero}


# -------------------------------------------------------------------- loop

def _global_batch(mesh, local_rows, global_rows):
    sharding = NamedSharding(mesh, parallel.BATCH_SPEC)
    local = np.asarray(local_rows, np.int32)
    return jax.make_array_from_process_local_data(sharding, local, (global_rows,) + local.shape[1:])


def _fingerprint(cfg, model_cfg, shape, pol):
    return {"model": dataclasses.asdict(model_cfg), "mesh": list(shape),
            "zero_stage": int(cfg.optim.zero_stage), "policy": pol.as_dict(),
            "error_feedback": bool(optimizer.uses_error_feedback(pol))}


# What the data position saved in a checkpoint must match, and the config field
# that decides each (`data.Dataset.state`).
_DATA_FIELDS = {"seed": "seed", "seq_len": "data.seq_len", "global_batch": "train.batch_size"}


def _data_mismatches(train_ds):
    """check_meta for `Checkpointer.restore`: a resumed run must see the batches
    the checkpoint's run would have seen next."""
    mine = train_ds.state(0)

    def check(meta):
        saved = meta.get("data") if isinstance(meta, dict) else None
        if not isinstance(saved, dict):
            return ["it records no data position"]
        out = [f"it was written for {field}={saved.get(key)!r}, this run has {field}={mine[key]!r}"
               for key, field in _DATA_FIELDS.items() if saved.get(key) != mine[key]]
        if saved.get("fingerprint") != mine["fingerprint"]:
            out.append("it was written for other training data (data.source, data.tokenizer "
                       "or data.val_permille differ)")
        return out
    return check


def _open_checkpoints(cfg, workdir):
    ckpt_dir = os.path.join(os.path.abspath(workdir), "checkpoints")
    try:
        os.makedirs(ckpt_dir, exist_ok=True)
        ckpt = checkpoint.Checkpointer(ckpt_dir, save_every=cfg.checkpoint.every,
                                       keep=cfg.checkpoint.keep)
    except OSError as e:
        raise UsageError(f"checkpoint directory {ckpt_dir} cannot be created: "
                         f"{e.strerror or e}") from None
    if jax.process_index() == 0:
        for path in ckpt.remove_unfinished():
            _log.warning("removed %s: a save that never finished (the run writing it was "
                         "stopped mid-save)", path)
    newest = ckpt.latest_step()
    if newest is not None and cfg.train.steps < newest:
        ckpt.close()
        raise UsageError(f"train.steps={cfg.train.steps} is below step {newest} of the newest "
                         f"checkpoint in {ckpt_dir}; allowed: >= {newest} (or another --workdir)")
    return ckpt


def train_and_evaluate(cfg, workdir: str, stop: faults.StopFlag | None = None) -> dict:
    """Trains per `cfg`, resuming from `workdir` when it holds checkpoints.
    Returns the last logged metrics ({} when stopped before the first step).
    `stop`: signal handling installed by the caller (otherwise installed here)."""
    own_stop = stop is None
    stop = faults.StopFlag().install() if own_stop else stop
    locks = []  # the workdir lock once taken, released however the run ends
    try:
        return _train(cfg, workdir, stop, locks)
    except checkpoint.SaveError as e:
        where = f"saving the checkpoint of step {e.step} to {e.directory}"
        raise faults.write_failed(where, e.last_complete, e.reason, e.disk_full) from None
    finally:
        for lock in filter(None, locks):
            lock.release()
        if own_stop:
            stop.uninstall()


def _train(cfg, workdir: str, stop: faults.StopFlag, locks: list) -> dict:
    model_cfg, shape, pol = validate(cfg, len(jax.devices()))
    hooks = _test_hooks()
    faults.check_workdir(workdir)
    tx = make_tx(cfg)
    corpus, train_ds, val = load_data(cfg, model_cfg)
    mesh = mesh_lib.make_mesh(shape)
    init_params = functools.partial(gpt.init_params, model_cfg, jax.random.key(cfg.seed),
                                    coders=autoencoder.coders(pol))
    shapes = jax.eval_shape(init_params)
    fingerprint = _fingerprint(cfg, model_cfg, shape, pol)

    locks.append(faults.lock_workdir(workdir))
    ckpt = _open_checkpoints(cfg, workdir)
    restored = None
    try:
        with _quiet(logging.getLogger(checkpoint.__name__), ckpt):
            restored = ckpt.restore(step.abstract_state(shapes, mesh, tx, pol),
                                    expect_meta={"fingerprint": fingerprint},
                                    check_meta=_data_mismatches(train_ds))
    except checkpoint.CheckpointError as e:  # it lists every step it skipped
        ckpt.close()
        hint = "" if e.failures else "; rerun with the values it was written for, or " \
            "pass another --workdir"
        raise UsageError(f"checkpoint: {e}{hint}") from None
    for path, reason in ckpt.skipped:
        # Set aside rather than left in place, where it would block saving
        # its step again and outlive good checkpoints in keep's count.
        moved = ckpt.set_aside(int(os.path.basename(path)))
        _log.warning("checkpoint %s cannot be used: %s; moved to %s", path, reason, moved)
    # The learning-rate schedule is the first run's: a resumed run keeps its length
    # whatever train.steps says now (steps past it run at the final rate).
    schedule_steps, streak = cfg.train.steps, 0
    if restored is not None:
        state, meta, start = restored
        train_ds.restore(meta["data"])
        schedule_steps = int(meta.get("schedule_steps", cfg.train.steps))
        streak = int(meta.get("nonfinite_streak", 0))
        _log.info("resumed from %s at step %d", ckpt.step_path(start), start)
        if schedule_steps != cfg.train.steps:
            _log.warning("train.steps=%d differs from the %d steps the learning-rate schedule "
                         "was laid out for; it keeps that length (constant after step %d)",
                         cfg.train.steps, schedule_steps, schedule_steps)
            tx = make_tx(cfg, schedule_steps)
    else:
        params = init_params()
        state, start = step.init_state(params, mesh, tx, pol), 0

    common = dict(microbatches=cfg.train.microbatches, zero_stage=cfg.optim.zero_stage,
                  clip_norm=float(cfg.optim.clip_norm), remat=cfg.train.remat, seed=cfg.seed,
                  bucket_bytes=max(int(cfg.compression.bucket_mib * 2**20), 1))
    phases = build_phases(cfg.compression)
    plans = {phase: messages.plan(phase, model_cfg.n_layers, dict(mesh.shape))
             for _, phase in phases}
    compiled, evals = {}, {}

    def compiled_step(phase, state, batch):
        # Compiled when first reached: a phase the run never gets to costs nothing.
        if phase not in compiled:
            fn = step.make_train_step(model_cfg, mesh, pol, plans[phase], tx, shapes, **common)
            exe = fn.lower(state, batch).compile()
            compiled[phase] = (exe, wire.measure_compiled(exe, mesh))
        return compiled[phase]

    def val_loss(phase, params):
        if phase not in evals:
            evals[phase] = step.make_eval_step(model_cfg, mesh, plans[phase], shapes,
                                               microbatches=cfg.train.microbatches)
        return float(np.mean([float(evals[phase](params, _global_batch(
            mesh, b, cfg.train.batch_size))) for b in val]))

    def stopped_before_any_step(i):
        # A signal during setup or the first compile: nothing new exists to save.
        # Alone only: processes of a cluster agree on a step to stop at, below.
        if i == start and stop.requested and jax.process_count() == 1:
            _log.warning("stop requested before the first step: nothing saved")
            return True
        return False

    metrics_path = os.path.join(workdir, "metrics.jsonl")
    try:
        writer = (metrics_lib.MetricsWriter(metrics_path, tensorboard=True)
                  if jax.process_index() == 0 else None)
    except OSError as e:
        raise faults.write_failed(f"opening {metrics_path}", ckpt.latest_step(), e.strerror,
                            e.errno == errno.ENOSPC) from None
    profiler = metrics_lib.StepProfiler(
        metrics_lib.parse_profile_steps(cfg.train.profile_steps, cfg.train.steps),
        os.path.join(workdir, "profile", f"process{jax.process_index()}"))
    tokens_per_step = cfg.train.batch_size * cfg.data.seq_len
    lr_at = _lr(cfg, schedule_steps)
    limit = cfg.train.nonfinite_limit
    logged_variant = None  # the step variant whose static metrics were last logged
    last = {}
    with metrics_lib.Progress(cfg.train.steps, start) as bar, _finishing(ckpt, writer), \
            profiler:
        for i in range(start, cfg.train.steps):
            ckpt.poll()  # a failed background save stops the run here
            rows = train_ds.local_batch(i, jax.process_index(), jax.process_count())
            if i + 1 in hooks.get("JCOMP_TEST_NAN_STEP", ()):
                rows = _nan_batch(rows, model_cfg.vocab_size)
            batch = _global_batch(mesh, rows, cfg.train.batch_size)
            phase = schedule_lib.phase_at(phases, i)
            if stopped_before_any_step(i):
                break
            exe, report = compiled_step(phase, state, batch)
            if stopped_before_any_step(i):
                break
            profiler.step_starting(i + 1)
            t0 = time.perf_counter()
            state, m = exe(state, batch)
            # Waiting on every step also keeps emulated CPU devices from deadlocking.
            loss = float(m["loss"])
            dt = time.perf_counter() - t0
            profiler.step_done(i + 1)
            done = i + 1
            streak = 0 if bool(m["finite"]) else streak + 1
            if streak:
                msg = f"non-finite loss or gradient norm at step {done} (loss={loss})"
                if cfg.train.nonfinite == "stop":
                    raise NonFiniteError(msg)
                if streak >= limit:
                    raise NonFiniteError(
                        f"{msg}: {streak} updates in a row skipped (steps "
                        f"{done - streak + 1}-{done}), train.nonfinite_limit={limit}; "
                        f"the last checkpoint is step {ckpt.latest_step()}")
                _log.warning("%s: update skipped", msg)
            record = {"step": done, "loss": loss, "grad_norm": float(m["grad_norm"]),
                      "lr": float(lr_at(i)), "step_time_s": dt,
                      "tokens_per_s": tokens_per_step / dt,
                      "compressed": schedule_lib.is_compressed(phase),
                      "skipped_updates": int(state["skipped"])}
            if "ef_norm" in m:
                record["ef_norm"] = float(m["ef_norm"])
                if 0 < cfg.train.ef_reset_norm < record["ef_norm"]:
                    state = _reset_ef(state)
                    record["ef_reset"] = True
                    _log.warning("step %d: error-feedback residual norm %.4g exceeds "
                                 "train.ef_reset_norm=%g: residuals reset to zero",
                                 done, record["ef_norm"], cfg.train.ef_reset_norm)
            if logged_variant != phase:
                record.update(_static_metrics(report, state))
                record["compression"] = plans[phase].describe()
                if logged_variant is not None:
                    record["compression_changes"] = schedule_lib.changes(logged_variant, phase)
                    _log.info("step %d: compression schedule: %s", done,
                              record["compression_changes"])
                logged_variant = phase
            if val and (done % cfg.train.eval_every == 0 or done == cfg.train.steps):
                record["val_loss"] = val_loss(phase, state["params"])
            if writer and (done % cfg.train.log_every == 0 or "val_loss" in record
                           or done == cfg.train.steps or "wire_bytes_total" in record
                           or "ef_reset" in record):
                try:
                    faults.append_record(writer, record)
                except OSError as e:
                    raise faults.write_failed(f"writing {metrics_path} at step {done}",
                                        ckpt.latest_step(), e.strerror,
                                        e.errno == errno.ENOSPC) from None
            bar.update(done, loss=loss, tokens_per_s=record["tokens_per_s"])
            last = record
            time.sleep(hooks.get("JCOMP_TEST_STEP_SLEEP", 0))
            stopping = stop.agreed(done)
            saving = ckpt.maybe_save(
                done, state, {"data": train_ds.state(done), "step": done,
                              "fingerprint": fingerprint, "schedule_steps": schedule_steps,
                              "nonfinite_streak": streak},
                force=stopping or done == cfg.train.steps)
            if saving and hooks.get("JCOMP_TEST_KILL_DURING_SAVE") == done:
                _await_temporary(ckpt, done)
                os.kill(os.getpid(), signal.SIGKILL)
            if saving and hooks.get("JCOMP_TEST_SIGINT_DURING_SAVE") == done:
                _await_temporary(ckpt, done)
                os.kill(os.getpid(), signal.SIGINT)
                while not stop.requested:  # the first one handled, as a person's would be
                    time.sleep(0.01)
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(5)  # the handler ends the process
            if stopping:
                _log.warning("stop requested: saved step %d", done)
                break
    return last


@contextlib.contextmanager
def _quiet(logger, holder=None):
    """Holds back `logger`'s warnings: the error raised when no checkpoint is
    usable repeats them, and must stay the only line. `holder.skipped` lists the
    steps that failed to read when the restore itself succeeded."""
    old, old_hook = logger.level, sys.unraisablehook
    logger.setLevel(logging.ERROR)
    # A failed orbax read leaves coroutines whose errors surface only when they are
    # garbage-collected ("Exception ignored in ..."), and TensorStore callbacks that
    # print "Event loop is closed" tracebacks straight to file descriptor 2. The
    # restore already reports each unusable step with its path and reason, so that
    # output is kept in the debug log instead of on stderr.
    sys.unraisablehook = lambda u: _log.debug("after a failed restore: %s", u.exc_value)
    sys.stderr.flush()
    saved_fd = os.dup(2)
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        failed = True
        try:
            yield
            failed = bool(getattr(holder, "skipped", ()))
        finally:
            if failed:
                _drain(captured)
            gc.collect()
            sys.stderr.flush()
            os.dup2(saved_fd, 2)
            os.close(saved_fd)
            logger.setLevel(old)
            sys.unraisablehook = old_hook
            captured.seek(0)
            noise = captured.read().decode(errors="replace").strip()
            if noise:
                _log.debug("stderr during checkpoint restore:\n%s", noise)


def _drain(captured, quiet_s: float = 0.3, limit_s: float = 5.0):
    """Waits until reads abandoned by a failed restore stop reporting, i.e. until
    `captured` has not grown for `quiet_s` (at most `limit_s`)."""
    size, still, start = -1, 0.0, time.monotonic()
    while still < quiet_s and time.monotonic() - start < limit_s:
        time.sleep(0.05)
        now = os.fstat(captured.fileno()).st_size
        still = still + 0.05 if now == size else 0.0
        size = now


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


def _lr(cfg, total_steps):
    o = cfg.optim
    return optimizer.make_schedule(lr=o.lr, warmup_steps=o.warmup_steps,
                                   total_steps=total_steps, min_lr_ratio=o.min_lr_ratio)


def _static_metrics(report: wire.WireReport, state) -> dict:
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


def config_json(cfg) -> str:
    return json.dumps(cfg.to_dict(), sort_keys=True, default=str)
