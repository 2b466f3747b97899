"""Where a run starts: the newest usable checkpoint in the workdir, or step 0.

    ckpt = open_checkpoints(run, workdir)   # holding the workdir lock
    start = restore_or_init(run, ckpt, mesh, tx, shapes, init_params, train_ds)
    state, first_step = start.state, start.step
    ckpt.maybe_save(n, state, checkpoint_meta(run, train_ds, n, start.schedule_steps, streak))

A checkpoint is restored only if it was written for this run: the same
`RunSpec.fingerprint` (model, mesh, ZeRO stage, policy, error feedback) and
the same data position (seed, sequence length, global batch, training data),
and the same split of the data axis into hops (mesh.dcn_data), and the same
outer loop (outer.*).
Otherwise the run is refused with one `UsageError` listing every difference,
before anything in the workdir is moved. Damaged steps are reported and set
aside to `checkpoints_unusable/`; the learning-rate schedule and the count of
non-finite steps in a row continue from the checkpoint's.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import os
from typing import Any

import jax

from jcomp.gpt import autoencoder, step

from jcomp.train.run import checkpoint, quiet
from jcomp.train.outer import islands as outer
from jcomp.train.settings import outer as outerconfig
from jcomp.gpt import model as gpt
from jcomp.train.run.faults import UsageError

_log = logging.getLogger(__name__)

# What the data position saved in a checkpoint must match, and the config field
# that decides each (`data.Dataset.state`).
_DATA_FIELDS = {"seed": "seed", "seq_len": "data.seq_len", "global_batch": "train.batch_size"}


@dataclasses.dataclass
class Start:
    """The state the loop starts from, at `step` (0 for a fresh run)."""

    state: Any
    step: int
    schedule_steps: int  # the length the learning-rate schedule was laid out for
    streak: int          # non-finite steps in a row up to `step`
    tx: Any              # the optimizer, its schedule `schedule_steps` long
    # With outer.delay: the fragment whose sync start, due after `step`, overlaps
    # the next step (`jcomp.train.outer.delay.DelayedSyncs.run_carried`); None: none.
    outer_pending: int | None = None


def init_params(run):
    """-> a function making the initial parameters of `run` (seed `run.seed`)."""
    return functools.partial(gpt.init_params, run.model, jax.random.key(run.seed),
                             coders=autoencoder.coders(run.policy))


def data_mismatches(train_ds):
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


def dcn_mismatch(run):
    """check_meta for `Checkpointer.restore`: the split of the data axis into hops
    (mesh.dcn_data; a checkpoint that records none had 1) must not change, even
    where the state's arrays would fit: residuals and codecs are per hop."""
    def check(meta):
        saved = meta.get("mesh_dcn_data", 1) if isinstance(meta, dict) else 1
        if saved != run.dcn_data:
            return [f"it was written for mesh.dcn_data={saved}, this run has "
                    f"mesh.dcn_data={run.dcn_data} (a resume cannot change the split of the "
                    "data axis into hops)"]
        return []
    return check


def outer_mismatch(run):
    """check_meta for `Checkpointer.restore`: the outer loop's settings (outer.*; a
    checkpoint that records none had outer.every=0) must not change: the islands,
    the fragments and the outer optimizer's state are laid out by them."""
    mine = run.outer.record() if run.outer else {"every": 0}

    def check(meta):
        saved = meta.get("outer", {"every": 0}) if isinstance(meta, dict) else {"every": 0}
        # Keys either side records: a run with outer.delay > 0 records delay and
        # mix, one with delay 0 neither, and a pending merge must not be lost.
        names = (["every"] if 0 in (saved.get("every"), mine["every"]) else
                 list(mine) + [k for k in saved if k not in mine])
        was, now = ({k: d.get(k, outerconfig.DEFAULTS.get(k)) for k in names}
                    for d in (saved, mine))
        out = [f"outer.{k}={was[k]!r}, this run has outer.{k}={now[k]!r}"
               for k in names if was[k] != now[k]]
        return [f"it was written for {', '.join(out)} (a resume cannot change the outer "
                "loop's settings)"] if out else []
    return check


def _both(*checks):
    return lambda meta: [p for c in checks for p in c(meta)]


def checkpoint_meta(run, train_ds, step_no: int, schedule_steps: int, streak: int,
                    auto: dict | None = None, outer_pending: int | None = None) -> dict:
    """What a checkpoint of step `step_no` records beside the state; `auto`, the
    decision of compression.auto (jcomp.train.auto.decide), is what a resume keeps;
    `outer_pending`, a sync start due after `step_no` not yet run (it overlaps
    the next step), is what a resume runs first."""
    return {"data": train_ds.state(step_no), "step": step_no, "fingerprint": run.fingerprint(),
            "schedule_steps": schedule_steps, "nonfinite_streak": streak,
            "optim": dataclasses.asdict(run.optim), "mesh_dcn_data": int(run.dcn_data),
            **({"outer": run.outer.record()} if run.outer else {}),
            **({"auto": auto} if auto else {}),
            **({"outer_pending": int(outer_pending)} if outer_pending is not None else {})}


def optim_changes(run, meta) -> list[str]:
    """The optim.* fields this run sets otherwise than the checkpoint's run did,
    as "optim.lr=0.001 (checkpoint: 0.003)"; a resume may change them."""
    saved = meta.get("optim") if isinstance(meta, dict) else None
    if not isinstance(saved, dict):
        return []
    mine = dataclasses.asdict(run.optim)
    return [f"optim.{k}={mine[k]!r} (checkpoint: {saved[k]!r})" for k in mine
            if k in saved and saved[k] != mine[k]]


def open_checkpoints(run, workdir) -> checkpoint.Checkpointer:
    """WORKDIR/checkpoints, cleared of saves a stopped run left unfinished.
    UsageError if it cannot be created or holds a step past train.steps."""
    ckpt_dir = os.path.join(os.path.abspath(workdir), "checkpoints")
    try:
        os.makedirs(ckpt_dir, exist_ok=True)
        ckpt = checkpoint.Checkpointer(ckpt_dir, save_every=run.checkpoint_every,
                                       keep=run.checkpoint_keep)
    except OSError as e:
        raise UsageError(f"checkpoint directory {ckpt_dir} cannot be created: "
                         f"{e.strerror or e}") from None
    if jax.process_index() == 0:
        for path in ckpt.remove_unfinished():
            _log.warning("removed %s: a save that never finished (the run writing it was "
                         "stopped mid-save)", path)
    newest = ckpt.latest_step()
    if newest is not None and run.train.steps < newest:
        ckpt.close()
        raise UsageError(f"train.steps={run.train.steps} is below step {newest} of the newest "
                         f"checkpoint in {ckpt_dir}; allowed: >= {newest} (or another --workdir)")
    return ckpt


def abstract_state(run, shapes, mesh, tx):
    """The train state's arrays as ShapeDtypeStructs with shardings (restore target)."""
    if run.outer:
        return outer.abstract_state(run, shapes, mesh, tx)
    return step.abstract_state(shapes, mesh, tx, run.zero)


def init_state(run, params, mesh, tx, shapes):
    """A fresh train state from the initial `params` (every island's copy and the
    outer state with an outer loop)."""
    state = step.init_state(params, mesh, tx, run.zero)
    return outer.lift(state, run, mesh, shapes, tx) if run.outer else state


def restore_or_init(run, ckpt, mesh, tx, shapes, make_params, train_ds) -> Start:
    """The newest usable checkpoint of `ckpt` restored onto `mesh` (and `train_ds`
    moved to its position), or `make_params()` laid out as a fresh state."""
    restored = None
    try:
        with quiet.restoring_quietly(logging.getLogger(checkpoint.__name__), ckpt):
            restored = ckpt.restore(abstract_state(run, shapes, mesh, tx),
                                    expect_meta={"fingerprint": run.fingerprint()},
                                    check_meta=_both(outer_mismatch(run), dcn_mismatch(run),
                                                     data_mismatches(train_ds)))
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
    if restored is None:
        return Start(init_state(run, make_params(), mesh, tx, shapes), 0, run.train.steps, 0, tx)
    # The learning-rate schedule is the first run's: a resumed run keeps its length
    # whatever train.steps says now (steps past it run at the final rate).
    state, meta, start = restored
    train_ds.restore(meta["data"])
    schedule_steps = int(meta.get("schedule_steps", run.train.steps))
    streak = int(meta.get("nonfinite_streak", 0))
    _log.info("resumed from %s at step %d", ckpt.step_path(start), start)
    changed = optim_changes(run, meta)
    if changed:
        _log.warning("resuming with optimizer settings that differ from the checkpoint's: %s",
                     ", ".join(changed))
    if schedule_steps != run.train.steps:
        _log.warning("train.steps=%d differs from the %d steps the learning-rate schedule "
                     "was laid out for; it keeps that length (constant after step %d)",
                     run.train.steps, schedule_steps, schedule_steps)
        tx = run.optim.tx(schedule_steps)
    pending = meta.get("outer_pending")
    return Start(state, start, schedule_steps, streak, tx,
                 None if pending is None else int(pending))
