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
link, which report_network's compression.auto section takes as the compute it
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
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

from jcomp.train.auto import decide as auto_lib
from tools.netns import BURST, PREFIX, Namespace, Pair, Unavailable, rate_bits, remove_stale  # noqa: F401
from tools.netns import _run, signals_deferred, unavailable_reason  # noqa: F401

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_OUT = os.path.join("experiments", "results", "network.json")
HOPS_OUT = os.path.join("experiments", "results", "network_hops.json")
TOTAL_DEVICES = 8
OUTER = {"outer.every": "10", "outer.lr": "1.0", "outer.momentum": "0.0"}
POLICIES = {  # name -> config.compression overrides (mesh.* and outer.*: those sections')
    "baseline": {"policy": "baseline"},
    "naive": {"policy": "naive"},
    # The preset of the commit that runs it: report_network.HYBRID_PRESETS says what
    # it was at each commit (before 3c5f7d1, the paper's recipe, now hybrid_paper).
    "hybrid": {"policy": "hybrid"},
    # The hybrid preset within compression.auto's default budget: int8, not
    # int4:rot, on the tensor messages (DEFAULT_LADDERS' "act" and "act_grad").
    "hybrid_act8": {"policy": "hybrid", "tensor.act": "int8", "tensor.act_grad": "int8"},
    # The 200-step runs' best setting, which meets both targets at a quarter of the
    # bytes: the paper's recipe with int8 gradients and int4 tensor act_grad.
    "best": {"policy": "hybrid_paper", "error_feedback": "off", "data.grad": "int8",
             "tensor.act_grad": "int4"},
    # The seeds suite's mx_nvfp4rot (experiments/convergence.py): nvfp4:rot tensor
    # messages and pipeline backward sends, for the preset rule's speed condition.
    "mx_nvfp4rot": {"policy": "baseline", "error_feedback": "off", "data.param": "int8",
                    "data.grad": "int4:rot", "tensor.act": "nvfp4:rot",
                    "tensor.act_grad": "nvfp4:rot", "pipeline.act": "int8",
                    "pipeline.act_grad": "nvfp4"},
    # Per hop: the data axis split into a slow hop between the processes (dcn)
    # and a fast one inside each; only what crosses the slow hop is coded.
    "perhop": {"policy": "baseline", "mesh.dcn_data": "2", "dcn.grad": "int4:rot",
               "dcn.param": "int8"},
    # The hybrid preset with its data messages moved to the slow hop (raw on the
    # fast one): against "hybrid" it differs only in where the data axis codes,
    # so the two compare the hops alone. configs/multinode.py's compression.
    "hybrid_perhop": {"policy": "hybrid", "mesh.dcn_data": "2", "data.grad": "none",
                      "data.param": "none", "dcn.grad": "int4:rot", "dcn.param": "int8"},
    # An outer loop across the slow hop: each process an island that trains
    # alone, nothing coded inside; every 10 steps the islands exchange int4:rot
    # pseudo-gradients and step to their mean (outer lr 1, no momentum: the
    # convergence suite's choice, experiments/convergence.py OUTER_RUNS).
    "diloco": {"policy": "baseline", "mesh.dcn_data": "2", **OUTER,
               "outer.codec": "int4:rot", "outer.error_feedback": "off"},
    # Streaming DiLoCo's two halves: the model in 2 fragments of 2 layers, one
    # syncing every 5 steps, blocking (diloco_f2) or started after its step and
    # merged 1 step later, its exchange carried by the next step's program
    # (streaming: outer.delay=1, the islands keep outer.mix=0.5 of their own).
    "diloco_f2": {"policy": "baseline", "mesh.dcn_data": "2", **OUTER, "outer.fragments": "2",
                  "outer.codec": "int4:rot", "outer.error_feedback": "off"},
    "streaming": {"policy": "baseline", "mesh.dcn_data": "2", **OUTER, "outer.fragments": "2",
                  "outer.delay": "1", "outer.codec": "int4:rot",
                  "outer.error_feedback": "off"},
    # The same with SparseLoCo's pseudo-gradients: top-k 3% with error feedback.
    "sparseloco": {"policy": "baseline", "mesh.dcn_data": "2", **OUTER,
                   "outer.codec": "topk:0.03", "outer.error_feedback": "on"},
    # compression.auto: the codec per axis and kind chosen at start from a probe of
    # the run's own mesh (jcomp.train.auto.decide), which with two processes weighs the
    # per-hop split (mesh.dcn_data=2) too; auto_perhop is given that split. As
    # configs/auto.py, the candidates the model cannot tell apart are timed for
    # 6 steps each before training (compression.trial).
    "auto": {"policy": "baseline", "auto": "on", "trial": "6"},
    "auto_perhop": {"policy": "baseline", "mesh.dcn_data": "2", "auto": "on", "trial": "6"},
    # The same allowed an outer loop syncing every 10 steps (compression.budget
    # outer=10: the loss of diloco's setting accepted), weighed beside the routes.
    "auto_outer": {"policy": "baseline", "auto": "on", "trial": "6", "budget": "outer=10"},
}


# ---------------------------------------------------------------- one run

def _flags(policy: str, overrides: dict) -> list[str]:
    out = []
    for key, value in POLICIES[policy].items():
        section = "" if key.startswith(("mesh.", "outer.")) else "compression."
        out.append(f"--config.{section}{key}={value}")
    out += [f"--config.{k}={v}" for k, v in overrides.items()]
    return out


def _kill(procs):
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for p in procs:
        p.wait()


def _new_records(path, state):
    """Complete lines appended to metrics.jsonl since the last call."""
    try:
        with open(path, "rb") as f:
            f.seek(state["offset"])
            chunk = f.read()
    except FileNotFoundError:
        return []
    end = chunk.rfind(b"\n") + 1
    state["offset"] += end
    return [json.loads(line) for line in chunk[:end].splitlines() if line.strip()]


def launch(ns: Namespace, settings: dict, workdir: str, timeout: float, port: int,
           xla_flags: str = "") -> dict:
    """Runs train.py as settings['procs'] processes inside `ns`; returns the raw
    measurements (records, lo counters at each step's record, times)."""
    n = settings["procs"]
    cmd = [sys.executable, os.path.join(ROOT, "train.py"), f"--config={settings['config']}",
           f"--workdir={workdir}", f"--config.train.steps={settings['steps']}",
           "--config.train.log_every=1", f"--config.train.eval_every={settings['eval_every']}",
           f"--config.optim.warmup_steps={settings['warmup_steps']}",
           f"--config.checkpoint.every={settings['steps']}",
           *_flags(settings["policy"], settings["set"]),
           f"--coordinator_address={ns.coordinator_host}:{port}", f"--num_processes={n}",
           f"--cpu_devices={settings.get('devices', TOTAL_DEVICES) // n}"]
    env = {**os.environ, "XLA_FLAGS": xla_flags, "JAX_PLATFORMS": "cpu"}
    for name in ("JCOMP_COORDINATOR", "JCOMP_NUM_PROCESSES", "JCOMP_PROCESS_ID"):
        env.pop(name, None)
    metrics = os.path.join(workdir, "metrics.jsonl")
    state, records, marks = {"offset": 0}, [], {}
    procs = []
    before = ns.counters()
    t0 = time.monotonic()
    try:
        for i in range(n):
            log = open(os.path.join(workdir, f"process{i}.log"), "w")
            with signals_deferred():  # a signal inside Popen would lose the child
                procs.append(subprocess.Popen(ns.exec_args(cmd + [f"--process_id={i}"], process=i),
                                              cwd=ROOT, env=env, stdout=log,
                                              stderr=subprocess.STDOUT, start_new_session=True))
            log.close()
        while True:
            new = _new_records(metrics, state)
            if new:
                reading = (ns.counters(), time.monotonic() - t0)
                for r in new:
                    if "step" in r:  # not compression.auto's decision record
                        marks[r["step"]] = reading
                records += new
            codes = [p.poll() for p in procs]
            if all(c is not None for c in codes):
                break
            if any(c not in (None, 0) for c in codes):
                time.sleep(2)  # let the other process write its error too
                raise RuntimeError(f"train.py exited with {codes}")
            if time.monotonic() - t0 > timeout:
                raise RuntimeError(f"timed out after {timeout:.0f} s "
                                   f"(at step {max(marks, default=0)} of {settings['steps']})")
            time.sleep(0.005)
        records += _new_records(metrics, state)
        if any(p.returncode for p in procs):
            raise RuntimeError(f"train.py exited with {[p.returncode for p in procs]}")
    except RuntimeError as e:
        tail = ""
        for i in range(len(procs)):
            with open(os.path.join(workdir, f"process{i}.log"), errors="replace") as f:
                lines = [l for l in f.read().splitlines() if l.strip() and "Gloo" not in l]
            tail += f" | process {i}: {' / '.join(lines[-3:])}"
        raise RuntimeError(f"{e}{tail}") from None
    finally:
        _kill(procs)
    return dict(records=records, marks=marks, before=before, after=ns.counters(),
                wall_s=time.monotonic() - t0, header_bytes=ns.header_bytes())


def summarize(raw: dict, warm_steps: int) -> dict:
    """A row's figures from launch()'s measurements (see the module doc)."""
    by_step, auto = {}, None
    for r in raw["records"]:
        if "step" not in r:
            auto = r.get("auto", auto)  # compression.auto's decision, logged first
            continue
        by_step[r["step"]] = {**by_step.get(r["step"], {}), **r}
    steps = sorted(by_step)
    last = steps[-1]
    static = next(r for r in raw["records"] if "wire_bytes_total" in r)
    devices = int(static["devices"])
    marks = raw["marks"]
    evals = {s for s in steps if "val_loss" in by_step[s]}
    window = [s for s in steps if s > warm_steps and s not in evals and s - 1 in marks]
    deltas = [marks[s][0][0] - marks[s - 1][0][0] for s in window]
    packets = [marks[s][0][1] - marks[s - 1][0][1] for s in window]
    retrans = [marks[s][0][2] - marks[s - 1][0][2] for s in window]
    times = [by_step[s]["step_time_s"] for s in steps if s > warm_steps]
    meter = float(static["wire_bytes_total"]) * devices
    kernel = sum(deltas) / len(deltas) if deltas else None
    per_packet = sum(packets) / len(packets) if packets else None
    # What TCP carried: the kernel's bytes less every packet's headers (the ACKs'
    # included), i.e. gloo's payload, its own framing and any retransmission.
    payload = kernel - raw["header_bytes"] * per_packet if deltas else None
    return dict(
        median_step_s=statistics.median(times), step_times_s=[by_step[s]["step_time_s"] for s in steps],
        losses=[by_step[s]["loss"] for s in steps],
        val_losses={str(s): by_step[s]["val_loss"] for s in sorted(evals)},
        # val_loss is the exact forward's since row-local blocks (train.py writes
        # val_loss_compressed beside it); rows without this mark were read
        # through a compressed forward whose blocks spanned tokens.
        exact_eval=True,
        final_loss=by_step[last]["loss"], final_val_loss=by_step[last].get("val_loss"),
        devices=devices,
        wire_bytes_per_device={k[len("wire_bytes_"):]: v for k, v in static.items()
                               if k.startswith("wire_bytes_")},
        collectives_per_step=static.get("wire_collectives"),
        meter_bytes_per_step=meter, kernel_bytes_per_step=kernel,
        # With two hops (--hops) the link carries the slow hop only: the meter's
        # 'dcn' bytes where the mesh has that axis, or an outer loop's syncs
        # averaged over H.
        meter_slow_hop_bytes_per_step=(float(static["wire_bytes_dcn"]) * devices
                                       if "wire_bytes_dcn" in static else
                                       float(static["outer_bytes_per_step"]) * devices
                                       if "outer_bytes_per_step" in static else None),
        kernel_over_meter=kernel / meter if kernel is not None and meter else None,
        kernel_bytes_by_step=dict(zip(map(str, window), deltas)),
        kernel_packets_per_step=per_packet, header_bytes_per_packet=raw["header_bytes"],
        tcp_payload_per_step=payload,
        payload_over_meter=payload / meter if payload is not None and meter else None,
        retransmitted_segments_per_step=sum(retrans) / len(retrans) if retrans else None,
        kernel_window_steps=window,
        startup_bytes=marks[steps[0]][0][0] - raw["before"][0] if steps[0] in marks else None,
        after_last_step_bytes=raw["after"][0] - marks[last][0][0] if last in marks else None,
        wall_s=raw["wall_s"], first_step_at_s=marks[steps[0]][1] if steps[0] in marks else None,
        **_outer_figures(by_step, static, window, dict(zip(window, deltas)), devices),
        **({"auto": _auto_figures(auto)} if auto else {}))


def _auto_figures(decision: dict) -> dict:
    """What compression.auto chose for a row: per entry the codec and the link it
    priced, and the predicted communication seconds per step against raw."""
    return dict(codecs={e: v["codec"] for e, v in decision["entries"].items()},
                links={e: [v["latency_s"], v["bytes_per_s"]]
                       for e, v in decision["entries"].items()},
                dcn_data=decision.get("dcn_data", 1), outer=decision.get("outer"),
                routes={k: v["seconds"] for k, v in decision.get("routes", {}).items()},
                route_links={k: v["links"] for k, v in decision.get("routes", {}).items()},
                codec_s_per_byte={c: v["encode_s_per_byte"] + v["decode_s_per_byte"]
                                  for c, v in decision["profile"]["codecs"].items()},
                predicted_s=decision["seconds"], predicted_raw_s=decision["raw_seconds"],
                # compression.trial: each candidate's measured step, the model's
                # prediction with compute from the uncompressed trial, and the taken
                # one's trial time (the decision's predicted step).
                **({"trial": decision["trial"], "trial_step_s": decision["step_s"]}
                   if decision.get("trial") else {}),
                table=auto_lib.table(decision))  # as train.py printed it


def _outer_figures(by_step, static, window, delta, devices) -> dict:
    """An outer loop's syncs (none for an every-step run): each sync's own time
    by step (with outer.delay, each merge's too; a start carried by the next
    step has none of its own, that step's time holds it, but one on a thread
    beside the step's is timed there: outer_start_s_by_step), and its
    bytes on the link (the kernel bytes of the step that sent it less the median
    step without a sync) against the meter's (outer_bytes_per_sync per device,
    read from the compiled sync program, times the devices)."""
    if "outer_bytes_per_step" not in static:
        return {}
    alone = [s for s in sorted(by_step) if "outer_sync_s" in by_step[s]]
    carried = [s for s in sorted(by_step) if "outer_carried" in by_step[s]]
    synced = sorted(alone + carried)  # the steps whose kernel bytes hold a sync
    plain = [delta[s] for s in window if s not in synced]
    rest = statistics.median(plain) if plain else None
    measured = [s for s in synced if s in delta and rest is not None]
    kernel = sum(delta[s] - rest for s in measured)
    # A carried start's meter bytes are on the record of the step it was due after.
    sender = {s: (s - 1 if s in carried else s) for s in measured}
    meter = sum(by_step[sender[s]]["outer_bytes_per_sync"] * devices for s in measured)
    applies = {str(s): r["outer_apply_s"] for s, r in sorted(by_step.items())
               if "outer_apply_s" in r}
    threaded = {str(s): by_step[s]["outer_start_s"] for s in carried
                if "outer_start_s" in by_step[s]}
    return dict(outer_sync_s_by_step={str(s): by_step[s]["outer_sync_s"] for s in alone},
                **({"outer_apply_s_by_step": applies} if applies else {}),
                **({"outer_start_s_by_step": threaded} if threaded else {}),
                **({"outer_carried_steps": carried} if carried else {}),
                kernel_bytes_per_step_without_sync=rest,
                kernel_sync_bytes=kernel if measured else None,
                meter_sync_bytes=meter if measured else None,
                kernel_over_meter_sync=kernel / meter if measured and meter else None)


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


def time_to_target(rows: list[dict], rate: str) -> dict | None:
    """At `rate`: the baseline's final val_loss in its sweep run and, per policy,
    the training time (sum of step times) to the first validation loss at or
    below it in that policy's time-to-loss run (the baseline's own sweep run
    where it has none); with several time-to-loss runs of the newest commit
    (--ttl-repeats), the median of their times (times_s: each run's). Each is
    the newest such row, whatever its commit: training is deterministic, so a
    loss does not depend on when it was run.
    A compressed policy's row counts only if it was evaluated exactly
    (`exact_eval`): earlier ones read the loss through a forward whose blocks
    spanned tokens, which leaked the next token."""
    ok = sorted((r for r in rows if r["settings"]["rate"] == rate and "error" not in r
                 and (r.get("exact_eval") or r["settings"]["policy"] == "baseline")),
                key=lambda r: r["date"], reverse=True)
    base = next((r for r in ok if r["settings"]["kind"] == "sweep"
                 and r["settings"]["policy"] == "baseline" and r.get("final_val_loss")), None)
    if base is None:
        return None
    target = base["final_val_loss"]
    out = {"rate": rate, "target_val_loss": target, "target_commit": base["commit"],
           "policies": {}}
    for r in sorted(ok, key=lambda r: r["settings"]["kind"] != "ttl"):  # stable: newest first
        name = r["settings"]["policy"]
        if name in out["policies"] or (r["settings"]["kind"] != "ttl" and r is not base):
            continue
        runs = [r] if r is base else [
            x for x in ok if x["settings"]["kind"] == "ttl" and x["commit"] == r["commit"]
            and {**x["settings"], "repeat": 0} == {**r["settings"], "repeat": 0}]
        every = int(POLICIES.get(name, {}).get("outer.every", 0))
        hits = [_hit(x, target, every) for x in runs]
        times = [t for _, t in hits if t is not None]
        out["policies"][name] = dict(
            kind=r["settings"]["kind"], commit=r["commit"],
            steps_run=r["settings"]["steps"], reached=hits[0][0] is not None, step=hits[0][0],
            time_s=statistics.median(times) if times else None,
            **({"times_s": times} if len(runs) > 1 else {}),
            best_val_loss=min((v for s, v in r["val_losses"].items()
                               if not (every and int(s) % every)), default=None))
    return out


def _hit(r: dict, target: float, every: int) -> tuple:
    """(the first step whose val_loss is at or below `target`, the training time
    to it), or (None, None)."""
    # Between an outer loop's syncs each island holds its own model: only a
    # synced one counts (train.eval_every a multiple of outer.every).
    hit = next((int(s) for s, v in sorted(r["val_losses"].items(), key=lambda kv: int(kv[0]))
                if v <= target and not (every and int(s) % every)), None)
    if hit is None:
        return None, None
    syncs = {**r.get("outer_sync_s_by_step", {})}
    for s, t in r.get("outer_apply_s_by_step", {}).items():  # with outer.delay
        syncs[s] = syncs.get(s, 0.0) + t
    # An outer loop's time is its inner steps' and its syncs' up to the hit.
    return hit, sum(r["step_times_s"][:hit]) + sum(t for s, t in syncs.items() if int(s) <= hit)


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
