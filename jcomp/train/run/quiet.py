"""What reaches stderr when orbax fails: the failure once, in our words, and
none of the copies orbax, asyncio and TensorStore print after it.

    with restoring_quietly(logging.getLogger("jcomp.train.run.checkpoint"), ckpt): ...
    demote_orphaned_read_errors()   # asyncio's "Task exception was never retrieved"
    demote_failed_save_errors()     # orbax's per-thread tracebacks of a failed save
    exit_with_line(line, code)      # train.py's one line, then os._exit

What is held back goes to this module's debug log, not away. Every filter
here matches only the noise of a failure already reported (by `CheckpointError`,
`Checkpointer.skipped` or `SaveError`); anything else passes through. The
module imports no JAX, so `train.py` can load it before JAX starts.
"""
from __future__ import annotations

import contextlib
import gc
import logging
import os
import sys
import tempfile
import time

_log = logging.getLogger(__name__)


# ---------------------------------------------------------------- restores

@contextlib.contextmanager
def restoring_quietly(logger, holder=None):
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


class _OrphanedReadFilter(logging.Filter):
    """After one array of a step fails to read, orbax's sibling read tasks are
    dropped unawaited and asyncio logs each as "Task exception was never
    retrieved" at ERROR, long after the restore reported the step unusable with its
    path and reason. Those records go to this module's debug log instead."""

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        if "never retrieved" in text and any(w in text for w in ("orbax", "OCDBT", "TensorStore")):
            _log.debug("orbax read task after a failed restore: %s", text.splitlines()[0])
            return False
        return True


def demote_orphaned_read_errors():
    asyncio_log = logging.getLogger("asyncio")
    if not any(isinstance(f, _OrphanedReadFilter) for f in asyncio_log.filters):
        asyncio_log.addFilter(_OrphanedReadFilter())


# ------------------------------------------------------------------- saves

class _FailedSaveFilter(logging.Filter):
    """A failed background save makes orbax log the same storage error, with a
    traceback, from each of its worker threads and again when it is waited for.
    The error itself is raised by `wait` / `poll` as one SaveError; the copies
    go to this module's debug log."""

    def filter(self, record: logging.LogRecord) -> bool:
        # Only errors logged with their exception: what wait() raises again.
        if record.levelno >= logging.ERROR and record.exc_info \
                and "/orbax/" in (record.pathname or ""):
            _log.debug("orbax during a failed save: %s", record.getMessage().splitlines()[0])
            return False
        return True


def _is_closed_loop_callback(exc, tb) -> bool:
    """Whether `exc` is asyncio refusing a callback because its event loop is
    closed: raised by `_check_closed` called from `call_soon_threadsafe`."""
    if not (isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed"):
        return False
    names = []
    while tb is not None:
        names.append(tb.tb_frame.f_code.co_name)
        tb = tb.tb_next
    return names[-2:] == ["call_soon_threadsafe", "_check_closed"]


def unraisable_filter(previous):
    """A sys.unraisablehook that drops TensorStore's reports of writes finishing
    after orbax closed a failed save's event loop (one traceback apiece, ending
    in "Event loop is closed"; the failure itself is raised once as SaveError)
    and passes everything else to `previous`."""
    def hook(unraisable):
        if _is_closed_loop_callback(unraisable.exc_value, unraisable.exc_traceback):
            _log.debug("TensorStore write after a failed save: %s", unraisable.exc_value)
            return
        previous(unraisable)
    hook.jcomp_save_filter = True
    return hook


def demote_failed_save_errors():
    absl_log = logging.getLogger("absl")  # orbax logs through absl.logging
    if not any(isinstance(f, _FailedSaveFilter) for f in absl_log.filters):
        absl_log.addFilter(_FailedSaveFilter())
    if not getattr(sys.unraisablehook, "jcomp_save_filter", False):
        sys.unraisablehook = unraisable_filter(sys.unraisablehook)


# -------------------------------------------------------------------- exit

_terminal_fd = 2  # where the last word goes; jcomp.train.run.cluster moves fd 2 to a log


def set_terminal_fd(fd: int):
    global _terminal_fd
    _terminal_fd = fd


def exit_with_line(line: str, code: int):
    """Writes `line` (one line) on stderr as the process's last word and exits
    with `code` at once."""
    sys.stdout.flush()
    sys.stderr.flush()
    # Background threads (orbax's asyncio readers after a failed restore, its
    # writers after a failed save) may still be writing tracebacks, or never end,
    # so descriptors 1 and 2 go to /dev/null before the line is written to a copy
    # of stderr, and the interpreter exits without the teardown that would wait
    # for those threads.
    err = os.dup(_terminal_fd)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    os.write(err, line.encode())
    os._exit(code)
