"""A refactor must not change what the train step sends or computes.

    python -m tools.regression --before REF [--after WORKTREE] [--steps 5]
                               [--only NAME ...] [--before-only | --after-only | --compare-only] [--out tools/results/regression]

Runs every case below with the code at git ref REF (checked out into a
temporary worktree) and with the code of this checkout, `python train.py` in a
subprocess each, and compares per case:

  bytes     the compiled train step's wire bytes per mesh axis (metrics.jsonl's
            static record, read from the compiled program by jcomp.meter.wire):
            must be identical;
  losses    the training loss of every one of the first --steps steps: must
            agree to 1e-6 relative; the report also says whether they are
            bitwise equal;
  refusals  a case one side refuses (exit 2) must be refused by the other too.

Cases: every policy preset, and the README's example command lines (the
overrides they show), on the meshes (8,1,1), (2,2,2), (1,2,4) and (4,1,2).
The model is configs/base.py's with n_layers 4 (pipeline 4 divides it) and
batch 16 (data 8 x 2 microbatches), warm-up 2 steps (of 5).

Results of clean code are kept in --out/stepsN/<code id>-<machine id>/<case>.json,
so an interrupted run resumes (dirty code's are rerun). The code id hashes the
trees of jcomp/, configs/ and train.py, so a commit of docs or tests keeps
them; the machine id hashes the versions of jax, jaxlib and numpy and the CPU's
model and instruction-set flags, because the same code on another machine or
build rounds differently in the last bits (XLA:CPU picks its kernels by the
CPU's features), and results of two machines are never compared.
--out/report_<before>_<after>.json holds the comparison. Exit 1 when any case
differs.
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MESHES = ((8, 1, 1), (2, 2, 2), (1, 2, 4), (4, 1, 2))
# name -> train.py flags on top of configs/base.py (the README's examples).
SETTINGS = {
    "baseline": ["--config.compression.policy=baseline"],
    "naive": ["--config.compression.policy=naive"],
    "hybrid": ["--config.compression.policy=hybrid"],
    "hybrid_paper": ["--config.compression.policy=hybrid_paper"],
    "hybrid_topk": ["--config.compression.policy=hybrid",
                    "--config.compression.data.grad=topk:0.01"],
    "hybrid_schedule": ["--config.compression.policy=hybrid",
                        "--config.compression.schedule.data.grad=bf16@0,int8@2,int4@4",
                        "--config.compression.schedule.tensor.act=@3"],
    "hybrid_layers": ["--config.compression.policy=hybrid",
                      "--config.compression.layers.tensor.act=2-3",
                      "--config.compression.layers.tensor.act_grad=2-3"],
    "hybrid_stage0": ["--config.compression.policy=hybrid",
                      "--config.compression.stages.pipeline.act=0"],
    "paper_int8_grad": ["--config.compression.policy=hybrid_paper",
                        "--config.compression.error_feedback=off",
                        "--config.compression.data.grad=int8",
                        "--config.compression.tensor.act_grad=int4"],
    "powersgd": ["--config.compression.policy=hybrid",
                 "--config.compression.data.grad=powersgd:rank=4"],
    "autoencoder": ["--config.compression.policy=baseline",
                    "--config.compression.tensor.act=ae:dim=32",
                    "--config.compression.tensor.act_grad=ae:dim=32"],
}
COMMON = ["--config=configs/base.py", "--config.model.n_layers=4", "--config.train.batch_size=16",
          "--config.train.microbatches=2", "--config.train.log_every=1",
          "--config.train.eval_every=100000", "--config.checkpoint.every=100000",
          "--config.optim.warmup_steps=2"]


PRESETS = ("baseline", "naive", "hybrid", "hybrid_paper")


def cases(only=(), meshes=MESHES):
    """The presets on every mesh, then the examples on (2, 2, 2), then the
    examples on the other meshes: an interrupted run has the widest cover."""
    order = [(n, m) for n in PRESETS for m in meshes]
    order += [(n, m) for m in ((2, 2, 2),) + tuple(x for x in meshes if x != (2, 2, 2))
              for n in SETTINGS if n not in PRESETS and m in meshes]
    for name, m in order:
        if not only or name in only:
            yield f"{name}-{m[0]}x{m[1]}x{m[2]}", SETTINGS[name], m


def run_case(code_root, flags, mesh, steps, workdir) -> dict:
    """One train.py run of the code at `code_root` -> {rc, losses, bytes, error}."""
    cmd = [sys.executable, os.path.join(code_root, "train.py"), *COMMON, *flags,
           f"--config.mesh.data={mesh[0]}", f"--config.mesh.tensor={mesh[1]}",
           f"--config.mesh.pipeline={mesh[2]}", f"--config.train.steps={steps}",
           f"--workdir={workdir}"]
    env = dict(os.environ, PYTHONPATH=code_root)
    p = subprocess.run(cmd, cwd=code_root, env=env, capture_output=True, text=True, timeout=900)
    out = {"rc": p.returncode, "losses": {}, "bytes": {}}
    if p.returncode:
        out["error"] = (p.stderr.strip().splitlines() or ["(no stderr)"])[-1]
        return out
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        for line in f:
            rec = json.loads(line)
            if "wire_bytes_total" in rec:
                out["bytes"] = {k: v for k, v in rec.items() if k.startswith("wire_bytes_")}
            if "loss" in rec and "step" in rec:
                out["losses"][str(rec["step"])] = rec["loss"]
    return out


CODE = ("jcomp", "configs", "train.py")  # what a run's result depends on


def _code_id(root) -> tuple[str, bool]:
    """(an id of the committed code, whether the checkout's code is clean): the
    tree hashes of CODE, so commits that touch only docs, tests or benchmarks
    keep their results."""
    trees = subprocess.run(["git", "rev-parse", *(f"HEAD:{p}" for p in CODE)], cwd=root,
                           capture_output=True, text=True, check=True).stdout.split()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all", "--", *CODE],
                           cwd=root, capture_output=True, text=True).stdout.strip()
    return hashlib.sha1(" ".join(trees).encode()).hexdigest()[:10], not dirty


def machine() -> dict:
    """What besides the code decides a run's last bits: the numeric packages'
    versions and the CPU (XLA:CPU compiles for the features it finds)."""
    info = {p: importlib.metadata.version(p) for p in ("jax", "jaxlib", "numpy")}
    info["machine"] = platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            fields = dict((k.strip(), v.strip()) for k, v in
                          (line.split(":", 1) for line in f if ":" in line))
        info["cpu"] = fields.get("model name", "")
        info["cpu_flags"] = " ".join(sorted(fields.get("flags", "").split()))
    except OSError:
        info["cpu"] = platform.processor()
    return info


def machine_id(info: dict) -> str:
    """A short id of `machine()`'s answer."""
    return hashlib.sha1(json.dumps(info, sort_keys=True).encode()).hexdigest()[:8]


def side(name, code_root, out_dir, steps, only, run=True):
    """Runs the cases with the code at `code_root`; results of clean code are kept
    under out_dir/stepsN/CODE_ID-MACHINE_ID/ and reused, dirty code's are rerun."""
    code, clean = _code_id(code_root)
    info = machine()
    keep = os.path.join(out_dir, f"steps{steps}",
                        f"{code}-{machine_id(info)}" + ("" if clean else "-dirty"))
    os.makedirs(keep, exist_ok=True)
    with open(os.path.join(keep, "commit"), "w") as f:
        f.write(_rev(code_root) + "\n")
    with open(os.path.join(keep, "machine.json"), "w") as f:
        json.dump(info, f, indent=1)
    results = {}
    for case, flags, mesh in cases(only):
        path = os.path.join(keep, case + ".json")
        if clean and os.path.exists(path):
            with open(path) as f:
                results[case] = json.load(f)
            continue
        if not run:
            continue
        with tempfile.TemporaryDirectory() as wd:
            res = run_case(code_root, flags, mesh, steps, os.path.join(wd, "run"))
        with open(path, "w") as f:
            json.dump(res, f, indent=1)
        results[case] = res
        print(f"{name:6s} {case:28s} rc={res['rc']} "
              f"{res.get('error') or res['bytes'].get('wire_bytes_total')}", flush=True)
    return results


def compare(before, after, rtol=1e-6) -> dict:
    rows = {}
    for case in before:
        if case not in after:
            continue
        b, a = before[case], after[case]
        row = {"refused": [bool(b["rc"]), bool(a["rc"])]}
        problems = []
        if b["rc"] or a["rc"]:
            if bool(b["rc"]) != bool(a["rc"]):
                problems.append(f"rc before {b['rc']}, after {a['rc']}: {b.get('error') or a.get('error')}")
        else:
            if b["bytes"] != a["bytes"]:
                problems.append(f"bytes differ: {b['bytes']} vs {a['bytes']}")
            if sorted(b["losses"]) != sorted(a["losses"]) or not b["losses"]:
                problems.append("steps logged differ")
            else:
                rel = max(abs(a["losses"][s] - b["losses"][s]) / max(abs(b["losses"][s]), 1e-30)
                          for s in b["losses"])
                row["max_rel_loss_diff"] = rel
                row["bitwise"] = b["losses"] == a["losses"]
                if rel > rtol:
                    problems.append(f"losses differ by {rel:.3g} relative (> {rtol})")
        row["problems"] = problems
        rows[case] = row
    return rows


def _rev(root, ref="HEAD"):
    return subprocess.run(["git", "rev-parse", ref], cwd=root, capture_output=True, text=True,
                          check=True).stdout.strip()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--before", required=True, help="git ref of the code before the change")
    ap.add_argument("--after", default=ROOT, help="checkout with the code after (default: this)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--only", nargs="*", default=(), choices=sorted(SETTINGS))
    ap.add_argument("--before-only", action="store_true",
                    help="run (and keep) the before side only, to compare later")
    ap.add_argument("--after-only", action="store_true",
                    help="run (and keep) the after side only, to compare later")
    ap.add_argument("--compare-only", action="store_true",
                    help="compare the cases both sides have kept; run nothing")
    ap.add_argument("--out", default=os.path.join(ROOT, "tools/results/regression"))
    args = ap.parse_args(argv)
    before_rev = _rev(ROOT, args.before)
    if args.after_only:
        side("after", args.after, args.out, args.steps, args.only)
        return 0
    tree = tempfile.mkdtemp(prefix="jcomp-before-")
    subprocess.run(["git", "worktree", "add", "--detach", tree, before_rev], cwd=ROOT,
                   check=True, capture_output=True)
    try:
        before = side("before", tree, args.out, args.steps, args.only, not args.compare_only)
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", tree], cwd=ROOT,
                       capture_output=True)
        shutil.rmtree(tree, ignore_errors=True)
    if args.before_only:
        return 0
    after = side("after", args.after, args.out, args.steps, args.only, not args.compare_only)
    rows = compare(before, after)
    bad = {c: r for c, r in rows.items() if r["problems"]}
    missing = sorted(set(before) ^ set(after))
    after_rev = _rev(args.after)
    report = {"before": before_rev, "after": after_rev, "steps": args.steps,
              "machine": machine(), "cases": rows, "not_compared": missing}
    path = os.path.join(args.out, f"report_{before_rev[:7]}_{after_rev[:7]}.json")
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
    ran = [r for r in rows.values() if "bitwise" in r]
    print(f"{len(rows)} cases compared ({len(missing)} kept on one side only), "
          f"{len(ran)} trained on both sides ({sum(r['bitwise'] for r in ran)} bitwise equal), "
          f"{sum(all(r['refused']) for r in rows.values())} refused on both; "
          f"{len(bad)} differ")
    for c, r in bad.items():
        print(f"  {c}: " + "; ".join(r["problems"]))
    print(f"wrote {path}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
