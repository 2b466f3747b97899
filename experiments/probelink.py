"""The probe's link figure against tc's rate on the two-process rig.

    python -m experiments.probelink --rates 10mbit 100mbit 1gbit --repeats 3

Per rate and repeat: two network namespaces joined by a veth whose two ends
tc's tbf throttles (tools/netns.py Pair, burst --burst), and in each a process
of 4 CPU devices. The two run `jcomp.tune.probe` on the mesh compression.auto
probes for its per-hop route (mesh.dcn_data=2: 'dcn' 2 x 'data' 2 x
'tensor' 2), and then time the 'dcn' psum alone at each of --sizes bytes per
device (median of --calls calls after one untimed; no larger size once a
size's median call passes 2 s). The link figure: the probe's 'dcn' bandwidth
per device times the 4 devices of a process, which all cross at once, against
tc's rate; each size's throughput the same way. Writes --out (one row per run, resumable: a
rerun skips the rows it holds at the same commit).

RESULTS.md's section on these rows, and the command rebuilt from them, are
report_probelink.py's.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile

from tools.netns import (Pair, Unavailable, rate_bits, remove_stale, signals_deferred,
                         unavailable_reason)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "experiments", "results", "probelink.json")
DEVICES_PER_PROCESS = 4
MESH = (4, 2, 1)  # data (both hops), tensor, pipeline: the rig's mesh.data=4, mesh.tensor=2
SIZES = (1 << 16, 1 << 18, 1 << 20, 1 << 21, 1 << 22, 1 << 23)
LONGEST_CALL_S = 2.0


def worker(process_id: int, coordinator: str, sizes, calls: int) -> None:
    """One process of a run: prints its figures as one JSON line (process 0)."""
    import importlib
    import time

    import jax
    jax.config.update("jax_num_cpu_devices", DEVICES_PER_PROCESS)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=2,
                               process_id=process_id)

    from jcomp import tune
    from jcomp.gpt import mesh as mesh_lib
    probe_lib = importlib.import_module("jcomp.tune.probe")
    mesh = mesh_lib.make_mesh(MESH, dcn_data=2)
    t0 = time.perf_counter()
    link = tune.probe(mesh, codecs=()).links["dcn"]
    probe_s = time.perf_counter() - t0
    reduce = probe_lib._psum_program(mesh, "dcn")  # the program the probe times
    by_size = {}
    for size in sizes:
        times = probe_lib._times_s(reduce, probe_lib._ones(mesh, size), calls)
        by_size[str(size)] = times
        if statistics.median(times) > LONGEST_CALL_S:
            break
    if process_id == 0:
        print(json.dumps(dict(latency_s=link.latency_s, bytes_per_s=link.bytes_per_s,
                              comment=link.comment, probe_s=probe_s,
                              sizes_limit=[probe_lib.SLOW_CALL_S, probe_lib.SIZE_BUDGET_S],
                              psum_s_by_size=by_size)))


def run(rate: str, burst: str, sizes, calls: int, port: int, timeout: float) -> dict:
    """One run of the two processes in a fresh Pair; the row's figures."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
    with Pair() as pair, tempfile.TemporaryDirectory() as tmp:
        pair.set_rate(rate, burst=burst)
        before = pair.counters()
        procs, logs = [], []
        try:
            for i in (0, 1):
                logs.append(open(os.path.join(tmp, f"process{i}.log"), "w+"))
                cmd = [sys.executable, "-m", "experiments.probelink", "--worker", str(i),
                       f"{pair.coordinator_host}:{port}", "--calls", str(calls),
                       "--sizes", *map(str, sizes)]
                with signals_deferred():  # a signal inside Popen would lose the child
                    procs.append(subprocess.Popen(
                        pair.exec_args(cmd, process=i), cwd=ROOT, env=env,
                        stdout=logs[-1] if i else subprocess.PIPE, stderr=logs[-1], text=True,
                        start_new_session=True))
            out = procs[0].communicate(timeout=timeout)[0]
            procs[1].wait(timeout=30)
        finally:
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
        tail = ""
        for i, log in enumerate(logs):
            log.seek(0)
            lines = [l for l in log.read().splitlines() if l.strip() and "Gloo" not in l]
            tail += f" | process {i}: {' / '.join(lines[-3:])}"
            log.close()
        if any(p.returncode for p in procs):
            raise RuntimeError(f"exited with {[p.returncode for p in procs]}{tail}")
        after = pair.counters()
    return figures(json.loads(out.strip().splitlines()[-1]), rate, before, after)


def figures(fig: dict, rate: str, before, after) -> dict:
    """A worker's figures with the link's: the probe's and each size's psum
    throughput across (per device x the devices of a process) against tc's
    rate, and the bytes and TCP retransmissions the veth counted meanwhile."""
    bits = rate_bits(rate)
    link = fig["bytes_per_s"] * DEVICES_PER_PROCESS
    # Over 'dcn' (n=2) a psum's wire bytes per device are its size: 2(n-1)/n.
    return dict(fig, link_bytes_per_s=link, link_over_tc=link * 8 / bits,
                psum_over_tc_by_size={
                    s: DEVICES_PER_PROCESS * int(s) / statistics.median(t) * 8 / bits
                    for s, t in fig["psum_s_by_size"].items()},
                retransmitted_segments=after[2] - before[2], veth_bytes=after[0] - before[0])


def _commit() -> tuple[str, bool]:
    def git(*a):
        return subprocess.run(["git", "-C", ROOT, *a], capture_output=True, text=True,
                              check=True).stdout.strip()
    return git("rev-parse", "HEAD"), bool(git("status", "--porcelain", "--untracked-files=no",
                                              "--", ".", ":(exclude)experiments/results"))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rates", nargs="+", default=["10mbit", "100mbit", "1gbit"])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--sizes", type=int, nargs="+", default=list(SIZES),
                   help="bytes per device of the psums timed after the probe")
    p.add_argument("--calls", type=int, default=4, help="timed calls of each size")
    p.add_argument("--burst", default="128kb")
    p.add_argument("--port", type=int, default=24567)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per run; killed after")
    p.add_argument("--out", default=OUT)
    p.add_argument("--worker", nargs=2, metavar=("PROCESS_ID", "COORDINATOR"),
                   help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(int(args.worker[0]), args.worker[1], args.sizes, args.calls)
        return 0
    for r in args.rates:
        try:
            if rate_bits(r) is None:
                raise ValueError(f"rate {r!r}: the figure needs a throttled link")
        except ValueError as e:
            p.error(f"--rates: {e}")
    if args.repeats < 1 or args.calls < 1:
        p.error("--repeats and --calls must be >= 1")
    reason = unavailable_reason()
    if reason:
        print(f"probelink.py: error: {reason}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda s, f: sys.exit(128 + s))
    remove_stale()
    commit, dirty = _commit()
    data = json.load(open(args.out)) if os.path.exists(args.out) else {"rows": []}
    done = {(r["rate"], r["repeat"]) for r in data["rows"] if r["commit"] == commit}
    for repeat in range(args.repeats):  # repeat-major: each rate's runs spread in time
        for rate in args.rates:
            if (rate, repeat) in done:
                continue
            try:
                fig = run(rate, args.burst, args.sizes, args.calls, args.port, args.timeout)
            except (RuntimeError, subprocess.TimeoutExpired, Unavailable) as e:
                print(f"probelink.py: {rate} run {repeat}: {e}", file=sys.stderr)
                return 1
            data["rows"].append(dict(rate=rate, repeat=repeat, burst=args.burst, commit=commit,
                                     dirty=dirty, date=datetime.datetime.now(
                                         datetime.timezone.utc).isoformat(timespec="seconds"),
                                     **fig))
            with open(args.out + ".tmp", "w") as f:
                json.dump(data, f, indent=1)
            os.replace(args.out + ".tmp", args.out)
            sizes = ", ".join(f"{int(s) >> 10} KiB {v:.2f}"
                              for s, v in fig["psum_over_tc_by_size"].items())
            print(f"{rate} run {repeat}: probe {fig['link_bytes_per_s'] / 1e6:.2f} MB/s = "
                  f"{fig['link_over_tc']:.3f} x tc ({fig['comment']}); psum alone x tc: {sizes}; "
                  f"{fig['retransmitted_segments']} retransmitted", flush=True)
    rows = [r for r in data["rows"] if r["commit"] == commit]
    for rate in args.rates:
        vals = [r["link_over_tc"] for r in rows if r["rate"] == rate]
        print(f"{rate}: probe link / tc, median of {len(vals)}: {statistics.median(vals):.3f} "
              f"(range {min(vals):.3f}-{max(vals):.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
