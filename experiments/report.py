"""Writes experiments/RESULTS.md from the JSON files in benchmarks/results/ and
experiments/results/.

    python -m experiments.report [--results benchmarks/results experiments/results]
                                 [--out experiments/RESULTS.md]
    python -m experiments.report --summarize experiments/results/convergence_seeds [...]

Reads, where present, each from the first --results folder that has it:
collectives.json (benchmarks/collectives.py), collectives_sizes.json
(benchmarks/collectives.py --sizes), parallel.json (benchmarks/parallel.py) and
gpu.json (benchmarks/gpu.py), in benchmarks/results/; every
convergence*/summary.json (experiments/convergence.py), projection.json
(experiments/projection.py, with its link profile), network.json
(experiments/network.py), network_hops.json (experiments/network.py --hops),
network_outer.json (--hops with the outer-loop policies), network_auto.json,
network_auto_trial6.json, network_auto_sizes4.json, network_auto_act8.json and
network_auto_fewest.json (--hops with compression.auto), network_streaming.json and network_streaming_1dev.json
(--hops, Streaming DiLoCo against blocking syncs), overlap.json
(experiments/overlap.py) and probelink.json (experiments/probelink.py), in
experiments/results/.
Every number and every PASS/FAIL in the page is computed from those files;
only the explanatory prose is fixed text.

This module reads the files and puts the page together; each section is
written by a module of its own: report_convergence.py (one-seed convergence
sets, the learning-rate sweep), report_seeds.py (sets over several seeds),
report_projection.py, report_benchmarks.py (collectives, the parallel step,
GPU), report_network.py (the throttled link), report_hops.py (two hops, the
outer loop), report_auto.py (compression.auto), report_streaming.py
(Streaming DiLoCo, overlap.json) and report_probelink.py (probelink.json).

--summarize STUDY ... writes each study's runs.jsonl from its run folders
(experiments/runlog.py) and nothing else: the file that stands in for the run
folders, which git does not keep, when experiments/convergence.py
--summarize-only rebuilds the study's summary.json and plots.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys

from experiments import report_auto, report_hops, report_network, report_probelink
from experiments import report_seeds, report_streaming, runlog
from experiments.report_benchmarks import (collectives_section, gpu_section, parallel_section,
                                           sizes_section)
from experiments.report_convergence import (compressed_what, convergence_claims,
                                            convergence_section, hybrid_preset_setting,
                                            lr_section)
from experiments.report_format import table
from experiments.report_projection import projection_claims, projection_section

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = (os.path.join(ROOT, "benchmarks", "results"),  # --results' default, in this order
           os.path.join(ROOT, "experiments", "results"))

WHY = """\
Why numbers here differ from the papers'. The papers train GPT-NeoX-20B on up to
192 V100s for far more tokens; the runs above train a small GPT on 8 emulated
CPU devices of one host for a few hundred steps. Consequences:
- Sets of runs shorter than the main one (a few tens of steps) were made
  shorter to fit the machine time available: they compare early training
  only, with one seed per setting.
- Loss gaps at a few hundred steps say how much a codec perturbs early
  training, not where a long run ends; error feedback needs steps to pay back.
- Error feedback (EF) keeps "sum of what was sent + residuals = exact sum"
  (tests/test_collectives.py), and on a toy problem int2 SGD with it ends
  where exact SGD does. In these runs its sign depends on the length: in the
  50-step sweep it made every gradient codec worse, while over 200 steps int4
  with EF ends below int4 without at both seeds of the ef suite (within the
  noise two seeds can resolve). The residual
  is about a quarter of the gradient's norm under AdamW and SGD alike (the
  ratio claims above), so the size of the residual does not explain the early
  harm. A reading the runs fit, not one they prove: AdamW's per-coordinate
  normalisation turns a released residual into a full-size step early in
  training, while its second moments are still small, and the bias feedback
  removes pays back only over more steps.
- No byte crosses a network here: wire bytes are read from the compiled
  program (exact), but the time a wire would save is only projected, by the
  alpha-beta model in experiments/projection.py, whose latency, bandwidth,
  efficiency and codec figures are approximate public numbers or assumptions.
- The projection sends each axis's measured byte ratio through the 20B
  model's analytic message sizes; it assumes no overlap of communication with
  compute, which makes communication, and so every gain, look larger than on
  a system that overlaps them.
"""


def _load(path):
    with open(path) as f:
        return json.load(f)


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


# ---------------------------------------------------------------- page

WITHDRAWN_HEADING = "## Withdrawn: convergence measured with future-token leakage"
WITHDRAWN = (
    "These runs predate row-local blocks and exact evaluation. A quantization block then "
    "spanned two tokens of an activation, so a compressed forward carried token t+1's values "
    "into token t's activation, and val_loss was read through that same forward: every row "
    "that compresses `tensor.act` or `pipeline.act` measured a model that could see part of "
    "the token it predicts. Those rows (and the claims drawn from them) are invalid; rows "
    "that compress only data-parallel gradients or parameters coded no activation and stand. "
    "Kept for the record.")


def evaluated_exactly(summary: dict) -> bool:
    """Whether a convergence summary's runs were evaluated with the exact forward
    (experiments/convergence.py records the compressed-forward loss beside it since)."""
    return any("final_val_loss_compressed" in r for r in summary.get("runs", []))


def build(results, page_dir: str) -> str:
    """The whole RESULTS.md text from the JSON files under `results` (a folder,
    or several: each file is read from the first folder that has it, the
    convergence sets from all of them); links are relative to `page_dir`, where
    the page is written."""
    folders = [results] if isinstance(results, str) else list(results)
    rel = lambda p: os.path.relpath(p, page_dir)

    def load(name):
        path = next((p for p in (os.path.join(f, name) for f in folders) if os.path.exists(p)),
                    None)
        return _load(path) if path else None

    summaries = [(p, _load(p)) for f in folders
                 for p in sorted(glob.glob(os.path.join(f, "convergence*", "summary.json")))]
    proj, col, sz, par = (load("projection.json"), load("collectives.json"),
                          load("collectives_sizes.json"), load("parallel.json"))
    net, gpu, hops = load("network.json"), load("gpu.json"), load("network_hops.json")
    outer, auto = load("network_outer.json"), load("network_auto.json")
    streaming, overlap = load("network_streaming.json"), load("overlap.json")
    auto6, streaming1 = load("network_auto_trial6.json"), load("network_streaming_1dev.json")
    probed, auto4 = load("probelink.json"), load("network_auto_sizes4.json")
    act8, fewest = load("network_auto_act8.json"), load("network_auto_fewest.json")

    commands = [i for _, s in summaries for i in s.get("invocations", [])]
    if proj:
        commands.append(proj["command"])
    if col:
        commands.append(f"python -m benchmarks.collectives --repeats {col['repeats']}")
    if sz:
        commands.append("python -m benchmarks.collectives --sizes")
    if par:
        commands.append(f"python -m benchmarks.parallel --repeats {par['repeats']}")
    if net:
        commands += report_network.commands(net)
    for rig in (hops, outer, auto6, auto4, act8, fewest, streaming, streaming1):
        if rig:
            commands += report_network.commands(rig)
    if probed:
        commands.append(report_probelink.command(probed))
    if overlap:
        commands.append(overlap["command"])
    if gpu:
        commands.append(gpu["command"])
    commands.append("python -m experiments.report")

    page = ["# Benchmark results", "",
            "Generated by `python -m experiments.report` from the JSON files in "
            "`benchmarks/results/` and `experiments/results/`; do not edit by hand.", "",
            f"Commit: `{git_commit()}`", "", "## Commands", "", "```",
            *commands, "```", ""]
    claims = []
    exact = [(p, s) for p, s in summaries if evaluated_exactly(s)]
    leaky = [(p, s) for p, s in summaries if not evaluated_exactly(s)]
    for heading, group in (("## Convergence on the King James Bible", exact),
                           (WITHDRAWN_HEADING, leaky)):
        if not group:
            continue
        page += [heading, ""]
        found = claims if group is exact else []
        if group is leaky:
            page += [WITHDRAWN, ""]
            claims.append(f"Withdrawn: {len(leaky)} convergence result sets measured before "
                          "row-local blocks; their rows that compress forward activations read "
                          "the next token through cross-token blocks (see that section).")
        page += ["Same initial weights, data order and mesh in every run of a set (the (2, 2, 2) "
                 "mesh unless the set names another); bytes are "
                 "what one device sends per training step, read from the compiled step. Gap: "
                 "final val_loss relative to the baseline's of the same length.", ""]
        for path, s in group:
            if s.get("quick"):
                claims.append(f"`{rel(path)}` is a --quick smoke run: its numbers test the "
                              "scripts, not the papers.")
            if len(s.get("seeds", [0])) > 1:
                page += [report_seeds.section(s, rel(os.path.dirname(path)), compressed_what,
                                              table), ""]
                found += report_seeds.claims(s, hybrid_preset_setting(s["settings"]))
                continue
            page += [convergence_section(s, rel(os.path.dirname(path))), ""]
            found += [f"[{s['steps']} steps] {c}" for c in convergence_claims(s)]
        if group is leaky:
            page += ["What these sets were read to show, kept as they were written: each claim "
                     "that rests on a run compressing `tensor.act` or `pipeline.act` is invalid.",
                     ""] + [f"- {c}" for c in found] + [""]
    sweep = [_load(p) for f in folders
             for p in sorted(glob.glob(os.path.join(f, "convergence_lr", "lr*", "summary.json")))]
    if sweep:
        text, lr_claims = lr_section(sweep)
        page += ["## Learning rate of the baseline", "", text, ""]
        claims += lr_claims
    if proj:
        page += ["## Projection to GPT-NeoX-20B", "", projection_section(proj)]
        claims += projection_claims(proj)
    if col:
        page += ["## Compressed collectives (benchmarks/collectives.py)", "",
                 collectives_section(col), ""]
    if sz:
        page += ["## Compressed collectives at every size (benchmarks/collectives.py --sizes)", "",
                 sizes_section(sz), ""]
    if par:
        page += ["## 3-D parallel train step (benchmarks/parallel.py)", "", parallel_section(par), ""]
    if net:
        text, net_claims = report_network.network_section(net, (proj or {}).get("link"))
        page += ["## Wall-clock on a throttled link (experiments/network.py)", "", text, ""]
        claims += net_claims
    rigs = (  # (results, their section, its heading) of the two-hop rig
        (hops, report_hops.hops_section, "Two hops: a throttled link between two processes "
         "(experiments/network.py --hops)"),
        (outer, report_hops.outer_section, "An outer loop across a throttled link "
         "(experiments/network.py --hops, outer-loop policies)"),
        (auto, report_auto.auto_section, "compression.auto across a throttled link "
         "(experiments/network.py --hops, policy auto)"),
        (auto6, report_auto.auto_section, "compression.auto with compression.trial=6 across "
         "a throttled link (experiments/network.py --hops, policy auto)"),
        (auto4, report_auto.auto_section, "compression.auto with the probe of four sizes "
         "across a throttled link (experiments/network.py --hops, policy auto)"),
        (act8, report_auto.auto_section, "compression.auto beside the hybrid preset with "
         "int8 tensor messages, 30-step runs at 100 Mbit/s (experiments/network.py --hops)"),
        (fewest, report_auto.auto_section, "compression.auto whose trial also weighs each "
         "route's fewest bytes, 30-step runs (experiments/network.py --hops, policy auto)"),
        (streaming, report_streaming.streaming_section, "Streaming against blocking syncs across "
         "a throttled link (experiments/network.py --hops, policies diloco_f2 and streaming)"),
        (streaming1, report_streaming.streaming_section, "Streaming against blocking syncs, one "
         "device per process (experiments/network.py --hops --devices 2)"))
    for results, section, heading in rigs:
        if results:
            text, found = section(results)
            page += [f"## {heading}", "", text, ""]
            claims += found
    if probed:
        text, found = report_probelink.report_section(probed)
        page += ["## The probe's link against tc's rate (experiments/probelink.py)", "", text, ""]
        claims += found
    if overlap:
        page += ["## Does an exchange hide behind compute? (experiments/overlap.py)", "",
                 report_streaming.overlap_section(overlap), ""]
    page += ["## GPU (benchmarks/gpu.py)", "", gpu_section(gpu), ""]
    page += ["## What matches the papers, what doesn't, and why", ""]
    page += [f"- {c}" for c in claims] or ["- No convergence or projection results yet."]
    page += ["", WHY]
    return "\n".join(page)


def summarize_studies(studies) -> int:
    """--summarize: runs.jsonl for each study folder; 2 at the first that has no run."""
    for study in studies:
        try:
            print(f"wrote {runlog.write(study)}")
        except ValueError as e:
            print(f"report.py: error: --summarize: {e}", file=sys.stderr)
            return 2
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--results", nargs="+", default=list(RESULTS),
                   help="folders of results; a file is read from the first that has it")
    p.add_argument("--out", default=os.path.join(ROOT, "experiments", "RESULTS.md"))
    p.add_argument("--summarize", nargs="+", metavar="STUDY",
                   help="write each study folder's runs.jsonl from its run folders, and stop")
    args = p.parse_args(argv)
    if args.summarize:
        return summarize_studies(args.summarize)
    for folder in args.results:
        if not os.path.isdir(folder):
            print(f"report.py: error: --results {folder!r} is not a directory", file=sys.stderr)
            return 2
    text = build([os.path.abspath(f) for f in args.results],
                 os.path.dirname(os.path.abspath(args.out)))
    with open(args.out, "w") as f:
        f.write(text)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
