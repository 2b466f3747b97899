"""Private network namespaces throttled by tc's token bucket filter: the links of
experiments/network.py.

    with Namespace() as ns:                 # ip netns add jcnet-<pid>; lo up
        ns.set_rate("100mbit")              # tc qdisc replace dev lo root tbf ...
        subprocess.run(ns.exec_args([...])) # a command inside it
        ns.counters()                       # (bytes, packets, TCP retransmissions) on lo
                                            # leaving the block: ip netns del, always

    with Pair() as pair:                    # two namespaces joined by a veth pair
        pair.set_rate("100mbit")            # tbf on both veth ends: the slow hop only
        pair.exec_args([...], process=1)    # process i runs in namespace i
        pair.counters()                     # what crossed the veth, both directions

A Pair is two hops: each namespace's own loopback stays unthrottled (a
process's devices talk over it), and only what goes from one process to the
other crosses the throttled veth.
"""
from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

PREFIX = "jcnet-"
# tbf's burst must exceed the loopback MTU (64 KiB, also a veth's GSO packets), or
# TCP stalls until it times out. The bucket starts full: a run sends up to a burst
# above the rate, which a short run at a low rate notices (set_rate's `burst`).
BURST = "4mb"


_RATE = re.compile(r"^(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit)$")
_UNIT = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9}


def _tbf(rate: str, burst: str) -> list[str]:
    return ["tbf", "rate", rate, "burst", burst, "latency", "500ms"]


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
    for name in re.findall(rf"^({PREFIX}(\d+)(?:-[01])?)\b", out, re.M):
        if not _alive(int(name[1])):
            _run("ip", "netns", "del", name[0], check=False)
            shutil.rmtree(os.path.join(_ETC_NETNS, name[0]), ignore_errors=True)


def _probe(ns: str, store):
    """Starts a process that lives in namespace `ns` (/proc/<its pid>/net is the
    namespace's view, read without starting a process per reading) and hands it
    to `store` before any signal lands, so that cleanup finds it."""
    with signals_deferred():
        store(subprocess.Popen(["ip", "netns", "exec", ns, "sleep", "infinity"],
                               start_new_session=True))


def _entered(proc) -> bool:
    """Whether `proc` (an `ip netns exec`) has moved into its namespace: until it
    has, its /proc view is the caller's own network."""
    try:
        return os.readlink(f"/proc/{proc.pid}/ns/net") != os.readlink("/proc/self/ns/net")
    except OSError:
        return False


def _wait_for(ready, tries: int = 250):
    for _ in range(tries):
        if ready():
            return
        time.sleep(0.02)


def _retransmitted(pid: int) -> int:
    """TCP segments retransmitted so far in the namespace of process `pid`."""
    with open(f"/proc/{pid}/net/snmp") as f:
        names, values = [l.split() for l in f if l.startswith("Tcp:")][:2]
    return int(values[names.index("RetransSegs")])


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
            _probe(self.name, lambda p: setattr(self, "_probe", p))
            _wait_for(lambda: _entered(self._probe) and self._lo_line() is not None)
        except BaseException:
            self.__exit__()
            raise
        return self

    def exec_args(self, argv, process: int = 0):
        """`argv` inside the namespace (every process in the same one)."""
        return ["ip", "netns", "exec", self.name, *argv]

    coordinator_host = "127.0.0.1"

    def set_rate(self, rate: str, burst: str = BURST):
        """tbf on the namespace's loopback at `rate`, or no qdisc for 'unthrottled'."""
        if rate_bits(rate) is None:
            _run(*self.exec_args(["tc", "qdisc", "del", "dev", "lo", "root"]), check=False)
        else:
            _run(*self.exec_args(["tc", "qdisc", "replace", "dev", "lo", "root",
                                  *_tbf(rate, burst)]))

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
        return int(fields[0]), int(fields[1]), _retransmitted(self._probe.pid)

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


# `ip netns exec NAME` bind-mounts the files of /etc/netns/NAME over /etc: a
# hosts file there makes the machine's hostname resolve, inside NAME, to that
# namespace's veth address, which gloo then advertises to its peers (outside,
# the hostname resolves to 127.0.0.1, which a peer in another namespace cannot
# reach).
_ETC_NETNS = "/etc/netns"
_SUBNET = "10.213.0"  # a /30 that exists only on the veth between the two namespaces


class Pair:
    """Two namespaces, one per process, joined by a veth pair whose two ends are
    throttled: the slow hop between two nodes; each namespace's loopback is the
    fast hop inside one. Removed on exit, whatever happens."""

    def __init__(self, name: str | None = None):
        base = name or f"{PREFIX}{os.getpid()}"
        self.names = (f"{base}-0", f"{base}-1")
        self.name = base
        self.veths = tuple(f"jcv{os.getpid() % 10**7}{i}" for i in (0, 1))
        self.addresses = tuple(f"{_SUBNET}.{i + 1}" for i in (0, 1))
        self.coordinator_host = self.addresses[0]
        self._probes = []

    def __enter__(self):
        try:
            for ns in self.names:
                proc = _run("ip", "netns", "add", ns, check=False)
                if proc.returncode:
                    raise Unavailable(f"ip netns add {ns}: {proc.stderr.strip() or 'failed'}")
            # Made inside the namespaces, so no end ever sits in the caller's.
            _run("ip", "link", "add", self.veths[0], "netns", self.names[0], "type", "veth",
                 "peer", "name", self.veths[1], "netns", self.names[1])
            host = socket.gethostname()
            for ns, veth, addr in zip(self.names, self.veths, self.addresses):
                _run("ip", "-n", ns, "addr", "add", f"{addr}/30", "dev", veth)
                _run("ip", "-n", ns, "link", "set", "lo", "up")
                _run("ip", "-n", ns, "link", "set", veth, "up")
                os.makedirs(os.path.join(_ETC_NETNS, ns), exist_ok=True)
                with open(os.path.join(_ETC_NETNS, ns, "hosts"), "w") as f:
                    f.write(f"127.0.0.1 localhost\n{addr} {host}\n")
                _probe(ns, self._probes.append)
            _wait_for(lambda: all(_entered(p) for p in self._probes)
                      and all(self._line(i) is not None for i in (0, 1)))
        except BaseException:
            self.__exit__()
            raise
        return self

    def exec_args(self, argv, process: int = 0):
        """`argv` in namespace `process` (0 or 1)."""
        return ["ip", "netns", "exec", self.names[process], *argv]

    def set_rate(self, rate: str, burst: str = BURST):
        """tbf on both veth ends (each throttles what leaves through it), or none."""
        for ns, veth in zip(self.names, self.veths):
            if rate_bits(rate) is None:
                _run("tc", "-n", ns, "qdisc", "del", "dev", veth, "root", check=False)
            else:
                _run("tc", "-n", ns, "qdisc", "replace", "dev", veth, "root",
                     *_tbf(rate, burst))

    def qdisc(self) -> str:
        return " / ".join(_run("tc", "-n", ns, "qdisc", "show", "dev", veth).stdout.strip()
                          for ns, veth in zip(self.names, self.veths))

    def _line(self, i):
        try:
            with open(f"/proc/{self._probes[i].pid}/net/dev") as f:
                return next((l for l in f if l.strip().startswith(self.veths[i] + ":")), None)
        except (OSError, IndexError):
            return None

    def counters(self) -> tuple[int, int, int]:
        """(bytes, packets, TCP segments retransmitted) that crossed the veth so
        far, both directions: what each end received."""
        total, packets, retrans = 0, 0, 0
        for i in (0, 1):
            line = self._line(i)
            if line is None:
                raise RuntimeError(f"cannot read the counters of {self.veths[i]} in {self.names[i]}")
            fields = line.split(":", 1)[1].split()
            total, packets = total + int(fields[0]), packets + int(fields[1])
            retrans += _retransmitted(self._probes[i].pid)
        return total, packets, retrans

    def header_bytes(self) -> int:
        """Ethernet 14, IPv4 20, TCP 20, and 12 for timestamps where enabled."""
        out = _run(*self.exec_args(["cat", "/proc/sys/net/ipv4/tcp_timestamps"])).stdout
        return 54 + (12 if out.strip() != "0" else 0)

    def __exit__(self, *exc):
        for p in self._probes:
            p.kill()
            p.wait()
        self._probes = []
        for ns in self.names:  # deleting a namespace deletes its veth end, and so the pair
            _run("ip", "netns", "del", ns, check=False)
            shutil.rmtree(os.path.join(_ETC_NETNS, ns), ignore_errors=True)
        listed = _run("ip", "netns", "list", check=False).stdout.split()
        for ns in self.names:
            if ns in listed:
                print(f"network.py: warning: namespace {ns} still listed; remove it with "
                      f"`ip netns del {ns}`", file=sys.stderr)
