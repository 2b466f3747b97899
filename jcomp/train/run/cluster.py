"""What the processes of one multi-process run agree on, and how they fail together.

    cluster.agree_on_config(settings, timeout_s)   # before anything is written
    cluster.supervise(argv, workdir)               # train.py's parent process (no JAX)
    cluster.divert_stderr(workdir)                 # in the trainer, once the workdir is held

JAX's distributed client ends a process from C++ (SIGABRT, a screenful of
log on stderr) when the coordination service reports another task dead, or
when the cluster does not form in time; no Python `except` runs. So train.py,
in a multi-process run, runs its trainer as a child of a small supervisor that
imports no JAX. The child writes what C++ and its libraries print to
WORKDIR/process<i>.log, and its own lines and progress bar to the terminal.
When the child is aborted because a peer was lost, the supervisor says so in
one line (the lost process, the last complete checkpoint, the log) and exits
with PEER_LOST_EXIT. JAX's heartbeat timeout (train.py --peer_timeout) bounds
how long that takes.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

from jcomp.train.run import faults, quiet

PEER_LOST_EXIT = 4
SUPERVISED_ENV = "JCOMP_SUPERVISED"  # set in the trainer child of a supervisor


def _flat_fields(tree, prefix="") -> dict:
    """{"optim.lr": 0.003, ...} of a nested dict."""
    out = {}
    for k, v in tree.items():
        name = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flat_fields(v, name + "."))
        else:
            out[name] = v
    return out


def leave_together(timeout_s: float = 10.0) -> None:
    """Before a cluster-wide error exit: the processes other than 0 say they are
    leaving and return (to exit at once); process 0, whose process hosts the
    coordination service, returns once it has heard from all of them (or after
    `timeout_s`). Were it to leave first, JAX's client would abort the others
    from C++ with a screenful of log before their one line."""
    import time

    import jax
    from jax._src import distributed

    client = distributed.global_state.client
    if jax.process_count() == 1 or client is None:
        return
    me = jax.process_index()
    if me != 0:
        client.key_value_set(f"jcomp/leaving/{me}", "1")
        return
    deadline = time.monotonic() + timeout_s
    for i in range(1, jax.process_count()):
        try:
            left = max(deadline - time.monotonic(), 0.001)
            client.blocking_key_value_get(f"jcomp/leaving/{i}", int(left * 1000))
        except Exception:  # noqa: BLE001  (gone already, or too slow: leave anyway)
            pass
    time.sleep(0.5)  # their exit follows their word by microseconds


def config_differences(mine: dict, theirs: dict) -> list[str]:
    """The dotted fields in which two resolved configs differ, sorted."""
    a, b = _flat_fields(mine), _flat_fields(theirs)
    return sorted(k for k in set(a) | set(b) if a.get(k, "<unset>") != b.get(k, "<unset>"))


def agree_on_config(settings: dict, timeout_s: float) -> None:
    """Every process of a cluster publishes its resolved config (and the flags that
    shape the run) in the coordination service's key-value store and reads every
    other's, before anything is written. UsageError on every process where one
    differs, naming the processes and the fields with process 0's value and
    theirs: a process with another optim.lr, seed, data.source or train.steps
    would otherwise train apart silently, or hang at the end."""
    import json

    import jax
    from jax._src import distributed

    n, me, client = jax.process_count(), jax.process_index(), distributed.global_state.client
    if n == 1 or client is None:
        return
    text = json.dumps(settings, sort_keys=True, default=str)
    client.key_value_set(f"jcomp/config/{me}", text)
    try:
        seen = {i: json.loads(text if i == me else client.blocking_key_value_get(
            f"jcomp/config/{i}", int(timeout_s * 1000))) for i in range(n)}
    except Exception as e:  # noqa: BLE001  (the client raises its own error types)
        raise faults.UsageError(f"the processes could not compare their configs within "
                         f"{timeout_s:g} s: {str(e).strip().splitlines()[0]}") from None
    # Every process has read every config before any of them can leave.
    client.wait_at_barrier("jcomp/config_read", int(timeout_s * 1000))
    flat0 = _flat_fields(seen[0])
    problems = []
    for i in range(1, n):
        diff = config_differences(seen[0], seen[i])
        if diff:
            flat = _flat_fields(seen[i])
            shown = ", ".join(f"{k} ({flat0.get(k, '<unset>')!r} on process 0, "
                              f"{flat.get(k, '<unset>')!r} on process {i})" for k in diff[:4])
            more = f" and {len(diff) - 4} more" if len(diff) > 4 else ""
            problems.append(f"process {i} differs from process 0 in {shown}{more}")
    if problems:
        raise faults.UsageError("the processes were given different configs: " + "; ".join(problems)
                         + "; start every process with the same config and flags")


def supervised() -> bool:
    return os.environ.get(SUPERVISED_ENV) == "1"


def log_path(workdir: str, process_index: int) -> str:
    return os.path.join(os.path.abspath(workdir), f"process{process_index}.log")


def divert_stderr(workdir: str, process_index: int) -> str:
    """In a supervised trainer: file descriptor 2 (what C++, gloo and orbax's
    threads print) goes to WORKDIR/process<i>.log; Python's sys.stderr (the
    progress bar, warnings, train.py's one line) stays on the terminal. Call it
    holding the workdir lock. -> the log's path."""
    path = log_path(workdir, process_index)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.write(fd, f"--- train.py process {process_index}, pid {os.getpid()}\n".encode())
    sys.stderr.flush()
    terminal = os.dup(2)
    os.dup2(fd, 2)
    os.close(fd)
    quiet.set_terminal_fd(terminal)
    sys.stderr = os.fdopen(os.dup(terminal), "w", buffering=1, encoding="utf-8",
                           errors="backslashreplace")
    return path


def is_peer_error(e: BaseException) -> bool:
    """An error that a lost peer raises in this process's own collectives."""
    text = f"{type(e).__name__}: {e}"
    return any(s in text for s in ("Gloo", "Connection closed by peer",
                                   "Connection reset by peer", "stopped sending heartbeats"))


def _die_with_parent():
    """In the child, before exec: SIGKILL when the supervisor dies (Linux), so that
    killing train.py kills its trainer, as it did before there was a child."""
    try:
        import ctypes
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def supervise(argv: list, workdir: str) -> None:
    """Runs this train.py command again as the trainer child and exits as it does.
    A child aborted by JAX because a peer was lost becomes one line and exit
    PEER_LOST_EXIT; any other abnormal end, one line and 128 + the signal.
    SIGTERM and SIGHUP are passed on; SIGINT from a terminal reaches the child
    itself (same process group), so it is not passed on twice."""
    env = {**os.environ, SUPERVISED_ENV: "1"}
    child = subprocess.Popen([sys.executable, *argv], env=env, preexec_fn=_die_with_parent)
    forward = lambda signum, frame: child.send_signal(signum)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, forward)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    code = child.wait()
    if code >= 0:
        os._exit(code)
    line, exit_code = ended_line(workdir, child.pid, -code)
    os.write(2, line.encode())
    os._exit(exit_code)


def _child_log(workdir: str, pid: int):
    """(path, text) of the process log whose header names `pid`, or (None, "")."""
    try:
        names = sorted(n for n in os.listdir(workdir) if re.fullmatch(r"process\d+\.log", n))
    except OSError:
        return None, ""
    for name in names:
        path = os.path.join(workdir, name)
        try:
            with open(path, errors="replace") as f:
                text = f.read()
        except OSError:
            continue
        mark = text.rfind(f", pid {pid}\n")
        if mark >= 0:
            return path, text[mark:]
    return None, ""


def last_complete_step(workdir: str):
    """The newest committed checkpoint step in WORKDIR/checkpoints, or None."""
    from jcomp.train.run.checkpoint import COMMIT_MARKER  # imports JAX: only once the child is gone
    ckpt = os.path.join(os.path.abspath(workdir), "checkpoints")
    try:
        steps = [int(n) for n in os.listdir(ckpt) if n.isdigit()
                 and os.path.exists(os.path.join(ckpt, n, COMMIT_MARKER))]
    except OSError:
        return None
    return max(steps) if steps else None


def ended_line(workdir: str, pid: int, signum: int) -> tuple[str, int]:
    """The supervisor's one line for a trainer child ended by `signum`, and the exit code."""
    path, text = _child_log(workdir, pid)
    try:
        name = signal.Signals(signum).name
    except ValueError:
        name = f"signal {signum}"
    step = last_complete_step(workdir)
    resume = (f"the last complete checkpoint is step {step}" if step is not None
              else "no checkpoint is complete")
    where = f"; its log: {path}" if path else ""
    lost = re.search(r"tasks are unhealthy \(stopped sending heartbeats\):\s*([\d,\s]+?)\s*\n"
                     r"\s*The tasks", text)
    if lost or "another task died" in text or "detected fatal errors" in text:
        who = (f"process {', '.join(lost.group(1).split())}" if lost else "a peer process")
        return (f"\ntrain.py: error: {who} of the cluster was lost (it stopped answering), so "
                f"this process stopped; {resume}; rerun every process with the same command "
                f"to resume from it{where}\n", PEER_LOST_EXIT)
    return (f"\ntrain.py: error: the trainer was ended by {name}; {resume}{where}\n",
            128 + signum)
