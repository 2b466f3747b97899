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

This module is the runner (train.py per run, resuming, restarts, summary.json
written): the runs of each suite are convergence_specs.py's, summary.json's
figures and plots convergence_summary.py's, the statistics over seeds and
their banded plots seeds.py's.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import time

from experiments import runlog
from experiments import seeds as seeds_lib
from experiments.convergence_specs import SUITES, select, train_args, workdir_name
from experiments.convergence_summary import (_json_safe, collect, draw_plots, reached,
                                             seeds_on_disk)
from jcomp.train.run import faults
from jcomp.train.run import metrics as metrics_lib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

COMMIT_FILE = runlog.COMMIT_FILE
DEFAULT_OUT = os.path.join("experiments", "results", "convergence")
QUICK = dict(config="configs/tiny.py", steps=4, eval_every=2, runs=("baseline", "hybrid"))


def is_finished(workdir: str, steps: int) -> bool:
    """True when workdir/metrics.jsonl holds a record of step `steps`."""
    path = os.path.join(workdir, metrics_lib.METRICS_FILE)
    if not os.path.exists(path):
        return False
    return reached(metrics_lib.read_metrics(path), steps)


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
