"""Checkpoints of a sharded train state, written and read by orbax.

    ckpt = Checkpointer(workdir / "ckpt", save_every=500, keep=3)
    restored = ckpt.restore(abstract_like(state), expect_meta={"model": model_cfg})
    if restored is not None:
        state, meta, step = restored
    ...
    ckpt.maybe_save(step, state, {"step": step, "data": ds.state(step), "model": model_cfg})
    ckpt.close()

Each step directory holds three orbax items: `state` (the pytree of arrays,
written by every process for its own shards), `meta` (the caller's JSON dict)
and `checksums` (a 64-bit checksum per array, see `jcomp.train.run.checksums`).

What counts as a usable checkpoint. Orbax writes a step into a temporary
directory and renames it when done, so a save killed half-way never appears
under its step name; it also writes `commit_success.txt` last, and a step
directory without that marker is treated as incomplete. Damage after the
fact is caught at restore time: orbax's own b-tree nodes carry CRC-32C, but
the bulk array data does not, so a flipped bit there would restore silently;
the stored checksums catch that. `restore` walks the steps newest first,
reports every one it cannot use (path and reason, via `logging.warning` and
`Checkpointer.skipped`) and returns the first good one. It raises
`CheckpointError` when checkpoints exist but none is usable, and returns None
only when there are none at all. It never deletes or rewrites a step.

A checkpoint written for another model (different `expect_meta` fields, or
arrays of other shapes, dtypes or tree paths) raises `CheckpointError` at once
instead of falling back: older steps of the same run would not fit either.

A save that fails (disk full, I/O error) raises `SaveError` naming the step,
from `poll` (called once per training step, so the failure is reported while
that save is the newest, before any other save starts), `wait` or the next
`maybe_save`. What the failed save left, its temporary directory, is removed
then; `remove_unfinished` removes those left by a process that died mid-save.
After a SaveError orbax's worker threads may never end: a program that gets
one should leave with `os._exit`, as `train.py` does.

Just past 400 lines, on purpose: saving, the usable-checkpoint rules and the
restore walk are one contract (what a save leaves is what a restore accepts),
and the parts that stand alone already live apart (jcomp.train.run.checksums,
jcomp.train.run.quiet).
"""
from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import time
from typing import Any, Mapping, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from jcomp.train.run import quiet
from jcomp.train.run.checksums import path_name, tree_checksums

COMMIT_MARKER = "commit_success.txt"  # orbax writes it last, in both atomicity modes
TMP_MARK = getattr(ocp.utils, "TMP_DIR_SUFFIX", ".orbax-checkpoint-tmp")  # in-progress saves
_STATE, _META, _SUMS = "state", "meta", "checksums"
_log = logging.getLogger(__name__)


class CheckpointError(ValueError):
    """A checkpoint exists but cannot be used; `failures` lists (path, reason)."""

    def __init__(self, message: str, failures=()):
        super().__init__(message)
        self.failures = list(failures)


class SaveError(OSError):
    """Saving step `step` failed; `reason` is the storage error's own first line."""

    def __init__(self, step, directory, reason: str, disk_full: bool, last_complete=None):
        super().__init__(f"saving step {step} to {directory} failed: {reason}")
        self.step, self.directory, self.reason, self.disk_full = step, directory, reason, disk_full
        self.last_complete = last_complete  # the newest step still on disk, committed


def _is_disk_full(e: BaseException) -> bool:
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if getattr(e, "errno", None) == errno.ENOSPC or "No space left on device" in str(e):
            return True
        e = e.__cause__ or e.__context__
    return False


class Restored(NamedTuple):
    """What `Checkpointer.restore` returns: unpacks as (state, meta, step)."""

    state: Any
    meta: dict
    step: int


# ---------------------------------------------------------------- checks


def abstract_like(state):
    """ShapeDtypeStructs with the shardings of `state`'s arrays: what `restore` takes."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)


def _flat_fields(d, prefix: str) -> dict:
    """{'model.d_model': 64, ...} from nested dicts."""
    if not isinstance(d, Mapping):
        return {prefix: d}
    out = {}
    for k, v in d.items():
        out.update(_flat_fields(v, f"{prefix}.{k}"))
    return out


def _meta_mismatches(saved: dict, expect: Mapping) -> list[str]:
    """One phrase per field of `expect` whose saved value differs."""
    # A JSON round trip makes tuples lists and keys strings, as they were when saved.
    expect = json.loads(json.dumps(expect))
    problems = []
    for top, want in expect.items():
        have = _flat_fields(saved[top], top) if top in saved else {}
        want = _flat_fields(want, top)
        for name in sorted(set(have) | set(want)):
            if name not in have:
                problems.append(f"it has no {name}, this run has {name}={want[name]!r}")
            elif name not in want:
                problems.append(f"it was written for {name}={have[name]!r}, this run has no {name}")
            elif have[name] != want[name]:
                problems.append(
                    f"it was written for {name}={have[name]!r}, this run has {name}={want[name]!r}"
                )
    return problems


def _array_mismatches(stored_tree, abstract) -> list[str]:
    """One phrase per array whose path, shape or dtype differs between the stored tree
    (orbax metadata) and `abstract`."""
    has_shape = lambda x: hasattr(x, "shape") and hasattr(x, "dtype")
    stored = jax.tree_util.tree_flatten_with_path(stored_tree, is_leaf=has_shape)[0]
    have = {path_name(p): m for p, m in stored}
    want = {path_name(p): a for p, a in jax.tree_util.tree_flatten_with_path(abstract)[0]}
    problems = [f"it lacks array {n!r}" for n in sorted(set(want) - set(have))]
    problems += [f"it has array {n!r}, this run's state has not" for n in sorted(set(have) - set(want))]
    for n in sorted(set(have) & set(want)):
        h, w = have[n], want[n]
        if tuple(h.shape) != tuple(w.shape) or jnp.dtype(h.dtype) != jnp.dtype(w.dtype):
            problems.append(
                f"its array {n!r} is {jnp.dtype(h.dtype).name}{list(h.shape)}, "
                f"this run has {jnp.dtype(w.dtype).name}{list(w.shape)}"
            )
    return problems


def _check_abstract(abstract):
    for path, leaf in jax.tree_util.tree_flatten_with_path(abstract)[0]:
        if not isinstance(leaf, jax.ShapeDtypeStruct) or leaf.sharding is None:
            raise TypeError(
                f"abstract_state leaf {path_name(path)!r} must be a jax.ShapeDtypeStruct "
                f"with a sharding (see abstract_like); got {leaf!r}"
            )


def _check_count(name: str, value, minimum: int):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int; got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}; got {value}")


def _json_meta(meta) -> dict:
    if not isinstance(meta, Mapping):
        raise TypeError(f"meta must be a dict; got {type(meta).__name__}")
    try:
        return json.loads(json.dumps(dict(meta), allow_nan=False))
    except (TypeError, ValueError) as e:
        raise type(e)(f"meta must be JSON-serialisable with finite numbers: {e}") from e


def _reason(e: BaseException) -> str:
    # orbax wraps the storage error (e.g. "OUT_OF_RANGE ... byte range is not valid")
    # in generic exceptions whose text is a dump of the TensorStore spec; the
    # innermost cause names the file and what is wrong with it.
    seen = {id(e)}
    while (inner := e.__cause__ or e.__context__) is not None and id(inner) not in seen:
        seen.add(id(inner))
        e = inner
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {first[:300]}"


# ---------------------------------------------------------------- the manager


class Checkpointer:
    """Saves every `save_every` steps into `directory`, keeping the newest `keep`."""

    def __init__(self, directory, *, save_every: int, keep: int, async_save: bool = True):
        if not isinstance(directory, (str, os.PathLike)):
            raise TypeError(f"directory must be a str or path; got {type(directory).__name__}")
        _check_count("save_every", save_every, 1)
        _check_count("keep", keep, 1)
        self.directory = epath.Path(directory).absolute()
        self.save_every = int(save_every)
        self.skipped: list[tuple[str, str]] = []  # (path, reason), from the last restore
        options = ocp.CheckpointManagerOptions(
            create=True,
            preservation_policy=ocp.checkpoint_managers.LatestN(int(keep)),
            enable_async_checkpointing=bool(async_save),
        )
        self._mngr = ocp.CheckpointManager(self.directory, options=options)
        self._in_flight: Optional[int] = None  # the step whose save may still be running
        self._last_started: Optional[int] = None  # the newest step whose save began
        quiet.demote_failed_save_errors()

    def step_path(self, step: int) -> epath.Path:
        return self.directory / str(step)

    def steps(self) -> list[int]:
        """Steps present on disk, committed or not (temporary directories excluded).
        Waits for a save in flight first, so that it is listed."""
        self.wait()
        self._mngr.reload()
        return sorted(self._mngr.all_steps())

    def latest_step(self) -> Optional[int]:
        """The newest step whose save completed (restore may still find it damaged)."""
        done = [s for s in self.steps() if (self.step_path(s) / COMMIT_MARKER).exists()]
        return max(done) if done else None

    def maybe_save(self, step: int, state, meta: Mapping, force: bool = False) -> bool:
        """Starts saving `state` and `meta` when step % save_every == 0 or `force`.

        Returns whether a save started. A step that already has a directory is left
        untouched (a warning says so): a run resumed from an older step reaches it again.
        """
        _check_count("step", step, 0)
        if not (force or step % self.save_every == 0):
            return False
        meta = _json_meta(meta)
        # Orbax would wait for the previous save inside save() and raise its error
        # as this one's; waiting here names the step that failed.
        self.wait()
        # all_steps() also lists a save still in flight, before its directory appears.
        if step in self._mngr.all_steps() or self.step_path(step).exists():
            _log.warning("not saving step %d: %s already exists", step, self.step_path(step))
            return False
        args = ocp.args.Composite(
            **{
                _STATE: ocp.args.StandardSave(state),
                _META: ocp.args.JsonSave(meta),
                _SUMS: ocp.args.JsonSave(tree_checksums(state)),
            }
        )
        try:
            started = bool(self._mngr.save(int(step), args=args, force=True))
        except Exception as e:  # storage errors surface as many exception types
            self._failed(step, e)
        if started:
            self._in_flight = self._last_started = int(step)
        return started

    def _failed(self, step, e: BaseException):
        """Removes what the failed save of `step` wrote and raises SaveError."""
        names = os.listdir(self.directory) if os.path.isdir(self.directory) else []
        committed = lambda n: os.path.exists(os.path.join(self.directory, n, COMMIT_MARKER))
        if jax.process_index() == 0:
            for name in names:
                if name.startswith(f"{step}{TMP_MARK}") or (name == str(step) and not committed(name)):
                    _remove_tree(os.path.join(self.directory, name))
        done = [int(n) for n in names if n.isdigit() and committed(n)]
        raise SaveError(step, self.directory, _reason(e), _is_disk_full(e),
                        max(done) if done else None) from None

    def poll(self):
        """Returns at once; raises SaveError if the save in flight has failed."""
        if self._in_flight is not None and not self._mngr.is_saving_in_progress():
            self.wait()

    def remove_unfinished(self) -> list[str]:
        """Deletes the temporary directories of saves that never finished (a
        process killed mid-save leaves them; nothing reads or finishes them).
        Call it before this run's first save, holding the workdir, on one process."""
        removed = []
        for name in sorted(os.listdir(self.directory)):
            if TMP_MARK in name:
                shutil.rmtree(os.path.join(self.directory, name))
                removed.append(os.path.join(self.directory, name))
        return removed

    def set_aside(self, step: int) -> epath.Path:
        """Moves step `step`'s directory, found unusable, out of the way into
        `<directory>_unusable/`, so that the run saves that step afresh when it
        reaches it again. Nothing is deleted; returns the new path. Every process
        calls it; the first moves the files, the others wait for the move."""
        _check_count("step", step, 0)
        source = self.step_path(step)
        target_dir = self.directory.parent / f"{self.directory.name}_unusable"
        target, n = target_dir / str(step), 0
        while target.exists():
            n += 1
            target = target_dir / f"{step}-{n}"
        if jax.process_index() == 0:
            if not source.exists():
                raise ValueError(f"step {step}: no directory {source} to set aside")
            target_dir.mkdir(parents=True, exist_ok=True)
            os.rename(os.fspath(source), os.fspath(target))
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils
            multihost_utils.sync_global_devices(f"jcomp_set_aside_{step}")
        self._mngr.reload()
        return target

    def wait(self):
        """Blocks until the save in flight, if any, is on disk; SaveError if it failed."""
        step, self._in_flight = self._in_flight, None
        try:
            self._mngr.wait_until_finished()
        except Exception as e:
            self._failed(step, e)

    def close(self):
        """Waits for the save in flight and closes the manager. A failure that
        orbax reports only here (its background finalize, e.g. on a file system
        turned read-only) is a SaveError of the last save started, as in wait."""
        self.wait()
        try:
            self._mngr.close()
        except Exception as e:
            self._failed(self._last_started, e)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def restore(self, abstract_state, step: Optional[int] = None, *,
                expect_meta: Optional[Mapping] = None, check_meta=None):
        """Restores (state, meta, step) into `abstract_state`'s shapes and shardings.

        abstract_state: pytree of jax.ShapeDtypeStruct with shardings (any mesh).
        step: a given step, or None for the newest usable one.
        expect_meta: fields the saved meta must equal, e.g. {"model": {...}}.
        check_meta: optional callable, saved meta -> list of phrases saying why it
          does not fit this run (like expect_meta's), checked before any array is read.
        Returns None when the directory holds no checkpoint at all.
        """
        _check_abstract(abstract_state)
        if expect_meta is not None and not isinstance(expect_meta, Mapping):
            raise TypeError(f"expect_meta must be a dict or None; got {type(expect_meta).__name__}")
        self.skipped = []
        quiet.demote_orphaned_read_errors()
        present = self.steps()
        if step is not None:
            _check_count("step", step, 0)
            if step not in present:
                raise CheckpointError(
                    f"no checkpoint for step {step} in {self.directory}; steps present: {present}"
                )
            present = [step]
        if not present:
            return None
        for s in reversed(present):
            try:
                return self._restore_step(s, abstract_state, expect_meta or {}, check_meta)
            except _Unusable as e:
                self.skipped.append((str(self.step_path(s)), e.reason))
                _log.warning("checkpoint %s cannot be used: %s", self.step_path(s), e.reason)
        listing = "; ".join(f"{p}: {r}" for p, r in self.skipped)
        raise CheckpointError(f"no usable checkpoint in {self.directory}: {listing}", self.skipped)

    def _restore_step(self, step: int, abstract, expect_meta: Mapping, check_meta=None) -> Restored:
        """Raises _Unusable for a damaged step, CheckpointError for an incompatible one."""
        path = self.step_path(step)
        if not (path / COMMIT_MARKER).exists():
            raise _Unusable(f"incomplete save: no {COMMIT_MARKER}")
        small = ocp.args.Composite(**{_META: ocp.args.JsonRestore(), _SUMS: ocp.args.JsonRestore()})
        try:
            jsons = self._mngr.restore(step, args=small)
            meta, sums = jsons[_META], jsons[_SUMS]
            stored_tree = ocp.StandardCheckpointHandler().metadata(path / _STATE).tree
        except Exception as e:  # damaged files surface as many exception types
            raise _Unusable(_reason(e)) from e
        if not isinstance(meta, dict) or not isinstance(sums, dict):
            raise _Unusable("meta or checksums is not a JSON object")
        problems = _meta_mismatches(meta, expect_meta) + _array_mismatches(stored_tree, abstract)
        problems += list(check_meta(meta)) if check_meta is not None else []
        if problems:
            raise CheckpointError(
                f"checkpoint at {path} does not fit this run: " + "; ".join(problems)
            )
        try:
            full = ocp.args.Composite(**{_STATE: ocp.args.StandardRestore(abstract)})
            state = self._mngr.restore(step, args=full)[_STATE]
        except Exception as e:
            raise _Unusable(_reason(e)) from e
        got = tree_checksums(state)
        bad = sorted(n for n in got if sums.get(n) != got[n])
        if bad:
            raise _Unusable(f"checksum mismatch in {bad}")
        return Restored(state, meta, step)


def _remove_tree(path: str, limit_s: float = 2.0):
    """rmtree, repeated for a while: writes of the failed save still in flight
    may add files while it runs. What outlives `limit_s` is a temporary
    directory, which restore ignores and `remove_unfinished` deletes next time."""
    start = time.monotonic()
    while os.path.lexists(path) and time.monotonic() - start < limit_s:
        shutil.rmtree(path, ignore_errors=True)
        if os.path.lexists(path):
            time.sleep(0.05)


class _Unusable(Exception):
    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason
