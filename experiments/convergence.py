"""Convergence of compressed training on real text, against the uncompressed baseline.

    python -m experiments.convergence [--suite main|ablation|sweep|variants|places|seeds|all]
                                      [--steps 150] [--seeds 0 1 2]
                                      [--config configs/base.py] [--only NAME ...]
                                      [--set mesh.data=4 ...]
                                      [--out experiments/results/convergence] [--quick]

Every run is `python train.py` in a subprocess with its own workdir under
--out: the same config, seed (so the same initial weights), data order and
(2, 2, 2) mesh, differing only in the compression settings. Suites:

  main      baseline, naive, hybrid (the presets of `jcomp.gpt.policy`)
  ablation  one axis compressed at a time, as hybrid compresses it: data
            (grad=int4 with error feedback, param=int8), tensor (act and
            act_grad int8), pipeline (act and act_grad int8)
  sweep     data.grad alone at int8, int4, int2, topk:0.1, topk:0.01, each with
            and without error feedback, and powersgd:rank=4; tensor and
            pipeline act/act_grad together at int8, int4, int2; tensor
            act/act_grad through a learned autoencoder (ae:dim=32)
  variants  hybrid with other data-gradient and activation-gradient codecs
  places    int2 on tensor (act, act_grad) in every layer, in layers 0-1 only
            and in layers 2-3 only; int2 on pipeline from both stages, from
            stage 0 only and from stage 1 only (compression.layers / .stages)
  ef        why error feedback hurts with AdamW: int4 data gradients with and
            without feedback, each also after a 50-step uncompressed warm-up
            (1-bit Adam's remedy), and the same codec under SGD with momentum
            (optim.name=sgd, lr 0.3), whose update is linear in the gradient.
            lr 0.3 is not tuned: with clip_norm 1 and momentum 0.9 it gives
            steps of about AdamW's size at lr 3e-3 on this model; it trains
            far more slowly than AdamW, so compare SGD runs with each other
  seeds     the settings the README's claims rest on, meant for several seeds
            and >= 600 steps: the presets, the paper's hybrid recipe spelled
            out (so it survives a change of the preset), int4 against int4:rot
            on data gradients, and the candidates for the hybrid preset
  hops      the slow hop alone (mesh.dcn_data=2): data gradients int4:rot and
            parameters int8 between the two halves of the data axis, raw
            inside each, against the same codecs over the whole data axis;
            and compression.auto's choices at 100 Mbit/s on the two-hop rig
            that code more than that (hop_auto100mbit, hop_auto_param8,
            hop_auto_act8, hop_auto_act8_param8: int8 inside as well).
            Needs a data axis of >= 4 (a fast hop of >= 2): run it with
            --set mesh.data=4 --set mesh.tensor=2 --set mesh.pipeline=1
            and an --out of its own, so that its baseline has that mesh too
  outer     an outer loop between the two halves of the data axis (DiLoCo,
            mesh.dcn_data=2; the outer step the islands' mean, lr 1 without
            momentum, and DiLoCo's Nesterov (0.7, 0.9) at H=10 beside it): islands
            sync every 10 and every 50 steps, pseudo-gradients sent raw,
            int4:rot, or top-k 3% with error feedback; SparseLoCo every 10
            steps (top 64 or 256 of every 4096-entry chunk, 2-bit values,
            residual decay 0.95; the packed coder at k=128 and 256, and at
            k=256 streamed: 2 fragments, merged at once or one step late);
            streaming, fragments as blocks of layers
            synced in turn (every 50 or every 10 steps, in 2 fragments,
            int4:rot); raw pseudo-gradients at H=10 under outer (lr, Nesterov
            momentum) (0.5, 0.5), (0.3, 0.7) and (1.0, 0.9); and hop_raw, the every-step run with two hops and nothing coded,
            whose bytes across the slow hop are the baseline's. Same mesh as
            hops: run it with hops' --set flags into hops' --out

--set KEY=VALUE (repeatable) sets a config field for every run of the
invocation, the baseline included: --set mesh.data=4 trains every run on
that mesh. Give such an invocation its own --out: gaps are taken against
the baseline found there.

--seeds S ... runs every chosen setting once per seed (config field `seed`: it
sets the initial weights and the data order alike), seed-major, so that an
interrupted suite has whole seeds done. Seed 0 keeps the workdir name runs
had before seeds (NAME-STEPSsteps); seed S > 0 is NAME-STEPSsteps-seedS.
With several seeds, summary.json's `settings` gives per setting the mean and
standard deviation of the final val_loss and the paired gap to the baseline
of the same seed: its mean, standard deviation and 95% Student-t interval.

Every suite also runs the baseline, the reference for gaps and byte ratios.
A finished run (its metrics.jsonl, or its entry in runs.jsonl, has a record of
the last step) is skipped; an unfinished one is rerun, and train.py resumes it
from its checkpoint. Once a run finishes its checkpoints are deleted
(--keep-checkpoints keeps them). The step count is part of each workdir's
name, so runs of different lengths never mix.

`runs.jsonl` in --out (experiments/runlog.py) keeps, per run, its commit and
the metrics the summary and plots are computed from: it is what git keeps of
a study, the run folders are not committed. With --summarize-only it stands in
for every run whose folder is absent.

`summary.json` in --out covers every finished run found there, per run:
final and best val_loss, the gap of the final val_loss to the baseline's in
percent, bytes one device sends per step over each mesh axis and in total
(the first metrics record, which `jcomp.train.loop` fills from the compiled
step), and the ratio of that total to the baseline's. Loss curves
(`jcomp.train.run.metrics.plot`) go to main_loss.png, sweep_grad_loss.png and
sweep_act_loss.png when their runs exist.

--quick trains configs/tiny.py for a few steps (baseline and hybrid): a
smoke test of this script, not a measurement.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import time

from experiments import runlog
from experiments import seeds as seeds_lib
from jcomp.train.run import faults
from jcomp.train.run import metrics as metrics_lib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

AXES = ("data", "tensor", "pipeline")
SUITES = ("main", "ablation", "sweep", "variants", "places", "seeds", "ef", "hops", "outer")
GRAD_SWEEP = ("int8", "int4", "int4:rot", "int2", "topk:0.1", "topk:0.01")
ACT_SWEEP = ("int8", "int4", "int2")
PSGD = "powersgd:rank=4"
PLACES_CODEC = "int2"
AE_DIM = 32  # a quarter of configs/base.py's d_model: int8's byte ratio, in float32
COMMIT_FILE = runlog.COMMIT_FILE
DEFAULT_OUT = os.path.join("experiments", "results", "convergence")
QUICK = dict(config="configs/tiny.py", steps=4, eval_every=2, runs=("baseline", "hybrid"))


def _tp_act(spec: str) -> dict:
    return {f"{a}.{k}": spec for a in ("tensor", "pipeline") for k in ("act", "act_grad")}


# (every, fragments, codec, error feedback, slug, outer lr, outer momentum[, delay]) of the
# outer suite's runs. sparseloco_k* are the runs made with the uint16-position,
# three-level coder (coder=index), sparseloco_packed_k* those of the packed one. The outer step is the islands' mean (lr 1, no momentum):
# at H=10, the first 120 steps of seed 0 reached val_loss 1.970 so, against
# 2.090 with Nesterov momentum 0.5 and 2.084 with DiLoCo's (lr 0.7, momentum
# 0.9), whose two "nesterov" runs here show what it does over 600 steps.
OUTER_RUNS = tuple((h, 1, codec, ef, slug, 1.0, 0.0) for h in (10, 50)
                   for codec, ef, slug in (("none", "off", "none"), ("int4:rot", "off", "int4rot"),
                                           ("topk:0.03", "on", "topk3_ef"))) \
    + tuple((h, 2, "int4:rot", "off", "int4rot", 1.0, 0.0) for h in (50, 10)) \
    + tuple((10, 1, f"sparseloco:k={k}:chunk=4096:beta=0.95:coder=index", "on",
             f"sparseloco_k{k}", 1.0, 0.0) for k in (64, 256)) \
    + tuple((10, 1, f"sparseloco:k={k}:chunk=4096:beta=0.95", "on",
             f"sparseloco_packed_k{k}", 1.0, 0.0) for k in (128, 256)) \
    + tuple((10, 1, codec, "off", f"nesterov_{slug}", 0.7, 0.9)
            for codec, slug in (("none", "none"), ("int4:rot", "int4rot"))) \
    + tuple((10, 1, "none", "off", f"lr{lr:g}_m{m:g}_none", lr, m)
            for lr, m in ((0.5, 0.5), (0.3, 0.7), (1.0, 0.9)))
# Streaming SparseLoCo (packed coder, k=256): 2 fragments synced in turn, each
# merged at once (delay 0) or one step after its sync started (delay 1, the
# islands keeping outer.mix=0.5 of their own).
OUTER_RUNS = tuple(r + (0,) for r in OUTER_RUNS) + tuple(
    (10, 2, "sparseloco:k=256:chunk=4096:beta=0.95", "on", "sparseloco_packed_k256", 1.0, 0.0, d)
    for d in (0, 1))
# The outer lr x momentum table (docs/experiments.md) is outer_h10_none (lr 1,
# momentum 0), the nesterov_none run (DiLoCo's 0.7, 0.9) and these three.
SGD_FLAGS = ("--config.optim.name=sgd", "--config.optim.lr=0.3")
EF_RUNS = ("baseline", "grad_int4_efon", "grad_int4_efoff")
PAPER_HYBRID = {"data.grad": "int4", "data.param": "int8", **_tp_act("int8")}
# The settings the README's loss claims rest on, run at several seeds.
SEED_RUNS = ("baseline", "naive", "hybrid_paper", "hybrid_grad_int8_tensor_ag_int4",
             "grad_int4_efoff", "grad_int4rot_efoff", "hybrid_rot4", "hybrid_rot4_grad_rot4",
             "hybrid_rot4_pipe_int8", "mx_mxfp4rot", "mx_nvfp4", "mx_nvfp4rot")


def run_specs() -> list[dict]:
    """Every known run: {name, suite, group, policy, overrides {"axis.kind": codec},
    error_feedback "auto"|"on"|"off"}. `group` names the plot a run belongs to."""
    runs = [dict(name=p, suite="main", group="main", policy=p, overrides={}, error_feedback="auto")
            for p in ("baseline", "naive", "hybrid")]
    # The CCGrid 2024 recipe, spelled out so that the name keeps its meaning
    # whatever the hybrid preset becomes.
    runs.append(dict(name="hybrid_paper", suite="main", group="main", policy="baseline",
                     overrides=PAPER_HYBRID, error_feedback="on"))
    for axis, ov in (("data", {"data.grad": "int4", "data.param": "int8"}),
                     ("tensor", {"tensor.act": "int8", "tensor.act_grad": "int8"}),
                     ("pipeline", {"pipeline.act": "int8", "pipeline.act_grad": "int8"})):
        runs.append(dict(name=f"only_{axis}", suite="ablation", group="ablation", policy="baseline",
                         overrides=ov, error_feedback="on" if axis == "data" else "off"))
    for spec in GRAD_SWEEP:
        for ef in ("on", "off"):
            runs.append(dict(name=f"grad_{_slug(spec)}_ef{ef}", suite="sweep", group="sweep_grad",
                             policy="baseline", overrides={"data.grad": spec}, error_feedback=ef))
    runs.append(dict(name=f"grad_{_slug(PSGD)}", suite="sweep", group="sweep_grad",
                     policy="baseline", overrides={"data.grad": PSGD}, error_feedback="on"))
    for spec in ACT_SWEEP:
        runs.append(dict(name=f"act_{_slug(spec)}", suite="sweep", group="sweep_act",
                         policy="baseline", overrides=_tp_act(spec), error_feedback="off"))
    # The learned autoencoder codes tensor activations (and their gradients) only.
    runs.append(dict(name=f"act_ae{AE_DIM}", suite="sweep", group="sweep_act", policy="baseline",
                     overrides={f"tensor.{k}": f"ae:dim={AE_DIM}" for k in ("act", "act_grad")},
                     error_feedback="off"))
    # hybrid with other data-gradient codecs: the candidates for a hybrid that keeps
    # the baseline's loss within a quarter of its bytes.
    for name, extra, ef in (("hybrid_psgd", {"data.grad": PSGD}, "on"),
                            ("hybrid_grad_int8", {"data.grad": "int8"}, "off"),
                            ("hybrid_grad_int8_pipe_ag_int4",
                             {"data.grad": "int8", "pipeline.act_grad": "int4"}, "off"),
                            ("hybrid_grad_int8_tensor_ag_int4",
                             {"data.grad": "int8", "tensor.act_grad": "int4"}, "off")):
        runs.append(dict(name=name, suite="variants", group="main", policy="baseline",
                         overrides={**PAPER_HYBRID, **extra}, error_feedback=ef))
    # Which layers and stages to compress: int2 (strong enough to hurt in a short
    # run) everywhere on one axis, then on half of its layers or stages.
    half = {"tensor": ("layers", ("0-1", "2-3")), "pipeline": ("stages", ("0", "1"))}
    for axis, (place, parts) in half.items():
        codec = {f"{axis}.{k}": PLACES_CODEC for k in ("act", "act_grad")}
        runs.append(dict(name=f"{axis}_{PLACES_CODEC}", suite="places", group="places",
                         policy="baseline", overrides=codec, error_feedback="off"))
        for part in parts:
            where = {f"{place}.{axis}.{k}": part for k in ("act", "act_grad")}
            runs.append(dict(name=f"{axis}_{PLACES_CODEC}_{place}_{part}", suite="places",
                             group="places", policy="baseline", overrides={**codec, **where},
                             error_feedback="off"))
    # Error feedback: a warm-up before compression, and a linear optimizer.
    for ef in ("on", "off"):
        runs.append(dict(name=f"grad_int4_ef{ef}_warm50", suite="ef", group="ef",
                         policy="baseline", overrides={"data.grad": "int4", "warmup_steps": "50"},
                         error_feedback=ef))
    for name, ov, ef in (("sgd_baseline", {}, "auto"), ("sgd_grad_int4_efon", {"data.grad": "int4"}, "on"),
                         ("sgd_grad_int4_efoff", {"data.grad": "int4"}, "off")):
        runs.append(dict(name=name, suite="ef", group="ef", policy="baseline", overrides=ov,
                         error_feedback=ef, extra=SGD_FLAGS))
    # Candidates for the hybrid preset at <= 1/6 of the baseline's bytes: int4 with
    # a Hadamard rotation on every model-parallel message.
    for name, extra in (("hybrid_rot4", {"data.grad": "int8"}),
                        ("hybrid_rot4_grad_rot4", {"data.grad": "int4:rot"})):
        runs.append(dict(name=name, suite="variants", group="main", policy="baseline",
                         overrides={"data.param": "int8", **extra, **_tp_act("int4:rot")},
                         error_feedback="off"))
    # The same with int8 on the pipeline sends, whose int4:rot saves 2% of the
    # baseline's bytes: with it, the network sweep's hybrid was 1.07x the
    # baseline's step on an unthrottled link (0158114), where codec time is not
    # hidden behind transfer.
    runs.append(dict(name="hybrid_rot4_pipe_int8", suite="variants", group="main",
                     policy="baseline", error_feedback="off",
                     overrides={"data.param": "int8", "data.grad": "int4:rot",
                                "tensor.act": "int4:rot", "tensor.act_grad": "int4:rot",
                                "pipeline.act": "int8", "pipeline.act_grad": "int8"}))
    # Microscaling formats on the 4-bit messages, at <= 1/6 of the baseline's
    # bytes. All-MX: mxfp4 data gradients, mxfp4:rot tensor messages, mxfp8
    # pipeline sends. NVFP4 (4.75 bits per element on rows of 128, with its
    # f32 row scale, against int4:rot's 4.25) fits 1/6 only with the pipeline's
    # backward sends in nvfp4 too; its two settings differ only in :rot.
    runs.append(dict(name="mx_mxfp4rot", suite="variants", group="main", policy="baseline",
                     error_feedback="off",
                     overrides={"data.param": "int8", "data.grad": "mxfp4",
                                "tensor.act": "mxfp4:rot", "tensor.act_grad": "mxfp4:rot",
                                "pipeline.act": "mxfp8", "pipeline.act_grad": "mxfp8"}))
    for name, fp4 in (("mx_nvfp4", "nvfp4"), ("mx_nvfp4rot", "nvfp4:rot")):
        runs.append(dict(name=name, suite="variants", group="main", policy="baseline",
                         error_feedback="off",
                         overrides={"data.param": "int8", "data.grad": "int4:rot",
                                    "tensor.act": fp4, "tensor.act_grad": fp4,
                                    "pipeline.act": "int8", "pipeline.act_grad": "nvfp4"}))
    # Per hop: the data messages coded on the slow hop alone (raw on the fast
    # one) against the same codecs on the whole data axis. The rig's "perhop"
    # policy (experiments/network.py) is hop_perhop.
    flat = {"data.grad": "int4:rot", "data.param": "int8"}
    runs.append(dict(name="hop_flat", suite="hops", group="main", policy="baseline",
                     overrides=flat, error_feedback="off"))
    runs.append(dict(name="hop_perhop", suite="hops", group="main", policy="baseline",
                     overrides={k.replace("data.", "dcn."): v for k, v in flat.items()},
                     error_feedback="off", extra=("--config.mesh.dcn_data=2",)))
    # The most coded of compression.auto's choices at 100 Mbit/s on the two-hop rig
    # (experiments/results/network_auto.json: its three runs chose hop_flat's
    # codecs, this, and this without int8 gradients inside a process).
    runs.append(dict(name="hop_auto100mbit", suite="hops", group="main", policy="baseline",
                     overrides={"data.grad": "int8", "data.param": "int8",
                                "dcn.grad": "int4:rot", "dcn.param": "int8"},
                     error_feedback="off", extra=("--config.mesh.dcn_data=2",)))
    # Its two other choices at 100 Mbit/s with a 6-step trial
    # (experiments/results/network_auto_trial6.json): int4:rot/int8 across with
    # int8 on data.param inside, or on the tensor messages instead.
    across = {"dcn.grad": "int4:rot", "dcn.param": "int8"}
    runs.append(dict(name="hop_auto_param8", suite="hops", group="main", policy="baseline",
                     overrides={"data.param": "int8", **across},
                     error_feedback="off", extra=("--config.mesh.dcn_data=2",)))
    runs.append(dict(name="hop_auto_act8", suite="hops", group="main", policy="baseline",
                     overrides={"tensor.act": "int8", "tensor.act_grad": "int8", **across},
                     error_feedback="off", extra=("--config.mesh.dcn_data=2",)))
    # And both at once, one of its choices with the probe of four sizes
    # (experiments/results/network_auto_sizes4.json).
    runs.append(dict(name="hop_auto_act8_param8", suite="hops", group="main", policy="baseline",
                     overrides={"tensor.act": "int8", "tensor.act_grad": "int8",
                                "data.param": "int8", **across},
                     error_feedback="off", extra=("--config.mesh.dcn_data=2",)))
    # Each route at compression.auto's most compressed default codecs, which its
    # trial now weighs ("as given, fewest bytes" and "per hop (...), fewest
    # bytes"; experiments/results/network_auto_fewest.json).
    act8 = {"tensor.act": "int8", "tensor.act_grad": "int8"}
    runs.append(dict(name="hop_flat_act8", suite="hops", group="main", policy="baseline",
                     overrides={**flat, **act8}, error_feedback="off"))
    runs.append(dict(name="hop_perhop_fewest", suite="hops", group="main", policy="baseline",
                     overrides={**flat, **act8, **across}, error_feedback="off",
                     extra=("--config.mesh.dcn_data=2",)))
    # The outer loop across the same slow hop (jcomp/train/outer/islands.py).
    runs.append(dict(name="hop_raw", suite="outer", group="main", policy="baseline",
                     overrides={}, error_feedback="off", extra=("--config.mesh.dcn_data=2",)))
    for every, fragments, codec, ef, slug, lr, momentum, delay in OUTER_RUNS:
        name = (f"outer_h{every}" + (f"_f{fragments}" if fragments > 1 else "")
                + (f"_d{delay}" if delay else "") + f"_{slug}")
        runs.append(dict(name=name, suite="outer", group="outer", policy="baseline",
                         overrides={}, error_feedback="auto",
                         extra=("--config.mesh.dcn_data=2", f"--config.outer.every={every}",
                                f"--config.outer.fragments={fragments}",
                                f"--config.outer.codec={codec}",
                                f"--config.outer.error_feedback={ef}",
                                f"--config.outer.lr={lr}",
                                f"--config.outer.momentum={momentum}")
                         + ((f"--config.outer.delay={delay}",) if delay else ())))
    return runs


def _slug(spec: str) -> str:
    return spec.replace("powersgd:rank=", "powersgd_r").replace(":", "").replace(".", "p")


def select(suite: str, only=None) -> list[dict]:
    """The runs of `suite` ("all" for every one), baseline always first; `only`
    narrows them to the named runs (baseline stays)."""
    if suite not in SUITES + ("all",):
        raise ValueError(f"suite must be one of {', '.join(SUITES + ('all',))}; got {suite!r}")
    specs = run_specs()
    names = {s["name"] for s in specs}
    for name in only or ():
        if name not in names:
            raise ValueError(f"--only: unknown run {name!r}; known: {', '.join(sorted(names))}")
    def in_suite(s):
        if suite == "all":
            return True
        return s["name"] in {"seeds": SEED_RUNS, "ef": EF_RUNS}.get(suite, ()) or s["suite"] == suite

    chosen = [s for s in specs if s["name"] == "baseline"
              or (in_suite(s) and (not only or s["name"] in only))]
    return chosen


def workdir_name(spec: dict, steps: int, seed: int = 0) -> str:
    return f"{spec['name']}-{steps}steps" + (f"-seed{seed}" if seed else "")


def train_args(spec: dict, config: str, steps: int, eval_every: int, warmup: int,
               seed: int = 0) -> list[str]:
    """train.py's flags for one run (without --workdir)."""
    args = [f"--config={config}", f"--config.seed={seed}", f"--config.train.steps={steps}",
            f"--config.train.eval_every={eval_every}", f"--config.optim.warmup_steps={warmup}",
            f"--config.checkpoint.every={max(steps // 4, min(steps, 10))}",
            f"--config.compression.policy={spec['policy']}",
            f"--config.compression.error_feedback={spec['error_feedback']}"]
    args += [f"--config.compression.{key}={codec}" for key, codec in spec["overrides"].items()]
    return args + list(spec.get("extra", ()))


def is_finished(workdir: str, steps: int) -> bool:
    """True when workdir/metrics.jsonl holds a record of step `steps`."""
    path = os.path.join(workdir, metrics_lib.METRICS_FILE)
    if not os.path.exists(path):
        return False
    return reached(metrics_lib.read_metrics(path), steps)


def reached(records: list[dict], steps: int) -> bool:
    """True when `records` hold a record of step `steps`."""
    return any(r.get("step") == steps for r in records)


def in_use(workdir: str) -> bool:
    """True when another trainer holds `workdir`'s lock: a second invocation of
    this script on the same --out (another commit's runs, say) leaves that run
    to the one training it."""
    if not os.path.isdir(workdir):
        return False
    try:
        faults.WorkdirLock(workdir).acquire().release()
    except faults.UsageError:
        return True
    return False


# What XLA's CPU runtime prints when it ends a process whose emulated devices
# wait in collectives that never complete (docs/trainer.md, "On CPU, XLA's other
# scheduler": train.py now starts JAX with the option that stopped it; runs
# from before it resumed this way).
STUCK = "Termination timeout for"
RESTARTS_FILE = runlog.RESTARTS_FILE


def run_one(spec, workdir, args, log, restarts: int = 1) -> float:
    """Runs train.py for one spec; returns wall seconds. RuntimeError if it fails.

    A run that XLA's CPU runtime ended because its devices waited in collectives
    that never completed (STUCK in its log) is rerun up to `restarts` times:
    train.py resumes it from its last checkpoint, bit for bit the run it would
    have been. Each restart is recorded in the workdir's restarts.json (the
    last step the failed attempt logged, and its log, kept in the workdir), and
    the summary reports it. Any other failure is not retried."""
    cmd = [sys.executable, os.path.join(ROOT, "train.py"), *args, f"--workdir={workdir}"]
    t0 = time.perf_counter()
    for attempt in range(restarts + 1):
        with open(workdir + ".log", "w") as f:
            rc = subprocess.call(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)
        if rc == 0:
            break
        with open(f.name, errors="replace") as f:
            stuck = STUCK in f.read()
        if not stuck or attempt == restarts:
            raise RuntimeError(f"run {os.path.basename(workdir)} failed (exit {rc}); "
                               f"see {f.name}")
        os.makedirs(workdir, exist_ok=True)
        kept = os.path.join(workdir, f"stuck{attempt + 1}.log")  # kept in git, as evidence
        os.replace(f.name, kept)
        _record_restart(workdir, kept)
        print(f"{os.path.basename(workdir)}: stuck in a collective (exit {rc}); resuming "
              f"from its last checkpoint ({os.path.basename(kept)})", file=log, flush=True)
    wall = time.perf_counter() - t0
    print(f"{os.path.basename(workdir)}: done in {wall:.0f} s", file=log, flush=True)
    return wall


def _record_restart(workdir: str, kept_log: str) -> None:
    metrics = os.path.join(workdir, metrics_lib.METRICS_FILE)
    records = metrics_lib.read_metrics(metrics) if os.path.exists(metrics) else []
    path = os.path.join(workdir, RESTARTS_FILE)
    done = json.load(open(path)) if os.path.exists(path) else []
    done.append(dict(stuck_after_step=max((r["step"] for r in records), default=0),
                     log=os.path.basename(kept_log)))
    with open(path, "w") as f:
        json.dump(done, f, indent=1)


# ---------------------------------------------------------------- summary

def summarize(records: list[dict]) -> dict:
    """One run's numbers from its metrics records (file order; a resumed run's
    repeated steps count once, the last written)."""
    last = {}
    for r in records:
        if "step" in r:  # compression.auto's decision is a record without one
            last[r["step"]] = r
    steps = sorted(last)
    if not steps:
        raise ValueError("metrics hold no records")
    val = [(s, last[s]["val_loss"]) for s in steps if "val_loss" in last[s]]
    # The loss through the run's own compressed forward, where it codes one.
    val_c = [last[s]["val_loss_compressed"] for s in steps if "val_loss_compressed" in last[s]]
    wire = next((r for r in records if "wire_bytes_total" in r), None)
    if wire is None:
        raise ValueError("no metrics record holds wire_bytes_total")
    times = [last[s]["step_time_s"] for s in steps if "step_time_s" in last[s]]
    # Error feedback's residual against the gradient it rides on, per logged step.
    ef_ratio = [last[s]["ef_norm"] / last[s]["grad_norm"] for s in steps
                if "ef_norm" in last[s] and last[s].get("grad_norm")]
    return dict(
        steps=steps[-1], final_loss=last[steps[-1]]["loss"],
        final_val_loss=val[-1][1] if val else None,
        best_val_loss=min(v for _, v in val) if val else None,
        final_val_loss_compressed=val_c[-1] if val_c else None,
        wire_bytes={a: float(wire.get(f"wire_bytes_{a}", 0.0)) for a in AXES},
        wire_bytes_total=float(wire["wire_bytes_total"]),
        # Across the slow hop: an every-step two-hop run's dcn messages, or an
        # outer loop's syncs averaged over its inner steps (the last record's).
        wire_bytes_dcn=float(wire["wire_bytes_dcn"]) if "wire_bytes_dcn" in wire else None,
        outer_bytes_per_step=next((float(r["outer_bytes_per_step"]) for r in reversed(records)
                                   if "outer_bytes_per_step" in r), None),
        # Every byte across islands per inner step (syncs, the per-step metrics
        # agreement, evaluations), on runs that record it.
        across_bytes_per_step=next((float(r["outer_across_bytes_per_step"]) for r in records
                                    if "outer_across_bytes_per_step" in r), None),
        median_step_time_s=statistics.median(times) if times else None,
        ef_norm_ratio=statistics.median(ef_ratio) if ef_ratio else None,
        # The pre-clip gradient norm over the second half of training: noisier
        # (compressed) gradients are clipped harder at the same clip_norm.
        late_grad_norm=statistics.median(last[s]["grad_norm"] for s in steps
                                         if s > steps[-1] / 2 and "grad_norm" in last[s])
        if any(s > steps[-1] / 2 and "grad_norm" in last[s] for s in steps) else None,
        skipped_updates=last[steps[-1]].get("skipped_updates", 0))


def gap_pct(value, reference):
    """100 * (value - reference) / reference; None when either is missing.
    NaN or Inf losses stay NaN/Inf."""
    if value is None or reference is None:
        return None
    if reference == 0:
        raise ValueError("reference val_loss is 0: a gap in percent is undefined")
    return 100.0 * (value - reference) / reference


def byte_ratio(total, reference):
    if reference == 0:
        return None
    return total / reference


def add_comparisons(runs: list[dict]) -> list[dict]:
    """Adds gap_pct (final val_loss vs baseline) and byte_ratio (total bytes vs
    baseline) to each run; the baseline run must be among them."""
    base = next((r for r in runs if r["name"] == "baseline"), None)
    if base is None:
        raise ValueError("runs must include the baseline run")
    for r in runs:
        r["gap_pct"] = gap_pct(r["final_val_loss"], base["final_val_loss"])
        r["best_gap_pct"] = gap_pct(r["best_val_loss"], base["best_val_loss"])
        r["byte_ratio"] = byte_ratio(r["wire_bytes_total"], base["wire_bytes_total"])
        r["byte_ratio_by_axis"] = {a: byte_ratio(r["wire_bytes"][a], base["wire_bytes"][a])
                                   for a in AXES}
    return runs


def _json_safe(x):
    """Non-finite floats as the strings jcomp.train.run.metrics uses, so the file is strict JSON."""
    if isinstance(x, float) and not math.isfinite(x):
        return "NaN" if math.isnan(x) else ("Infinity" if x > 0 else "-Infinity")
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    return x


def seeds_on_disk(out: str, steps: int) -> list[int]:
    """The seeds of the runs of length `steps` that have a workdir in `out`, or
    an entry in its runs.jsonl."""
    if not os.path.isdir(out):
        return []
    pattern = re.compile(rf"-{steps}steps(?:-seed(\d+))?$")
    names = {e for e in os.listdir(out) if os.path.isdir(os.path.join(out, e))}
    found = {pattern.search(n) for n in names | set(runlog.gather(out))}
    return sorted({int(m.group(1) or 0) for m in found if m})


def collect(out: str, steps: int, args_of, seeds=(0,)) -> list[dict]:
    """Every finished known run of length `steps` in `out` at each of `seeds`,
    seed-major, baseline first within a seed; each compared with the baseline
    of its own seed."""
    stored = runlog.gather(out) if os.path.isdir(out) else {}
    runs = []
    for seed in seeds:
        at_seed = []
        for spec in run_specs():
            workdir = os.path.join(out, workdir_name(spec, steps, seed))
            entry = stored.get(os.path.basename(workdir))
            if entry is None or not reached(entry["records"], steps):
                continue
            row = dict(name=spec["name"], seed=seed, suite=spec["suite"], group=spec["group"],
                       policy=spec["policy"], overrides=spec["overrides"],
                       error_feedback=spec["error_feedback"], extra=list(spec.get("extra", ())),
                       workdir=os.path.relpath(workdir, ROOT),
                       command="python train.py " + " ".join(args_of(spec, seed))
                       + f" --workdir={os.path.relpath(workdir, ROOT)}")
            row.update(summarize(entry["records"]))
            # Runs of a sweep may come from several commits; each keeps its own.
            row["git_commit"] = entry["git_commit"]
            if "restarts" in entry:
                row["restarts"] = entry["restarts"]
            at_seed.append(row)
        if any(r["name"] == "baseline" for r in at_seed):
            add_comparisons(at_seed)
        runs += at_seed
    return runs


def draw_plots(out: str, runs: list[dict]) -> dict:
    """{group: png path relative to out} for the main, sweep and places groups present,
    drawn from the first seed's runs."""
    plots = {}
    runs = [r for r in runs if r["seed"] == runs[0]["seed"]] if runs else runs
    stored = runlog.gather(out) if runs else {}
    by_name = {r["name"]: r for r in runs}
    for group, png in (("main", "main_loss.png"), ("sweep_grad", "sweep_grad_loss.png"),
                       ("sweep_act", "sweep_act_loss.png"), ("places", "places_loss.png")):
        names = [r["name"] for r in runs if r["group"] == group]
        if not names or (names == ["baseline"] and len({r["group"] for r in runs}) > 1):
            continue  # the baseline alone is drawn beside each other group instead
        if group != "main" and "baseline" in by_name:
            names = ["baseline"] + names
        entries = [stored[os.path.basename(by_name[n]["workdir"])] for n in names]
        with runlog.metrics_files(entries) as paths:
            metrics_lib.plot(paths, os.path.join(out, png), key="loss")
        plots[group] = png
    return plots


def load_config(path: str):
    """The ConfigDict of a config file (configs/*.py, relative to the repository)."""
    import importlib.util
    full = path if os.path.isabs(path) else os.path.join(ROOT, path)
    if not os.path.isfile(full):
        raise ValueError(f"--config: no such file {path!r}")
    spec = importlib.util.spec_from_file_location("_convergence_config", full)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


def _git_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def _key_value(item: str):
    key, sep, value = item.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"--set {item!r}: want KEY=VALUE, e.g. mesh.data=4")
    return key, value


def apply_sets(cfg, sets) -> None:
    """Sets each (dotted key, string value) of --set on `cfg`, cast to the type
    the field has; ValueError naming the key for an unknown field or bad value."""
    for key, value in sets:
        *parents, leaf = key.split(".")
        node = cfg
        try:
            for part in parents:
                node = node[part]
            old = node[leaf]
        except (KeyError, AttributeError, TypeError):
            raise ValueError(f"--set {key}: no such config field") from None
        try:
            node[leaf] = (value.lower() in ("1", "true")) if isinstance(old, bool) else type(old)(value)
        except ValueError:
            raise ValueError(f"--set {key}={value}: must be of type {type(old).__name__}") from None


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--suite", default="main", help=", ".join(SUITES) + " or all")
    p.add_argument("--steps", type=int, default=None, help="training steps per run (default 150)")
    p.add_argument("--eval-every", type=int, default=None, help="steps between val_loss (steps/5)")
    p.add_argument("--warmup", type=int, default=None, help="learning-rate warm-up steps (steps/10)")
    p.add_argument("--config", default=None, help="config file every run starts from")
    p.add_argument("--only", nargs="+", default=None, help="run just these names (and baseline)")
    p.add_argument("--lr", type=float, default=None,
                   help="optim.lr of every run (default: the config's); give each rate its --out")
    p.add_argument("--seeds", nargs="+", type=int, default=[0],
                   help="config seeds: every run once per seed (default 0)")
    p.add_argument("--set", type=_key_value, action="append", default=[],
                   help="KEY=VALUE: a config field for every run (repeatable), e.g. mesh.data=4")
    p.add_argument("--out", default=DEFAULT_OUT, help="workdirs, logs, summary.json and plots")
    p.add_argument("--quick", action="store_true", help="a few steps of configs/tiny.py")
    p.add_argument("--summarize-only", action="store_true",
                   help="train nothing: rebuild summary.json and plots from the finished runs")
    p.add_argument("--keep-checkpoints", action="store_true",
                   help="keep each finished run's checkpoints (deleted by default)")
    args = p.parse_args(argv)
    if args.quick:
        args.config = args.config or QUICK["config"]
        args.steps = args.steps or QUICK["steps"]
        args.eval_every = args.eval_every or QUICK["eval_every"]
        args.only = args.only or [n for n in QUICK["runs"] if n != "baseline"]
    args.config = args.config or "configs/base.py"
    args.steps = 150 if args.steps is None else args.steps
    if args.steps < 2:
        raise ValueError(f"--steps must be >= 2; got {args.steps}")
    args.eval_every = args.eval_every or max(1, args.steps // 5)
    args.warmup = min(args.steps // 10, args.steps - 1) if args.warmup is None else args.warmup
    if not 0 <= args.warmup < args.steps:
        raise ValueError(f"--warmup must be in [0, --steps); got {args.warmup}")
    if any(sd < 0 for sd in args.seeds) or len(set(args.seeds)) != len(args.seeds):
        raise ValueError(f"--seeds must be distinct non-negative ints; got {args.seeds}")
    if args.eval_every < 1:
        raise ValueError(f"--eval-every must be >= 1; got {args.eval_every}")
    return args


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        args = parse_args(argv)
        specs = select(args.suite, args.only)
        cfg = load_config(args.config)
        apply_sets(cfg, args.set)
        out = os.path.abspath(args.out)
        os.makedirs(out, exist_ok=True)
        stored = runlog.gather(out)
    except ValueError as e:
        print(f"convergence.py: error: {e}", file=sys.stderr)
        return 2

    def args_of(spec, seed=0):
        lr = [] if args.lr is None else [f"--config.optim.lr={args.lr!r}"]
        sets = [f"--config.{k}={v}" for k, v in args.set]
        return train_args(spec, args.config, args.steps, args.eval_every, args.warmup, seed) + lr + sets

    walls = {}
    for seed in [] if args.summarize_only else args.seeds:  # seed-major: whole seeds first
        for spec in specs:
            workdir = os.path.join(out, workdir_name(spec, args.steps, seed))
            entry = stored.get(os.path.basename(workdir))
            # A run whose folder is gone (a fresh clone) is finished by its runs.jsonl
            # entry; the folder is read again for a run another process finished since.
            done = entry is not None and reached(entry["records"], args.steps)
            if done or is_finished(workdir, args.steps):
                print(f"{os.path.basename(workdir)}: finished already, skipped", flush=True)
                continue
            if in_use(workdir):
                print(f"{os.path.basename(workdir)}: being trained by another process, skipped",
                      flush=True)
                continue
            try:
                walls[spec["name"], seed] = run_one(spec, workdir, args_of(spec, seed), sys.stdout)
            except RuntimeError as e:
                print(f"convergence.py: {e}", file=sys.stderr)
                return 1
            with open(os.path.join(workdir, COMMIT_FILE), "w") as f:
                f.write(f"{_git_commit()}\n")
            if not args.keep_checkpoints:
                # A finished run is judged by its metrics alone; its checkpoints
                # (hundreds of MB per sweep) would only be restored to train further.
                shutil.rmtree(os.path.join(workdir, "checkpoints"), ignore_errors=True)

    summary_path = os.path.join(out, "summary.json")
    old = json.load(open(summary_path)) if os.path.exists(summary_path) else {}
    seeds = sorted(set(args.seeds) | set(seeds_on_disk(out, args.steps)))
    runs = collect(out, args.steps, args_of, seeds)
    for r in runs:
        r["wall_s"] = walls.get((r["name"], r["seed"]), next(
            (o.get("wall_s") for o in old.get("runs", [])
             if o["name"] == r["name"] and o.get("seed", 0) == r["seed"]), None))
    invocation = "python -m experiments.convergence " + " ".join(
        a for a in argv if a != "--summarize-only")
    invocations = [i for i in old.get("invocations", []) if i != invocation] + [invocation]
    summary = dict(config=args.config, steps=args.steps, eval_every=args.eval_every,
                   lr=args.lr if args.lr is not None else cfg.optim.lr,
                   warmup_steps=args.warmup, mesh=cfg.mesh.to_dict(),
                   model=cfg.model.to_dict(), batch_size=cfg.train.batch_size,
                   seq_len=cfg.data.seq_len,
                   quick=args.quick, git_commit=_git_commit(),
                   date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                   seeds=seeds, invocations=invocations,
                   # With several seeds, one banded plot stands for every group's.
                   plots=seeds_lib.draw(out, runs) if len(seeds) > 1 else draw_plots(out, runs),
                   settings=seeds_lib.settings(runs), runs=runs)
    with open(summary_path, "w") as f:
        json.dump(_json_safe(summary), f, indent=1, allow_nan=False)
    if runs:
        runlog.write(out)
    for r in runs:
        gap = "" if r.get("gap_pct") is None else f", gap {r['gap_pct']:+.2f}%"
        ratio = "" if r.get("byte_ratio") is None else f", bytes x{r['byte_ratio']:.3f}"
        print(f"{r['name']:>16} seed {r['seed']}: val_loss {r['final_val_loss']}{gap}{ratio}")
    if len(seeds) > 1:
        for st in summary["settings"]:
            g = st["gap_pct"]
            ci = "" if not g or g["ci95"] is None else \
                f", gap {g['mean']:+.2f}% [{g['ci95'][0]:+.2f}%, {g['ci95'][1]:+.2f}%]"
            print(f"{st['name']:>16}: {len(st['seeds'])} seeds, val_loss "
                  f"{st['val_loss']['mean']:.4f}{ci}")
    print(f"wrote {os.path.relpath(summary_path)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
