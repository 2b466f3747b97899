"""One run of experiments/network.py's rig: the policies it sweeps and train.py
launched as N processes inside a network namespace.

POLICIES maps each policy name to its config overrides, _flags() turns one
into train.py's flags, and launch() runs train.py as settings['procs']
processes in a tools.netns namespace (or Pair), polling metrics.jsonl and
reading the link's counters at each step's record; it returns those raw
measurements, which network_figures.summarize() turns into a row.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from tools.netns import Namespace, signals_deferred

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
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
    # convergence suite's choice, experiments/convergence_specs.py OUTER_RUNS).
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
