"""Wall-clock of train.py over a real, throttled link: N processes of train.py in
a private network namespace whose loopback is rate-limited by tc's token bucket.

    python -m experiments.network [--procs 2] [--config configs/base.py] [--steps 14]
        [--rates unthrottled 1gbit 300mbit 100mbit] [--policies baseline naive hybrid best]
        [--repeats 3] [--ttl-rate 100mbit] [--ttl-steps 28] [--out experiments/results/network.json]
        [--set train.batch_size=16 ...] [--timeout 900] [--hops]

Needs root and iproute2 (`ip`, `tc`); without them it prints one line and exits 2.
With --procs 4 (2 devices each) the mesh's data axis must split across the
processes, as train.py feeds each process the batch rows of its own data
index: e.g. --set mesh.data=4 --set mesh.tensor=2 --set mesh.pipeline=1.
The namespace (named jcnet-<pid>) holds only a loopback, so no byte can leave
it; it is removed on every way out (done, error, Ctrl-C, SIGTERM), and one left
behind by a killed run (its pid gone) is removed on the next start.

--procs 1: one process holding all 8 devices, nothing between processes (its
collectives still cross gloo's TCP on its loopback): the step without the
link, which report_auto's compression.auto section takes as the compute it
adds to the predicted communication, e.g.
`--procs 1 --rates unthrottled --policies baseline --ttl-rate '' --set ...
--out experiments/results/network_auto.json`.

--hops: two hops instead of one link. Each of the 2 processes runs in a
namespace of its own (tools.netns.Pair), the two joined by a veth pair throttled
at both ends; a process's own devices talk over its namespace's unthrottled
loopback. Only what goes from one process to the other is throttled and
counted: the slow hop between two nodes. Rows go to network_hops.json; the
meter's bytes over the slow hop are its 'dcn' axis's where the run splits the
data axis (mesh.dcn_data; the "perhop" policy), and the link's counters should
carry them. Choose a mesh whose data axis has devices on both sides, e.g.
--set mesh.data=4 --set mesh.tensor=2 --set mesh.pipeline=1: the tensor groups
stay inside a process and the data axis has two ranks in each.

Under gloo every collective crosses TCP, even between two devices of one
process, so the whole mesh sits behind the throttled link and the kernel's byte
counter on the namespace's loopback measures what the step really sends. Per
row (rate x policy) it records:
  - the median `step_time_s` of metrics.jsonl over the steps after the first
    --warm-steps (compilation is never inside it: train.py compiles before it
    starts the clock; the first steps still set up gloo's connections);
  - the kernel's bytes per steady-state step: the launcher polls metrics.jsonl
    (one record per step) every few milliseconds and reads the lo counters
    when a step's record appears; a step's bytes are the difference to the
    previous step's reading. The first --warm-steps steps, and every step that
    also evaluated (its record has val_loss), are left out; what came before
    step 1's record (coordinator, compile-time exchanges, the first
    broadcast, step 1) is reported apart as startup bytes;
  - `jcomp.meter.wire`'s bytes for the same compiled step: metrics.jsonl's
    wire_bytes_total is per device, averaged over the mesh, so the link should
    carry it times the number of devices;
  - what TCP carried: the kernel's bytes less 66 header bytes (Ethernet 14,
    IPv4 20, TCP 32 with timestamps) per packet, and the TCP segments
    retransmitted (the namespace's /proc/net/snmp);
  - the collectives per step jcomp.meter.wire counts (metrics' wire_collectives;
    --count-collectives adds it to rows recorded before it was logged);
  - losses per step and validation losses.
Every row runs --repeats times, repeat-major (every rate and policy once, then
again), so that a slow minute on this shared machine lands on one run of each
row rather than on all runs of one; linkprofile.py reads a row as the median
of its runs, and the report shows their spread.
Time to the baseline's loss: at --ttl-rate every policy, the baseline too,
runs again for --ttl-steps steps, evaluating every --ttl-eval-every steps; the
training time (sum of step times, evaluation excluded) until the first
validation loss at or below the baseline's final one in its --steps run at
that rate, or "not reached". All time-to-loss runs share one learning-rate
schedule (cosine over --ttl-steps), so they differ only by policy.

The outer-loop policies (diloco, diloco_f2, streaming, sparseloco: islands are
the two processes, --hops) send across the link only when they sync: their
rows add each sync's time (outer_sync_s, and with outer.delay each merge's,
outer_apply_s, counted in the time to the baseline's loss, where only synced
models' losses count) and its bytes on the link (the step's kernel bytes less a
plain step's) against the meter's (outer_bytes_per_sync). A start carried by
the next step's program (streaming) has no time of its own: that step's holds it.

Results go to --out (JSON, written after every row). A row already there with
the same settings and git commit is skipped, so an interrupted sweep resumes
(rows made with modified tracked files are never reused); rows of other
commits are kept beside the new ones.

This module is the sweep and its command line: the policies and one run's
launch are network_launch.py's, a row's figures and the time to the
baseline's loss network_figures.py's.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile

from experiments.network_figures import summarize, time_to_target
from experiments.network_launch import POLICIES, TOTAL_DEVICES, _flags, launch
from tools.netns import BURST, PREFIX, Namespace, Pair, Unavailable, rate_bits, remove_stale  # noqa: F401
from tools.netns import _run, signals_deferred, unavailable_reason  # noqa: F401

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_OUT = os.path.join("experiments", "results", "network.json")
HOPS_OUT = os.path.join("experiments", "results", "network_hops.json")


# ---------------------------------------------------------------- the sweep

def git_commit() -> tuple[str, bool]:
    """(HEAD, whether tracked files other than the results differ from it: a
    sweep's own rows, written into experiments/results, leave the code clean)."""
    try:
        head = _run("git", "-C", ROOT, "rev-parse", "HEAD").stdout.strip()
        dirty = bool(_run("git", "-C", ROOT, "status", "--porcelain", "--untracked-files=no",
                          "--", ".", ":(exclude)experiments/results").stdout.strip())
        return head, dirty
    except (OSError, subprocess.CalledProcessError):
        return "unknown", True


def plan(args) -> list[dict]:
    """Every row's settings, sweep rows first, then the time-to-loss rows."""
    # A burst other than the default is part of a row's settings (rows without
    # the key ran at BURST).
    common = dict(procs=args.procs, config=args.config, warmup_steps=args.warmup_steps,
                  **({"devices": args.devices} if args.devices != TOTAL_DEVICES else {}),
                  **({"burst": args.burst} if args.burst != BURST else {}),
                  set=dict(args.set), **({"hops": True} if args.hops else {}))
    rows = [dict(common, kind="sweep", rate=r, policy=p, steps=args.steps, eval_every=args.steps,
                 repeat=i)
            for i in range(args.repeats) for r in args.rates for p in args.policies
            if not args.ttl_only]
    if args.ttl_rate:
        # The first repeat keeps the settings of rows from before --ttl-repeats.
        rows += [dict(common, kind="ttl", rate=args.ttl_rate, policy=p, steps=args.ttl_steps,
                      eval_every=args.ttl_eval_every, **({"repeat": i} if i else {}))
                 for i in range(args.ttl_repeats) for p in args.policies]
    return rows


def _load(path):
    if not os.path.exists(path):
        return {"rows": []}
    with open(path) as f:
        return json.load(f)


def _save(path, data):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, allow_nan=False)
    os.replace(tmp, path)


def _line(row) -> str:
    s = row["settings"]
    if "error" in row:
        return f"{s['kind']:>5} {s['rate']:>11} {s['policy']:>8}: FAILED: {row['error'][:300]}"
    k = row["kernel_bytes_per_step"]
    return (f"{s['kind']:>5} {s['rate']:>11} {s['policy']:>8}: step {row['median_step_s']:.3f} s, "
            f"kernel {k / 1e6 if k else float('nan'):.2f} MB/step, meter "
            f"{row['meter_bytes_per_step'] / 1e6:.2f} MB/step (kernel/meter "
            f"{row['kernel_over_meter'] or float('nan'):.3f}, TCP payload/meter "
            f"{row['payload_over_meter'] or float('nan'):.3f}), final loss {row['final_loss']:.4f}"
            + (f", val {row['final_val_loss']:.4f}" if row.get("final_val_loss") else "")
            + f", wall {row['wall_s']:.0f} s")


def sweep(args) -> int:
    commit, dirty = git_commit()
    data = _load(args.out)
    done = {json.dumps(r["settings"], sort_keys=True) for r in data["rows"]
            if r.get("commit") == commit and not r.get("dirty") and "error" not in r}
    todo = [s for s in plan(args) if json.dumps(s, sort_keys=True) not in done]
    print(f"network.py: {len(todo)} runs to do, {len(plan(args)) - len(todo)} already in "
          f"{args.out} for commit {commit[:7]}" + (" (tracked files modified)" if dirty else ""),
          flush=True)
    failed = 0
    remove_stale()
    os.makedirs(args.workroot, exist_ok=True)
    with (Pair() if args.hops else Namespace()) as ns:
        for n, settings in enumerate(todo):
            ns.set_rate(settings["rate"], settings.get("burst", BURST))
            workdir = tempfile.mkdtemp(prefix=f"{settings['policy']}-", dir=args.workroot)
            row = dict(settings=settings, commit=commit, dirty=dirty, qdisc=ns.qdisc(),
                       namespace=ns.name,
                       date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                       loadavg_before=os.getloadavg()[0])
            try:
                raw = launch(ns, settings, workdir, args.timeout, args.port + n, args.xla_flags)
                row.update(summarize(raw, args.warm_steps))
                shutil.rmtree(workdir, ignore_errors=True)
            except (RuntimeError, KeyError, ValueError, StopIteration) as e:
                row["error"] = f"{type(e).__name__}: {e} (logs in {workdir})"
                failed += 1
            row["loadavg_after"] = os.getloadavg()[0]
            data["rows"] = [r for r in data["rows"] if not (
                r["settings"] == settings and (r.get("commit") == commit or "error" in r))] + [row]
            data["warm_steps"] = args.warm_steps
            data["ttl"] = time_to_target(data["rows"], args.ttl_rate) if args.ttl_rate else None
            if data["ttl"]:
                data.setdefault("ttl_by_rate", {})[args.ttl_rate] = data["ttl"]
            _save(args.out, data)
            print(f"[{n + 1}/{len(todo)}] {_line(row)}", flush=True)
    ttl = data.get("ttl")
    if ttl:
        print(f"time to the baseline's val_loss {ttl['target_val_loss']:.4f} at {ttl['rate']}:")
        for name, t in ttl["policies"].items():
            print(f"  {name:>8}: " + (f"{t['time_s']:.1f} s (step {t['step']})" if t["reached"]
                                      else f"not reached in {t['steps_run']} steps"))
    print(f"wrote {args.out}")
    return 1 if failed else 0


def count_collectives(args) -> int:
    """Adds collectives_per_step (collective executions per step, read by jcomp.meter.wire
    from the compiled step) to the rows of --out that lack it: one 2-step run of
    train.py per policy, one process on 8 emulated devices (no socket is opened)."""
    commit, _ = git_commit()
    data = _load(args.out)
    for policy in args.policies:
        rows = [r for r in data["rows"] if r["settings"]["policy"] == policy
                and r["settings"]["config"] == args.config and "error" not in r
                and r.get("collectives_per_step") is None]
        if not rows:
            continue
        with tempfile.TemporaryDirectory(prefix="count-") as workdir:
            cmd = [sys.executable, os.path.join(ROOT, "train.py"), f"--config={args.config}",
                   f"--workdir={workdir}", "--config.train.steps=2", "--config.optim.warmup_steps=1",
                   "--config.train.log_every=1", *_flags(policy, dict(args.set))]
            env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": (
                f"--xla_force_host_platform_device_count={TOTAL_DEVICES} {args.xla_flags}").strip()}
            proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                                  timeout=args.timeout)
            if proc.returncode:
                print(f"network.py: {policy}: {proc.stderr.strip()[-300:]}", file=sys.stderr)
                return 1
            with open(os.path.join(workdir, "metrics.jsonl")) as f:
                static = next(r for r in map(json.loads, f) if "wire_collectives" in r)
        for r in rows:
            if abs(static["wire_bytes_total"] * r["devices"] - r["meter_bytes_per_step"]) > 1:
                print(f"network.py: {policy}: the compiled step now sends other bytes than in "
                      f"its rows; not counted", file=sys.stderr)
                return 1
            r["collectives_per_step"] = static["wire_collectives"]
            r["collectives_counted_at"] = commit
        print(f"{policy}: {static['wire_collectives']:.1f} collectives per step", flush=True)
    _save(args.out, data)
    return 0


def _key_value(item: str):
    key, sep, value = item.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"--set {item!r}: want KEY=VALUE, e.g. train.batch_size=16")
    return key, value


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--procs", type=int, default=2,
                   help="processes of train.py: 2 or 4 (see the module doc for 4); 1: the step "
                        "with nothing between processes")
    p.add_argument("--config", default="configs/base.py")
    p.add_argument("--devices", type=int, default=TOTAL_DEVICES,
                   help="CPU devices in all, split evenly over the processes (the mesh's "
                        "product, set with --set mesh.*)")
    p.add_argument("--steps", type=int, default=14)
    p.add_argument("--warm-steps", type=int, default=2, help="first steps left out of medians")
    p.add_argument("--warmup-steps", type=int, default=2, help="optim.warmup_steps of every run")
    p.add_argument("--rates", nargs="+", default=["unthrottled", "1gbit", "300mbit", "100mbit"])
    p.add_argument("--repeats", type=int, default=3, help="runs of every sweep row")
    p.add_argument("--policies", nargs="+", default=list(POLICIES))
    p.add_argument("--ttl-rate", default="100mbit", help="'' for no time-to-loss runs")
    p.add_argument("--ttl-steps", type=int, default=None, help="default: 2 x --steps")
    p.add_argument("--ttl-eval-every", type=int, default=2)
    p.add_argument("--ttl-repeats", type=int, default=1,
                   help="time-to-loss runs per policy (their median time is reported)")
    p.add_argument("--ttl-only", action="store_true",
                   help="only the time-to-loss runs; their target is the newest baseline "
                        "sweep row at --ttl-rate already in --out, whatever its commit")
    p.add_argument("--set", type=_key_value, action="append", default=[],
                   help="config override KEY=VALUE for every run (e.g. train.batch_size=16)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per run; killed after")
    p.add_argument("--burst", default=BURST,
                   help="tc tbf's bucket (tc's units, > 64kb): it starts full, so a run sends "
                        "up to this much above the rate")
    p.add_argument("--port", type=int, default=23456, help="first coordinator port (in the namespace)")
    p.add_argument("--xla-flags", default="", help="XLA_FLAGS of the train.py processes")
    p.add_argument("--workroot", default=os.path.join(tempfile.gettempdir(), "jcomp-network"))
    p.add_argument("--out", default=None, help=f"default {DEFAULT_OUT}, with --hops {HOPS_OUT}")
    p.add_argument("--hops", action="store_true",
                   help="two namespaces, one per process, joined by a throttled veth: only "
                        "traffic between the processes is throttled (needs --procs 2)")
    p.add_argument("--count-collectives", action="store_true",
                   help="only add collectives_per_step to the rows of --out that lack it")
    args = p.parse_args(argv)
    if args.procs not in (1, 2, 4):
        p.error(f"--procs must be 1, 2 or 4; got {args.procs}")
    if args.hops and args.procs != 2:
        p.error(f"--hops runs one process per namespace, two namespaces: --procs must be 2; "
                f"got {args.procs}")
    if args.devices < args.procs or args.devices % args.procs:
        p.error(f"--devices must be a multiple of --procs={args.procs}; got {args.devices}")
    args.out = args.out or (HOPS_OUT if args.hops else DEFAULT_OUT)
    for name in ("steps", "repeats", "ttl_eval_every", "ttl_repeats", "timeout"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be > 0; got {getattr(args, name)}")
    if not 0 <= args.warm_steps < args.steps - 1:
        p.error(f"--warm-steps must be >= 0 and < --steps - 1; got {args.warm_steps}")
    if not 0 <= args.warmup_steps < args.steps:
        p.error(f"--warmup-steps must be >= 0 and < --steps; got {args.warmup_steps}")
    unknown = [x for x in args.policies if x not in POLICIES]
    if unknown:
        p.error(f"--policies: unknown {unknown}; known: {', '.join(POLICIES)}")
    try:
        for r in args.rates + ([args.ttl_rate] if args.ttl_rate else []):
            rate_bits(r)
    except ValueError as e:
        p.error(str(e))
    if args.ttl_rate and args.ttl_rate not in args.rates:
        p.error(f"--ttl-rate {args.ttl_rate} must be one of --rates (its baseline sets the target)")
    args.ttl_steps = args.ttl_steps or 2 * args.steps
    if not os.path.isabs(args.out):
        args.out = os.path.join(os.getcwd(), args.out)
    return args


def _raise_exit(signum, frame):
    raise SystemExit(128 + signum)  # unwinds through the finally that removes the namespace


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.count_collectives:
        return count_collectives(args)
    reason = unavailable_reason()
    if reason:
        print(f"network.py: error: {reason}", file=sys.stderr)
        return 2
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _raise_exit)
    try:
        return sweep(args)
    except Unavailable as e:
        print(f"network.py: error: cannot make a network namespace: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("network.py: interrupted; its processes are killed and its namespace removed "
              "(rerun the same command to resume)", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
