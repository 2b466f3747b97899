"""Tests for jcomp.train.run.quiet: what reaches stderr when orbax fails. Warnings
and file-descriptor-2 output of a restore are held back to this module's debug
log, the log filters drop only the noise of a failure already reported, and
exit_with_line leaves one line and the exit code."""
import logging
import os
import subprocess
import sys
import time

import pytest

from jcomp.train.run import quiet

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records = []

    def emit(self, record):
        self.records.append(record)


@pytest.fixture
def own_logger():
    """A logger of this test alone, at INFO, whose records are kept in `.records`."""
    logger = logging.getLogger(f"test_quiet.{time.monotonic_ns()}")
    handler = _Records()
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    logger.records = handler.records
    yield logger
    logger.removeHandler(handler)


def _debug_lines(caplog):
    return [r.getMessage() for r in caplog.records
            if r.name == "jcomp.train.run.quiet" and r.levelno == logging.DEBUG]


def _record(name, level, msg, *, pathname=__file__, exc_info=None):
    return logging.LogRecord(name, level, pathname, 1, msg, None, exc_info)


# ---------------------------------------------------------------- restores

def test_restoring_quietly_holds_back_warnings_then_restores_the_level(own_logger):
    with quiet.restoring_quietly(own_logger):
        assert own_logger.level == logging.ERROR
        own_logger.warning("held back")
        own_logger.error("still shown")
    own_logger.warning("after")
    assert [r.getMessage() for r in own_logger.records] == ["still shown", "after"]
    assert own_logger.level == logging.INFO


def test_restoring_quietly_keeps_stderr_output_in_the_debug_log(own_logger, capfd, caplog):
    caplog.set_level(logging.DEBUG, logger="jcomp.train.run.quiet")
    with quiet.restoring_quietly(own_logger):
        os.write(2, b"Event loop is closed (from a TensorStore callback)\n")
    os.write(2, b"after the restore\n")
    err = capfd.readouterr().err
    assert "TensorStore" not in err and "after the restore" in err
    assert ("stderr during checkpoint restore:\nEvent loop is closed (from a TensorStore "
            "callback)") in _debug_lines(caplog)


def test_unraisable_errors_during_a_restore_go_to_the_debug_log(own_logger, caplog):
    caplog.set_level(logging.DEBUG, logger="jcomp.train.run.quiet")

    class Abandoned:  # a coroutine of a failed read, garbage-collected
        def __del__(self):
            raise ValueError("read of step 8 failed")

    seen, old = [], sys.unraisablehook
    sys.unraisablehook = lambda u: seen.append(u.exc_value)
    try:
        with quiet.restoring_quietly(own_logger):
            Abandoned().__init__()
        assert sys.unraisablehook is not old and seen == []
        Abandoned().__init__()  # after the restore: the previous hook again
    finally:
        sys.unraisablehook = old
    assert [str(e) for e in seen] == ["read of step 8 failed"]
    assert "after a failed restore: read of step 8 failed" in _debug_lines(caplog)


def _fd2():
    st = os.fstat(2)
    return st.st_dev, st.st_ino


def test_a_failing_restore_restores_everything_and_raises(own_logger):
    hook, fd2 = sys.unraisablehook, _fd2()
    with pytest.raises(RuntimeError, match="no usable checkpoint"):
        with quiet.restoring_quietly(own_logger):
            assert _fd2() != fd2  # captured meanwhile
            raise RuntimeError("no usable checkpoint")
    assert sys.unraisablehook is hook and own_logger.level == logging.INFO
    assert _fd2() == fd2


def test_a_restore_that_skipped_steps_waits_for_late_reports(own_logger):
    """Steps that failed to read leave reads behind: the restore waits until
    their output stops (at least quiet_s = 0.3 s of silence) before giving fd 2 back."""
    class Holder:
        skipped = [8]

    t0 = time.monotonic()
    with quiet.restoring_quietly(own_logger, Holder()):
        pass
    assert time.monotonic() - t0 >= 0.3


# ---------------------------------------------------------------- log filters

NEVER_RETRIEVED = ("Task exception was never retrieved\nfuture: <Task finished "
                   "coro=<_read_array() done, defined at /x/orbax/checkpoint/serialization.py>")


@pytest.mark.parametrize("msg,kept", [
    (NEVER_RETRIEVED, False),
    ("Task exception was never retrieved\nfuture: <Task coro=<OCDBT read>>", False),
    ("Task exception was never retrieved\nfuture: <Task coro=<my_own_task()>>", True),
    ("orbax: read failed", True),  # not an abandoned task
])
def test_orphaned_read_filter_drops_only_abandoned_orbax_reads(msg, kept):
    assert quiet._OrphanedReadFilter().filter(_record("asyncio", logging.ERROR, msg)) is kept


def test_demoted_orphaned_reads_reach_the_debug_log_once_installed(caplog):
    caplog.set_level(logging.DEBUG)
    asyncio_log = logging.getLogger("asyncio")
    before = list(asyncio_log.filters)
    try:
        quiet.demote_orphaned_read_errors()
        quiet.demote_orphaned_read_errors()  # installs one filter, not two
        assert sum(isinstance(f, quiet._OrphanedReadFilter) for f in asyncio_log.filters) == 1
        asyncio_log.error(NEVER_RETRIEVED)
        asyncio_log.error("Task exception was never retrieved\nfuture: <Task coro=<mine()>>")
    finally:
        asyncio_log.filters[:] = before
    errors = [r.getMessage() for r in caplog.records if r.name == "asyncio"]
    assert errors == ["Task exception was never retrieved\nfuture: <Task coro=<mine()>>"]
    assert ("orbax read task after a failed restore: Task exception was never retrieved"
            in _debug_lines(caplog))


def _exc_info():
    try:
        raise OSError("No space left on device")
    except OSError:
        return sys.exc_info()


@pytest.mark.parametrize("level,path,with_exc,kept", [
    (logging.ERROR, "/site-packages/orbax/checkpoint/async_checkpointer.py", True, False),
    (logging.ERROR, "/site-packages/orbax/checkpoint/async_checkpointer.py", False, True),
    (logging.WARNING, "/site-packages/orbax/checkpoint/async_checkpointer.py", True, True),
    (logging.ERROR, "/site-packages/mylib/save.py", True, True),
])
def test_failed_save_filter_drops_only_orbax_errors_logged_with_their_exception(
        level, path, with_exc, kept):
    rec = _record("absl", level, "save failed", pathname=path,
                  exc_info=_exc_info() if with_exc else None)
    assert quiet._FailedSaveFilter().filter(rec) is kept


def test_demote_failed_save_errors_installs_once():
    absl_log = logging.getLogger("absl")
    filters, saved_hook = list(absl_log.filters), sys.unraisablehook
    try:
        # From a process where nothing installed them yet (another test in this
        # worker may have: the hook and the filter are process-wide).
        absl_log.filters[:] = [f for f in filters if not isinstance(f, quiet._FailedSaveFilter)]
        hook = sys.__unraisablehook__
        sys.unraisablehook = hook
        quiet.demote_failed_save_errors()
        wrapped = sys.unraisablehook
        quiet.demote_failed_save_errors()
        assert sys.unraisablehook is wrapped and wrapped is not hook
        assert wrapped.jcomp_save_filter
        assert sum(isinstance(f, quiet._FailedSaveFilter) for f in absl_log.filters) == 1
    finally:
        absl_log.filters[:] = filters
        sys.unraisablehook = saved_hook


def test_late_writes_of_a_failed_save_are_not_reported():
    """TensorStore reports a write finishing after orbax closed a failed save's
    event loop as an unraisable exception; the filter drops exactly those."""
    import asyncio
    import sys
    from jcomp.train.run.quiet import unraisable_filter
    loop = asyncio.new_event_loop()
    loop.close()

    class Late:  # a completion callback that fires after the loop closed
        def __del__(self):
            loop.call_soon_threadsafe(print)

    class Other:
        def __del__(self):
            raise ValueError("some other failure")

    passed, old = [], sys.unraisablehook
    sys.unraisablehook = unraisable_filter(lambda u: passed.append(u.exc_value))
    try:
        Late().__init__()
        Other().__init__()
    finally:
        sys.unraisablehook = old
    assert [str(e) for e in passed] == ["some other failure"]


def test_event_loop_closed_raised_elsewhere_is_reported():
    """Only the error asyncio raises from call_soon_threadsafe is dropped: the same
    message raised by other code still reaches the previous hook."""
    from jcomp.train.run.quiet import unraisable_filter

    class Closed:
        def __del__(self):
            raise RuntimeError("Event loop is closed")

    passed, old = [], sys.unraisablehook
    sys.unraisablehook = unraisable_filter(lambda u: passed.append(u.exc_value))
    try:
        Closed().__init__()
    finally:
        sys.unraisablehook = old
    assert [str(e) for e in passed] == ["Event loop is closed"]


# ---------------------------------------------------------------- exit

def _child(code):
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)


def test_exit_with_line_leaves_one_line_and_the_code():
    """Without JAX loaded; a thread that never ends does not hold the exit up,
    and what stdout had is flushed first."""
    out = _child("import sys, threading\n"
                 "from jcomp.train.run import quiet\n"
                 "assert 'jax' not in sys.modules\n"
                 "threading.Thread(target=threading.Event().wait).start()\n"
                 "sys.stdout.write('progress')\n"
                 "quiet.exit_with_line('train.py: error: disk full\\n', 3)\n"
                 "print('never')\n")
    assert (out.returncode, out.stdout, out.stderr) == (3, "progress", "train.py: error: disk full\n")


def test_exit_line_goes_to_the_terminal_fd(tmp_path):
    path = tmp_path / "terminal"
    out = _child("import os\n"
                 "from jcomp.train.run import quiet\n"
                 f"quiet.set_terminal_fd(os.open({str(path)!r}, os.O_WRONLY | os.O_CREAT))\n"
                 "quiet.exit_with_line('train.py: error: peer lost\\n', 4)\n")
    assert (out.returncode, out.stderr) == (4, "")
    assert path.read_text() == "train.py: error: peer lost\n"
