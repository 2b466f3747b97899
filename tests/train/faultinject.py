"""train.py with faults injected through the loop's hooks (`jcomp.train.run.hooks`), for
the end-to-end fault tests:

    python tests/train/faultinject.py [FAULTS] -- [train.py flags]

    --step_sleep=S          sleep S seconds after each step, so that a signal
                            can land mid-run
    --kill_during_save=K    SIGKILL this process once the asynchronous save of
                            step K has its temporary directory
    --nan_step=K[,K2...]    give step K (each listed step) target ids outside
                            [0, V), which the vocab-parallel loss turns into a
                            NaN loss
    --sigint_during_save=K  send this process SIGINT twice (a double Ctrl-C) at
                            the same point of step K's save
    --fill_disk_after=K     after step K, once no save is in progress, fill the
                            workdir's filesystem with the file --fill_file until
                            --fill_leave bytes are free: the save of step K then
                            meets a full disk, whatever the size of the saves
                            before it

Everything after `--` is train.py's command line, run by train.py's own code
(its signal handlers, flag checks, error lines and exit codes).
"""
import argparse
import os
import signal
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import train  # noqa: E402  (first: it installs the signal handlers before JAX loads)

import numpy as np  # noqa: E402

from jcomp.train.run import hooks  # noqa: E402


class Faults(hooks.Hooks):
    def __init__(self, step_sleep=0.0, kill_during_save=None, nan_steps=(),
                 sigint_during_save=None, fill=None):
        self.step_sleep, self.nan_steps = step_sleep, set(nan_steps)
        self.kill_during_save, self.sigint_during_save = kill_during_save, sigint_during_save
        self.fill = fill  # (step, checkpoint directory, filler path, bytes to leave)

    def before_batch(self, step_no, rows_BxL1, vocab_size):
        if step_no in self.nan_steps:
            # Every id set to V: no vocabulary shard owns it, so the loss is NaN.
            return np.full(np.shape(rows_BxL1), vocab_size, np.int32)
        return rows_BxL1

    def after_step(self, step_no, record):
        if self.step_sleep:
            time.sleep(self.step_sleep)
        if self.fill and step_no == self.fill[0]:
            _fill_disk(*self.fill[1:])

    def during_save(self, step_no, directory, stop):
        if step_no == self.kill_during_save:
            _await_temporary(directory, step_no)
            os.kill(os.getpid(), signal.SIGKILL)
        if step_no == self.sigint_during_save:
            _await_temporary(directory, step_no)
            os.kill(os.getpid(), signal.SIGINT)
            while not stop.requested:  # the first one handled, as a person's would be
                time.sleep(0.01)
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)  # the handler ends the process


def _await_temporary(directory, step_no: int, limit_s: float = 10.0):
    """Waits until the save of `step_no` has its temporary directory on disk (it
    is made by a background thread), so that a fault lands mid-save."""
    from jcomp.train.run.checkpoint import TMP_MARK
    start = time.monotonic()
    while time.monotonic() - start < limit_s and not any(
            n.startswith(f"{step_no}{TMP_MARK}") for n in os.listdir(directory)):
        time.sleep(0.005)


def _fill_disk(ckpt_dir: str, path: str, leave: int, limit_s: float = 60.0):
    """Waits for the saves in progress to commit, then writes `path` until the
    filesystem has `leave` bytes (rounded to pages) free."""
    from jcomp.train.run.checkpoint import TMP_MARK
    start = time.monotonic()
    while time.monotonic() - start < limit_s and any(
            TMP_MARK in n for n in os.listdir(ckpt_dir)):
        time.sleep(0.01)
    fs = os.statvfs(ckpt_dir)
    size = fs.f_bavail * fs.f_frsize - leave
    size -= size % fs.f_frsize
    with open(path, "wb") as f:
        f.write(b"\0" * max(size, 0))


def _at_least_zero(kind):
    def parse(raw):
        try:
            value = kind(raw)
        except ValueError:
            value = -1
        if not (np.isfinite(value) and value >= 0):
            raise argparse.ArgumentTypeError(f"{raw!r} is not a number >= 0")
        return value
    return parse


def _steps(raw):
    return [_at_least_zero(int)(v) for v in raw.split(",")]


def main(argv):
    if "--" not in argv:
        sys.exit(f"usage: {argv[0]} [FAULTS] -- [train.py flags]")
    cut = argv.index("--")
    p = argparse.ArgumentParser(prog=argv[0])
    p.add_argument("--step_sleep", type=_at_least_zero(float), default=0.0)
    p.add_argument("--kill_during_save", type=_at_least_zero(int))
    p.add_argument("--nan_step", type=_steps, default=[])
    p.add_argument("--sigint_during_save", type=_at_least_zero(int))
    p.add_argument("--fill_disk_after", type=_at_least_zero(int))
    p.add_argument("--fill_file")
    p.add_argument("--fill_leave", type=_at_least_zero(int), default=0)
    a = p.parse_args(argv[1:cut])
    fill = None
    if a.fill_disk_after is not None:
        workdirs = [v.split("=", 1)[1] for v in argv[cut + 1:] if v.startswith("--workdir=")]
        if not (a.fill_file and workdirs):
            sys.exit("--fill_disk_after needs --fill_file and train.py's --workdir")
        fill = (a.fill_disk_after, os.path.join(workdirs[-1], "checkpoints"), a.fill_file,
                a.fill_leave)
    faults = Faults(a.step_sleep, a.kill_during_save, a.nan_step, a.sigint_during_save, fill)
    train.run([os.path.join(ROOT, "train.py"), *argv[cut + 1:]], hooks=faults)


if __name__ == "__main__":
    main(sys.argv)
