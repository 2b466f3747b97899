"""A private network namespace holding only a loopback, throttled by tc's token
bucket filter: the link of experiments/network.py.

    with Namespace() as ns:                 # ip netns add jcnet-<pid>; lo up
        ns.set_rate("100mbit")              # tc qdisc replace dev lo root tbf ...
        subprocess.run(ns.exec_args([...])) # a command inside it
        ns.counters()                       # (bytes, packets, TCP retransmissions) on lo
                                            # leaving the block: ip netns del, always
"""
from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time

PREFIX = "jcnet-"
# tbf's burst must exceed the loopback MTU (64 KiB), or TCP stalls until it times out.
TBF = ("burst", "4mb", "latency", "500ms")
_RATE = re.compile(r"^(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit)$")
_UNIT = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9}


class Unavailable(RuntimeError):
    """No namespace can be made here: the message says why."""


def rate_bits(rate: str):
    """'100mbit' -> 1e8 bits/s (tc's units, powers of ten); 'unthrottled' -> None."""
    if rate == "unthrottled":
        return None
    m = _RATE.match(rate) if isinstance(rate, str) else None
    if not m or float(m.group(1)) <= 0:
        raise ValueError(f"rate {rate!r}: want 'unthrottled' or a number > 0 with a unit in "
                         f"{', '.join(_UNIT)} (e.g. 300mbit)")
    return float(m.group(1)) * _UNIT[m.group(2)]


def _run(*argv, check=True):
    return subprocess.run(argv, capture_output=True, text=True, check=check, timeout=30)


_DEFERRED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@contextlib.contextmanager
def signals_deferred():
    """Holds Ctrl-C, SIGTERM and SIGHUP until the block ends, then delivers them.

    A signal whose handler raises inside subprocess.Popen, after the fork, loses
    the Popen object: its child runs on where no cleanup can find it. Deferred,
    it lands once the block has stored the object, so the block must hold the
    store too (`with signals_deferred(): procs.append(Popen(...))`). Main thread only."""
    caught = []
    old = {}
    try:
        for sig in _DEFERRED:
            previous = signal.getsignal(sig)
            if previous is not None:  # None: set outside Python, so it cannot be restored
                old[sig] = signal.signal(sig, lambda signum, frame: caught.append(signum))
        yield
    finally:
        for sig, previous in old.items():
            signal.signal(sig, previous)
        if caught:
            signal.raise_signal(caught[0])


def unavailable_reason() -> str | None:
    """None where namespaces and tc work here, else why not (one line)."""
    missing = [t for t in ("ip", "tc") if not shutil.which(t)]
    if missing:
        return f"{' and '.join(missing)} not found (install iproute2)"
    if os.geteuid() != 0:
        return "network namespaces need root"
    return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale():
    """Removes namespaces this script made in runs that were killed (pid gone)."""
    out = _run("ip", "netns", "list", check=False).stdout
    for name in re.findall(rf"^({PREFIX}(\d+))\b", out, re.M):
        if not _alive(int(name[1])):
            _run("ip", "netns", "del", name[0], check=False)


class Namespace:
    """A network namespace with only a loopback; removed on exit, whatever happens."""

    def __init__(self, name: str | None = None):
        self.name = name or f"{PREFIX}{os.getpid()}"
        self._probe = None

    def __enter__(self):
        proc = _run("ip", "netns", "add", self.name, check=False)
        if proc.returncode:
            raise Unavailable(f"ip netns add {self.name}: {proc.stderr.strip() or 'failed'}")
        try:
            _run("ip", "netns", "exec", self.name, "ip", "link", "set", "lo", "up")
            # A process that lives in the namespace: /proc/<its pid>/net/dev is the
            # namespace's view, read without starting a process per reading.
            with signals_deferred():
                self._probe = subprocess.Popen(self.exec_args(["sleep", "infinity"]),
                                               start_new_session=True)
            for _ in range(100):
                if self._lo_line() is not None:
                    break
                time.sleep(0.02)
        except BaseException:
            self.__exit__()
            raise
        return self

    def exec_args(self, argv):
        return ["ip", "netns", "exec", self.name, *argv]

    def set_rate(self, rate: str):
        """tbf on the namespace's loopback at `rate`, or no qdisc for 'unthrottled'."""
        if rate_bits(rate) is None:
            _run(*self.exec_args(["tc", "qdisc", "del", "dev", "lo", "root"]), check=False)
        else:
            _run(*self.exec_args(["tc", "qdisc", "replace", "dev", "lo", "root", "tbf",
                                  "rate", rate, *TBF]))

    def qdisc(self) -> str:
        return _run(*self.exec_args(["tc", "qdisc", "show", "dev", "lo"])).stdout.strip()

    def _lo_line(self):
        try:
            with open(f"/proc/{self._probe.pid}/net/dev") as f:
                return next((l for l in f if l.strip().startswith("lo:")), None)
        except OSError:
            return None

    def counters(self) -> tuple[int, int, int]:
        """(bytes, packets, TCP segments retransmitted) on the loopback so far; on lo
        every byte sent is received once, so rx is the traffic that crossed the link.
        A packet tbf drops never reaches lo's counters; its retransmission does."""
        line = self._lo_line()
        if line is None:
            raise RuntimeError(f"cannot read the loopback counters of namespace {self.name}")
        fields = line.split(":", 1)[1].split()
        with open(f"/proc/{self._probe.pid}/net/snmp") as f:
            names, values = [l.split() for l in f if l.startswith("Tcp:")][:2]
        return int(fields[0]), int(fields[1]), int(values[names.index("RetransSegs")])

    def header_bytes(self) -> int:
        """Bytes of headers on every loopback packet: Ethernet 14, IPv4 20, TCP 20,
        and TCP's 12-byte timestamp option where the namespace enables it."""
        # /proc/sys/net shows the reader's namespace, so it is read from inside.
        out = _run(*self.exec_args(["cat", "/proc/sys/net/ipv4/tcp_timestamps"])).stdout
        return 54 + (12 if out.strip() != "0" else 0)

    def __exit__(self, *exc):
        if self._probe is not None:
            self._probe.kill()
            self._probe.wait()
            self._probe = None
        _run("ip", "netns", "del", self.name, check=False)
        if self.name in _run("ip", "netns", "list", check=False).stdout.split():
            print(f"network.py: warning: namespace {self.name} still listed; remove it with "
                  f"`ip netns del {self.name}`", file=sys.stderr)
