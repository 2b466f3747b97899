"""What the trainer does about a hostile world: a workdir it cannot use or that
another trainer is using, signals at any moment, and writes that fail mid-run.

    check_process_flags(coordinator, num_processes, process_id, distributed)
    check_workdir(workdir)          # UsageError naming the path; reads only
    lock = lock_workdir(workdir)    # UsageError if another trainer holds it
    stop = StopFlag().install()     # SIGTERM / first Ctrl-C: stop after the step

Everything here is checked before the run writes, moves or compiles anything.
The module imports no JAX, so `train.py` can install its signal handlers and
refuse bad flags before the seconds JAX takes to import.

The workdir lock is `fcntl.flock` on `WORKDIR/.lock`. The kernel drops it when
the holder's last descriptor closes, so it dies with the trainer however the
trainer ends, kill -9 included; the file itself means nothing and stays.
"""
from __future__ import annotations

import errno
import fcntl
import os
import signal

LOCK_NAME = ".lock"
SECOND_INTERRUPT_EXIT = 130  # the shell's code for a process ended by SIGINT


class UsageError(ValueError):
    """A configuration or input the user must fix; the message names the field."""


class WriteError(OSError):
    """A write the run depends on failed mid-run (disk full, I/O error); the
    message says which file, which step and which checkpoint is safe."""


# ------------------------------------------------------------ process flags

def check_process_flags(coordinator, num_processes, process_id, distributed) -> None:
    """UsageError unless the flags describe one process, a cluster JAX detects
    (`--distributed`), or a complete explicit cluster."""
    explicit = {"--coordinator_address": coordinator, "--num_processes": num_processes,
                "--process_id": process_id}
    given = [name for name, v in explicit.items() if v not in (None, "")]
    if distributed or not given:  # JAX detects the cluster, taking what is given
        return
    missing = [name for name in explicit if name not in given]
    if missing:
        raise UsageError(f"{', '.join(given)} given without {', '.join(missing)}: a multi-process "
                         "run needs all three (or --distributed on SLURM / Open MPI)")
    if num_processes < 1:
        raise UsageError(f"--num_processes={num_processes}; allowed: >= 1")
    if not 0 <= process_id < num_processes:
        raise UsageError(f"--process_id={process_id} is outside [0, {num_processes}) "
                         f"for --num_processes={num_processes}")


# ------------------------------------------------------------------ workdir

def _kind(path: str) -> str:
    if os.path.islink(path) and not os.path.exists(path):
        return "a broken symlink"
    return "a directory" if os.path.isdir(path) else "a file"


def _read_only(path: str) -> bool:
    return bool(os.statvfs(path).f_flag & os.ST_RDONLY)


def check_workdir(workdir: str, flag: str = "--workdir") -> None:
    """UsageError naming the path if the run could not write what it writes
    there: WORKDIR itself, its checkpoints/ and metrics.jsonl. Writes nothing."""
    path = os.path.abspath(workdir)
    where = f"{flag}={workdir}"
    if os.path.lexists(path):
        if not os.path.isdir(path):
            raise UsageError(f"{where} is {_kind(path)}; it must be a directory "
                             "(created when missing)")
        for name, want_dir in (("checkpoints", True), ("checkpoints_unusable", True),
                               ("metrics.jsonl", False), (LOCK_NAME, False)):
            p = os.path.join(path, name)
            if os.path.lexists(p) and (not os.path.exists(p) or os.path.isdir(p) != want_dir):
                raise UsageError(f"{where}: {p} is {_kind(p)}; the run needs "
                                 f"{'a directory' if want_dir else 'a file'} there: "
                                 "move it away or pass another workdir")
        existing = [p for p in (path, os.path.join(path, "checkpoints")) if os.path.isdir(p)]
    else:
        parent = os.path.dirname(path)
        while not os.path.lexists(parent):
            parent = os.path.dirname(parent)
        if not os.path.isdir(parent):
            raise UsageError(f"{where} cannot be created: {parent} is {_kind(parent)}")
        existing = [parent]
    for p in existing:
        if _read_only(p):
            raise UsageError(f"{where}: {p} is on a read-only file system; "
                             "pass a writable workdir")
        if not os.access(p, os.W_OK | os.X_OK):
            raise UsageError(f"{where}: {p} is not writable by this user")


class WorkdirLock:
    """An exclusive `flock` on WORKDIR/.lock, held until `release` or exit.
    Creates WORKDIR when it is missing (the first thing the run writes)."""

    def __init__(self, workdir: str, flag: str = "--workdir"):
        self.workdir = workdir
        self.path = os.path.join(os.path.abspath(workdir), LOCK_NAME)
        self._flag = flag
        self._fd = None

    def acquire(self) -> "WorkdirLock":
        where = f"{self._flag}={self.workdir}"
        try:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as e:
            raise UsageError(f"{where}: cannot create {self.path}: {e.strerror}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise UsageError(f"{where} is in use by another trainer (it holds a lock on "
                                 f"{self.path}); wait for it to end or pass another "
                                 "workdir") from None
            raise UsageError(f"{where}: cannot lock {self.path}: {e.strerror}") from None
        self._fd = fd
        return self

    def release(self):
        if self._fd is not None:
            os.close(self._fd)  # closing the last descriptor drops the flock
            self._fd = None

    def __enter__(self):
        return self.acquire()

    def __exit__(self, *exc):
        self.release()


def remove_empty_workdir(workdir: str):
    """Removes a workdir this run created and left without any step: its lock file,
    an empty checkpoints/ and then the directory, each only if nothing else is
    in it (a file someone put there stays, and so does the directory)."""
    for path, remove in ((os.path.join(workdir, LOCK_NAME), os.remove),
                         (os.path.join(workdir, "checkpoints"), os.rmdir),
                         (workdir, os.rmdir)):
        try:
            remove(path)
        except OSError:
            pass


def lock_workdir(workdir: str):
    """Process 0 takes the workdir lock (a shared workdir is locked once); every
    process learns whether it got it, so all stop together when another trainer
    holds it. -> the lock on process 0, None elsewhere."""
    import jax
    lock, err = None, ""
    if jax.process_index() == 0:
        try:
            lock = WorkdirLock(workdir).acquire()
        except UsageError as e:
            err = str(e)
    if jax.process_count() > 1:
        import numpy as np
        from jax.experimental import multihost_utils
        if not int(multihost_utils.broadcast_one_to_all(np.int32(0 if err else 1))):
            err = err or f"--workdir={workdir}: process 0 could not lock it (see its error)"
    if err:
        if lock is not None:
            lock.release()
        raise UsageError(err)
    return lock


# ------------------------------------------------------------------ signals

class StopFlag:
    """SIGTERM, SIGHUP (a closed terminal or ssh session) or a first SIGINT asks
    the loop to save and stop after the step in flight (or, before the first
    step, to stop without writing). A SIGINT
    after that ends the process at once: one line on stderr, exit 130, the save
    in flight abandoned (the next run removes what it left)."""

    def __init__(self):
        self.requested = False
        self._old = {}
        self._stderr = None

    def install(self) -> "StopFlag":
        # A copy of stderr as it is now: the restore of a checkpoint captures
        # descriptor 2 for a while, and the line must not land in the capture.
        self._stderr = os.dup(2)
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
            self._old[sig] = signal.signal(sig, self._handle)
        return self

    def uninstall(self):
        for sig, handler in self._old.items():
            signal.signal(sig, handler)
        self._old = {}
        if self._stderr is not None:
            os.close(self._stderr)
            self._stderr = None

    def __enter__(self):
        return self.install()

    def __exit__(self, *exc):
        self.uninstall()

    def _handle(self, signum, frame):
        if self.requested and signum == signal.SIGINT:
            # os.write and os._exit: the main thread may be inside a print or a
            # logging call, where a buffered write would raise "reentrant call".
            # The newline first ends a progress bar's unfinished line.
            os.write(self._stderr, b"\ntrain.py: interrupted twice: stopped at once without "
                                   b"saving; rerunning resumes from the last complete checkpoint\n")
            os._exit(SECOND_INTERRUPT_EXIT)
        self.requested = True

    def agreed(self, step_no: int) -> bool:
        """All processes stop at the same step: JAX's preemption sync point on
        clusters, this process's own flag otherwise."""
        import jax
        if jax.process_count() > 1:
            try:
                from jax.experimental import multihost_utils
                return bool(multihost_utils.reached_preemption_sync_point(step_no)) or \
                    self.requested
            except Exception:  # no preemption service: fall back to the local flag
                return self.requested
        return self.requested


# ------------------------------------------------------------ write failures

def write_failed(what: str, last_complete, reason, disk_full: bool) -> WriteError:
    """WriteError saying what failed and which checkpoint the next run resumes from."""
    safe = (f"the last complete checkpoint is step {last_complete}; rerunning resumes from it"
            if last_complete is not None else
            "no checkpoint is complete; rerunning starts from step 0")
    cause = "No space left on device" if disk_full else reason
    return WriteError(f"{'disk full: ' if disk_full else ''}{what} failed ({cause}); {safe}")


def append_record(writer, record, nested: bool = False):
    """`writer.write(record, nested)` (a metrics.MetricsWriter); if it fails, the
    file is cut back to whole lines and the OSError re-raised."""
    writer.open()
    size = os.path.getsize(writer.path)
    try:
        writer.write(record, nested)
    except OSError:
        try:
            writer.close()  # its buffer may hold part of the line: drop it
        except OSError:
            pass
        try:
            os.truncate(writer.path, size)
        except OSError:
            pass
        raise
