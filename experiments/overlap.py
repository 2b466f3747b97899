"""Does an exchange across a throttled link hide behind compute? Two processes
on the two-hop rig (tools.netns.Pair), each its own namespace, time four
programs over a mesh ('dcn', 'local') = (2, devices per process):

    python -m experiments.overlap [--rate 10mbit] [--burst 128kb] [--devices 1]
        [--exchange-mb 1.0] [--matmuls 100] [--repeats 5]
        [--out experiments/results/overlap.json]

  compute       a chain of matmuls on each device, nothing sent (with
                --local-collective, each matmul followed by a psum over 'local',
                a collective that stays inside the process; over 1 device a
                group of one, which sends nothing either)
  exchange      a psum across 'dcn' of --exchange-mb per device
  one program   both in one jitted program, neither reading the other's result
  two programs  the exchange's program, then the compute's, dispatched back to
                back and waited on together
  two threads   the same two programs, the exchange's dispatched from a thread
                of its own: a CPU client runs a program over several devices
                in the thread that dispatches it

hidden = compute + exchange - one program (hidden_threads: - two threads):
the exchange's seconds that ran while the compute did (0: one after the
other). This is what an outer loop's start can hide at most, in an inner
step's program (jcomp.train.outer.delay.carry) or on a thread of its own (its
CPU form); a program of its own dispatched from the step's thread hides
nothing. Every figure is the median of --repeats after one warm-up call.
Needs root and iproute2; without them it prints one line and exits 2. The
namespaces are removed on every way out.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_OUT = os.path.join("experiments", "results", "overlap.json")
ROWS = 640  # rows and columns of each device's compute operand


def worker(process: int, coordinator: str, devices: int, exchange_mb: float, matmuls: int,
           local_collective: bool, repeats: int) -> dict:
    """One process's timings (process 0's are the row's)."""
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator, 2, process)
    mesh = jax.make_mesh((2, devices), ("dcn", "local"), devices=jax.devices())
    spec = P(("dcn", "local"))
    n = max(int(exchange_mb * 2**20 / 4), 1)

    def compute(x):
        for _ in range(matmuls):
            x = jnp.tanh(x @ x.T) * 0.01
            if local_collective:
                x = x + jax.lax.psum(x[:1], "local") * 1e-3
        return x

    def exchange(y):
        return jax.lax.psum(y, "dcn")

    def program(f, k):
        return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(spec,) * k,
                                     out_specs=(spec,) * k if k > 1 else spec))

    c, e = program(compute, 1), program(exchange, 1)
    both = program(lambda x, y: (compute(x), exchange(y)), 2)
    sharding = NamedSharding(mesh, spec)
    x = jax.make_array_from_callback(
        (2 * devices * ROWS, ROWS), sharding,
        lambda i: np.full((ROWS, ROWS), 0.01, np.float32))
    y = jax.make_array_from_callback((2 * devices * n,), sharding,
                                     lambda i: np.ones((n,), np.float32))

    def timed(fn):
        jax.block_until_ready(fn())
        out = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(fn())
            out.append(time.perf_counter() - t0)
        return statistics.median(out)

    def threaded():
        # The exchange dispatched from a thread of its own: a CPU client runs a
        # program over several devices in the thread that dispatches it.
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            sent = pool.submit(lambda: jax.block_until_ready(e(y)))
            out = c(x)
            return out, sent.result()

    figures = {"compute_s": timed(lambda: c(x)), "exchange_s": timed(lambda: e(y)),
               "one_program_s": timed(lambda: both(x, y)),
               "two_programs_s": timed(lambda: (e(y), c(x))),
               "two_threads_s": timed(threaded)}
    jax.distributed.shutdown()
    return figures


def summary(figures: dict) -> dict:
    """The figures with hidden_s (compute + exchange - one program, at least 0)
    and hidden_share (of the shorter of the two: 1 is all that could hide)."""
    apart = figures["compute_s"] + figures["exchange_s"]
    shorter = min(figures["compute_s"], figures["exchange_s"])
    out = dict(figures)
    for key, suffix in (("one_program_s", ""), ("two_threads_s", "_threads")):
        if key in figures:
            hidden = max(apart - figures[key], 0.0)
            out["hidden" + suffix + "_s"] = hidden
            out["hidden" + suffix + "_share"] = hidden / shorter if shorter else None
    return out


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rate", default="10mbit", help="tc rate of the link, or 'unthrottled'")
    p.add_argument("--burst", default="128kb", help="tc tbf's bucket (> 64kb)")
    p.add_argument("--devices", type=int, nargs="+", default=[1, 4],
                   help="CPU devices per process: one row each")
    p.add_argument("--exchange-mb", type=float, default=1.0)
    p.add_argument("--matmuls", type=int, default=100)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per row; killed after")
    p.add_argument("--port", type=int, default=24611)
    p.add_argument("--out", default=DEFAULT_OUT)
    p.add_argument("--worker", nargs=2, metavar=("PROCESS", "COORDINATOR"),
                   help=argparse.SUPPRESS)
    p.add_argument("--local-collective", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for name in ("exchange_mb", "matmuls", "repeats", "timeout"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be > 0; got {getattr(args, name)}")
    if any(d < 1 for d in args.devices):
        p.error(f"--devices must be >= 1; got {args.devices}")
    from tools.netns import rate_bits
    try:
        rate_bits(args.rate)
    except ValueError as e:
        p.error(str(e))
    return args


def _row(pair, args, devices: int, local_collective: bool, port: int) -> dict:
    cmd = [sys.executable, "-m", "experiments.overlap", "--devices", str(devices),
           "--exchange-mb", str(args.exchange_mb), "--matmuls", str(args.matmuls),
           "--repeats", str(args.repeats),
           *(["--local-collective"] if local_collective else [])]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    with tempfile.TemporaryDirectory(prefix="overlap-") as tmp:
        procs = []
        try:
            for i in (0, 1):
                out = open(os.path.join(tmp, f"process{i}.json"), "w")
                procs.append(subprocess.Popen(
                    pair.exec_args(cmd + ["--worker", str(i), f"{pair.coordinator_host}:{port}"],
                                   process=i),
                    cwd=ROOT, env=env, stdout=out, stderr=subprocess.DEVNULL))
                out.close()
            deadline = time.monotonic() + args.timeout
            for p in procs:
                p.wait(timeout=max(deadline - time.monotonic(), 1))
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        if any(p.returncode for p in procs):
            raise RuntimeError(f"a worker exited with {[p.returncode for p in procs]}")
        with open(os.path.join(tmp, "process0.json")) as f:
            figures = json.loads(f.read().strip().splitlines()[-1])
    return {"devices_per_process": devices, "local_collective": local_collective,
            **summary(figures)}


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.worker:
        figures = worker(int(args.worker[0]), args.worker[1], args.devices[0], args.exchange_mb,
                         args.matmuls, args.local_collective, args.repeats)
        print(json.dumps(figures), flush=True)
        return 0
    from tools.netns import Pair, Unavailable, rate_bits, unavailable_reason
    reason = unavailable_reason()
    if reason:
        print(f"overlap.py: error: {reason}", file=sys.stderr)
        return 2
    for sig in (signal.SIGTERM, signal.SIGHUP):  # unwind through Pair's removal
        signal.signal(sig, lambda signum, frame: sys.exit(128 + signum))
    commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True,
                            text=True).stdout.strip() or "unknown"
    rows = []
    try:
        with Pair() as pair:
            if rate_bits(args.rate) is not None:
                pair.set_rate(args.rate, args.burst)
            port = args.port
            for devices in args.devices:
                for local in (False, True):
                    row = _row(pair, args, devices, local, port)
                    port += 1
                    rows.append(row)
                    print(f"devices/process {devices}, collective in compute {local}: compute "
                          f"{row['compute_s']:.3f} s, exchange {row['exchange_s']:.3f} s, one "
                          f"program {row['one_program_s']:.3f} s, two programs "
                          f"{row['two_programs_s']:.3f} s, two threads "
                          f"{row['two_threads_s']:.3f} s: hidden {row['hidden_s']:.3f} s in "
                          f"one program, {row['hidden_threads_s']:.3f} s in two threads",
                          flush=True)
    except Unavailable as e:
        print(f"overlap.py: error: cannot make a network namespace: {e}", file=sys.stderr)
        return 2
    out = {"command": "python -m experiments.overlap " + " ".join(sys.argv[1:] if argv is None
                                                                   else argv),
           "commit": commit, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
               timespec="seconds"),
           "rate": args.rate, "burst": args.burst, "exchange_mb": args.exchange_mb,
           "matmuls": args.matmuls, "repeats": args.repeats, "rows": rows}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
