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
experiments/results/; see report_network.py, report_streaming.py and
probelink.py for those and gpu.json.
Every number and every PASS/FAIL in the page is computed from those files;
only the explanatory prose is fixed text.

--summarize STUDY ... writes each study's runs.jsonl from its run folders
(experiments/runlog.py) and nothing else: the file that stands in for the run
folders, which git does not keep, when experiments/convergence.py
--summarize-only rebuilds the study's summary.json and plots.
"""
from __future__ import annotations

import argparse
import glob
import json
import math
import os
import subprocess
import sys

from experiments import probelink, report_auto, report_hops, report_network, report_seeds
from experiments import report_streaming, runlog
from jcomp.train.run.metrics import human_bytes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = (os.path.join(ROOT, "benchmarks", "results"),  # --results' default, in this order
           os.path.join(ROOT, "experiments", "results"))

AXES = ("data", "tensor", "pipeline")
GAP_TARGET_PCT = 1.0     # hybrid "reaches baseline loss": within 1% of its val_loss
BYTES_TARGET = 0.25      # and sends at most a quarter of its bytes

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


# ---------------------------------------------------------------- formatting

def fmt(x, spec=".4f", none="n/a") -> str:
    if x is None:
        return none
    if isinstance(x, str):
        return x
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    return format(x, spec)


def table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _load(path):
    with open(path) as f:
        return json.load(f)


def _num(x):
    """JSON numbers stay; the strings "NaN"/"Infinity" (strict JSON) become floats."""
    return {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}.get(x, x) \
        if isinstance(x, str) else x


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


# ---------------------------------------------------------------- convergence

def compressed_what(run: dict) -> str:
    parts = [f"policy {run['policy']}"] if run["policy"] != "baseline" or not run["overrides"] \
        else []
    parts += [f"{k}={v}" for k, v in run["overrides"].items()]
    if run["error_feedback"] != "auto":
        parts.append(f"EF {run['error_feedback']}")
    parts += [flag.replace("--config.", "") for flag in run.get("extra", ())]
    return ", ".join(parts)


# The meter charges a collective-permute to its senders only from this commit on;
# bytes recorded by runs trained before it count every device as a sender.
METER_SENDERS_COMMIT = "86f605c"


def _before_sender_meter(commit: str | None) -> bool:
    if not commit:
        return True
    return not report_network.is_ancestor(METER_SENDERS_COMMIT, commit)


def meter_note(runs) -> str | None:
    old = [r["name"] for r in runs if _before_sender_meter(r.get("git_commit"))]
    if not old:
        return None
    return (f"Wire bytes are as metered when each run trained. {len(old)} of these runs "
            f"({', '.join(old[:4])}{', ...' if len(old) > 4 else ''}) trained before commit "
            f"{METER_SENDERS_COMMIT}, whose meter charged each stage-to-stage send to every "
            "device of the mesh; it is now charged to the device that sends it, which on a "
            "2-stage mesh halves the permute part of the pipeline column (the baseline of "
            "configs/base.py: 2.00 MiB -> 1.50 MiB of pipeline bytes per step). A codec's "
            "pipeline byte ratio to the baseline is unchanged when act and act_grad share it.")


def convergence_section(summary: dict, rel_dir: str) -> str:
    runs = summary["runs"]
    m = summary["model"]
    out = [f"### {rel_dir}: {summary['steps']} steps of {summary['config']}",
           f"Model d_model {m['d_model']}, {m['n_layers']} layers, {m['n_heads']} heads, "
           f"d_ff {m['d_ff']}, vocab {m['vocab_size']}; batch {summary['batch_size']} x "
           f"{summary['seq_len']} tokens; mesh {summary['mesh']}; val_loss every "
           f"{summary['eval_every']} steps; warm-up {summary['warmup_steps']} steps; "
           f"summary written at commit {summary['git_commit']}. The commit column names the "
           f"commit that trained each run where it was recorded.", ""]
    header = ["run", "compressed", "final val_loss", "best val_loss", "gap %",
              *[f"{a} B/step" for a in AXES], "total B/step", "bytes vs baseline", "commit"]
    rows = [[r["name"], compressed_what(r), fmt(_num(r["final_val_loss"])),
             fmt(_num(r["best_val_loss"])), fmt(_num(r.get("gap_pct")), "+.2f"),
             *[human_bytes(r["wire_bytes"][a]) for a in AXES], human_bytes(r["wire_bytes_total"]),
             fmt(r.get("byte_ratio"), ".3f"), (r.get("git_commit") or "-")[:7]] for r in runs]
    out.append(table(header, rows))
    note = meter_note(runs)
    if note:
        out += ["", note]
    for group, png in summary.get("plots", {}).items():
        out.append(f"\n![{group} loss curves]({rel_dir}/{png}) `{rel_dir}/{png}`")
    return "\n".join(out)


def hybrid_preset_setting(settings: list[dict]) -> str | None:
    """The name of the setting whose policy is jcomp.gpt.policy's hybrid preset, or None."""
    from jcomp.gpt import policy

    target = policy.preset("hybrid")
    for st in settings:
        if any(k.count(".") != 1 for k in st["overrides"]) or st.get("extra"):
            continue  # layer or stage selections, other optimizers: not a preset
        ef = {"on": True, "off": False}.get(st["error_feedback"])
        if policy.build(st["policy"], st["overrides"], ef) == target:
            return st["name"]
    return None


def _by_name(summary):
    return {r["name"]: r for r in summary["runs"]}


def closest_bytes_pair(runs: list[dict], anchor: str):
    """The run (other than `anchor` and baseline) whose total bytes are closest to
    the anchor's, or None."""
    by = {r["name"]: r for r in runs}
    if anchor not in by:
        return None
    others = [r for r in runs if r["name"] not in (anchor, "baseline")]
    if not others:
        return None
    a = by[anchor]["wire_bytes_total"]
    return min(others, key=lambda r: abs(math.log(r["wire_bytes_total"] / a)))


def convergence_claims(summary: dict) -> list[str]:
    """Statements computed from one summary's numbers."""
    by = _by_name(summary)
    out = []
    h, n = by.get("hybrid"), by.get("naive")
    if h and h.get("gap_pct") is not None:
        gap, ratio = _num(h["gap_pct"]), h["byte_ratio"]
        ok_gap = gap <= GAP_TARGET_PCT
        ok_bytes = ratio <= BYTES_TARGET
        out.append(f"Hybrid reached a final val_loss {gap:+.2f}% from the baseline's with "
                   f"{ratio:.3f} of its bytes per step: {'PASS' if ok_gap else 'FAIL'} against "
                   f"the {GAP_TARGET_PCT:g}% loss target, {'PASS' if ok_bytes else 'FAIL'} "
                   f"against the 1/4 bytes target.")
    if h and n and h.get("gap_pct") is not None and n.get("gap_pct") is not None:
        hg, ng = _num(h["gap_pct"]), _num(n["gap_pct"])
        verdict = "matches" if ng > hg else "does not match"
        out.append(f"Naive (int4 everywhere) ended {ng:+.2f}% from baseline, hybrid {hg:+.2f}%, "
                   f"with {n['byte_ratio']:.3f} vs {h['byte_ratio']:.3f} of the baseline's bytes. "
                   f"The paper's finding that naive degrades the loss more than hybrid "
                   f"{verdict} here.")
    seen = set()
    for anchor in ("naive", "hybrid"):
        other = closest_bytes_pair(summary["runs"], anchor)
        if other and frozenset((anchor, other["name"])) in seen:
            continue
        if other:
            seen.add(frozenset((anchor, other["name"])))
        if other and by[anchor].get("gap_pct") is not None and other.get("gap_pct") is not None:
            a, o = by[anchor], other
            better = a["name"] if _num(a["gap_pct"]) < _num(o["gap_pct"]) else o["name"]
            out.append(f"At a matched byte budget: {a['name']} ({a['byte_ratio']:.3f} of baseline "
                       f"bytes, gap {_num(a['gap_pct']):+.2f}%) vs the closest-bytes run "
                       f"{o['name']} ({o['byte_ratio']:.3f}, gap {_num(o['gap_pct']):+.2f}%): "
                       f"{better} has the lower loss.")
    out += best_claims(summary["runs"]) + data_codec_claims(by) + ae_claims(by)
    out += ef_claims(by) + act_claims(by) + ablation_claims(by) + places_claims(by)
    out += noise_claims(by)
    return out


def _meets(r) -> bool:
    return (r.get("gap_pct") is not None and _num(r["gap_pct"]) <= GAP_TARGET_PCT
            and r["byte_ratio"] <= BYTES_TARGET)


def best_claims(runs: list[dict]) -> list[str]:
    """The fewest-bytes run that meets both targets (loss within 1%, bytes <= 1/4)."""
    if not any(r["name"] == "baseline" for r in runs):
        return []
    ok = sorted((r for r in runs if r["name"] != "baseline" and _meets(r)),
                key=lambda r: r["byte_ratio"])
    if not ok:
        return [f"No run here meets both targets (val_loss within {GAP_TARGET_PCT:g}% of the "
                "baseline's and at most 1/4 of its bytes)."]
    b = ok[0]
    others = ", ".join(f"{r['name']} ({r['byte_ratio']:.3f}, {_num(r['gap_pct']):+.2f}%)"
                       for r in ok[1:])
    return [f"Best per-axis setting meeting both targets: {b['name']} = {compressed_what(b)}, "
            f"{b['byte_ratio']:.3f} of the baseline's bytes at a gap of "
            f"{_num(b['gap_pct']):+.2f}%." + (f" Also meeting both: {others}." if others else "")]


def data_codec_claims(by: dict) -> list[str]:
    """Among data-gradient codecs alone, the fewest data-axis bytes within the loss target."""
    runs = [r for n, r in by.items() if n.startswith("grad_") and r.get("gap_pct") is not None]
    if not runs:
        return []
    ok = sorted((r for r in runs if _num(r["gap_pct"]) <= GAP_TARGET_PCT),
                key=lambda r: r["wire_bytes"]["data"])
    psgd = [r for r in runs if "powersgd" in r["name"]]
    line = ("Data-gradient codecs alone: " + (
        f"the fewest data-axis bytes within {GAP_TARGET_PCT:g}% of the baseline's loss is "
        f"{ok[0]['name']} ({ok[0]['byte_ratio_by_axis']['data']:.3f} of baseline's data bytes, "
        f"gap {_num(ok[0]['gap_pct']):+.2f}%)." if ok else
        f"none stays within {GAP_TARGET_PCT:g}% of the baseline's loss."))
    for r in psgd:
        line += (f" {r['name']}: {r['byte_ratio_by_axis']['data']:.3f} of the data bytes, gap "
                 f"{_num(r['gap_pct']):+.2f}%.")
    return [line]


def ae_claims(by: dict) -> list[str]:
    runs = [r for n, r in by.items() if n.startswith("act_ae") and r.get("gap_pct") is not None]
    return [f"Learned autoencoder on tensor activations ({r['name']}, "
            f"{compressed_what(r)}): {r['byte_ratio_by_axis']['tensor']:.3f} of the baseline's "
            f"tensor bytes, gap {_num(r['gap_pct']):+.2f}%"
            + (f"; int8 on tensor and pipeline (act_int8) had gap "
               f"{_num(by['act_int8']['gap_pct']):+.2f}% at "
               f"{by['act_int8']['byte_ratio_by_axis']['tensor']:.3f} of the tensor bytes."
               if "act_int8" in by and by["act_int8"].get("gap_pct") is not None else ".")
            for r in runs]


def noise_claims(by: dict) -> list[str]:
    """Compressed runs that beat the baseline show how large pure noise is here."""
    gaps = [(_num(r["gap_pct"]), n) for n, r in by.items()
            if n != "baseline" and r.get("gap_pct") is not None]
    if not gaps or min(gaps)[0] >= 0:
        return []
    g, name = min(gaps)
    return [f"{name} ended {g:+.2f}% from the baseline, below it: with one seed per setting, "
            f"gaps within about {abs(g):.1f}% of zero are not told apart from noise at this length."]


def ef_claims(by: dict) -> list[str]:
    pairs = [(k[:-len("_efon")], by[k], by.get(k[:-len("_efon")] + "_efoff"))
             for k in by if k.startswith("grad_") and k.endswith("_efon")]
    pairs = [(n, on, off) for n, on, off in pairs if off and on.get("gap_pct") is not None
             and off.get("gap_pct") is not None]
    if not pairs:
        return []
    helped = [n for n, on, off in pairs if _num(on["gap_pct"]) < _num(off["gap_pct"])]
    detail = "; ".join(f"{n[5:]}: {_num(on['gap_pct']):+.2f}% with, {_num(off['gap_pct']):+.2f}% "
                       f"without" for n, on, off in pairs)
    return [f"Error feedback on data.grad lowered the final loss gap at {len(helped)} of "
            f"{len(pairs)} strengths ({detail})."]


def act_claims(by: dict) -> list[str]:
    order = [n for n in ("act_int8", "act_int4", "act_int2") if n in by
             and by[n].get("gap_pct") is not None]
    if len(order) < 2:
        return []
    gaps = [_num(by[n]["gap_pct"]) for n in order]
    mono = all(a <= b for a, b in zip(gaps, gaps[1:]))
    detail = ", ".join(f"{n[4:]} {g:+.2f}%" for n, g in zip(order, gaps))
    return [f"Tensor/pipeline activation compression without error feedback: {detail}; the gap "
            f"{'grows' if mono else 'does not grow monotonically'} as bits fall, "
            f"{'as' if mono else 'unlike what'} the activation-compression study leads one to expect."]


def ablation_claims(by: dict) -> list[str]:
    rows = [by[f"only_{a}"] for a in AXES if f"only_{a}" in by
            and by[f"only_{a}"].get("gap_pct") is not None]
    if not rows:
        return []
    base = by["baseline"]["wire_bytes_total"]
    saved = {r["name"][5:]: (base - r["wire_bytes_total"]) / base for r in rows}
    top = max(saved, key=saved.get)
    detail = "; ".join(f"{r['name'][5:]}: gap {_num(r['gap_pct']):+.2f}%, saves "
                       f"{saved[r['name'][5:]]:.1%} of the bytes" for r in rows)
    return [f"One axis compressed at a time: {detail}. Compressing {top} alone saves the most."]


def places_claims(by: dict) -> list[str]:
    """One axis's codec everywhere against the same codec in part of its layers or stages."""
    out = []
    for axis in ("tensor", "pipeline"):
        whole = next((r for n, r in by.items() if n.startswith(f"{axis}_")
                      and "_layers_" not in n and "_stages_" not in n
                      and r.get("gap_pct") is not None), None)
        parts = [r for n, r in by.items() if n.startswith(f"{axis}_")
                 and ("_layers_" in n or "_stages_" in n) and r.get("gap_pct") is not None]
        if not whole or not parts:
            continue
        line = lambda r: (f"{r['name']} gap {_num(r['gap_pct']):+.2f}% at "
                          f"{r['byte_ratio_by_axis'][axis]:.3f} of the {axis} bytes")
        best = min(parts, key=lambda r: _num(r["gap_pct"]))
        out.append(f"Where to compress {axis}: {line(whole)}; " + "; ".join(map(line, parts))
                   + f". Of the halves, {best['name']} costs the least loss.")
    return out


# ---------------------------------------------------------------- projection

def projection_section(proj: dict) -> str:
    out = [f"Computed by `{proj['command']}`; byte ratios per axis measured on the compiled "
           f"step of the runs in `{proj['measured_from']}`. GPT-NeoX-20B shapes "
           f"(configs/neox20b.py), mesh {proj['shape']['mesh']}, batch {proj['shape']['batch']}, "
           f"{proj['shape']['microbatches']} microbatches.", ""]
    for name, res in proj["clusters"].items():
        c = res["cluster"]
        out.append(f"#### {name}: {res['gpus']} GPUs, {c['gpus_per_node']} per node, placement "
                   f"{res['placement']}")
        header = ["policy", "step s", "compute s", *[f"{a} comm s" for a in AXES], "codec s",
                  "TFLOPS/GPU", "samples/s", "gain %", "paper TFLOPS / samples gain %"]
        rows = []
        for pol, r in res["policies"].items():
            paper = r.get("paper")
            rows.append([pol, fmt(r["total_s"], ".3f"), fmt(r["compute_s"], ".3f"),
                         *[fmt(r["comm_s"][a], ".3f") for a in AXES], fmt(r["codec_s"], ".3f"),
                         fmt(r["tflops_per_gpu"], ".1f"), fmt(r["samples_per_s"], ".2f"),
                         fmt(r["gain_pct"], "+.1f"),
                         f"+{paper['tflops_gain_pct']} / +{paper['samples_gain_pct']}"
                         if paper else "-"])
        out += [table(header, rows), ""]
    return "\n".join(out)


def projection_claims(proj: dict) -> list[str]:
    out = []
    for name, res in proj["clusters"].items():
        p = res["policies"]
        if not {"naive", "hybrid"} <= set(p):
            continue
        ng, hg = p["naive"]["gain_pct"], p["hybrid"]["gain_pct"]
        pn, ph = proj["paper"]["naive"], proj["paper"]["hybrid"]
        order = "matches" if (ng > hg) == (pn["tflops_gain_pct"] > ph["tflops_gain_pct"]) \
            else "does not match"
        out.append(f"Projected on {name}: naive {ng:+.1f}%, hybrid {hg:+.1f}% throughput over "
                   f"baseline; the paper measured naive +{pn['tflops_gain_pct']}% TFLOPS / "
                   f"+{pn['samples_gain_pct']}% samples/s and hybrid +{ph['tflops_gain_pct']}% / "
                   f"+{ph['samples_gain_pct']}% on Lassen. The order naive > hybrid {order}; "
                   f"naive is {ng - pn['tflops_gain_pct']:+.1f} points and hybrid "
                   f"{hg - ph['tflops_gain_pct']:+.1f} points off the paper's TFLOPS gains.")
        b = p["baseline"]
        share = sum(b["comm_s"].values()) / b["total_s"]
        need = 1 - 1 / (1 + pn["tflops_gain_pct"] / 100)
        hidden = {pol: max(r["compute_s"], sum(r["comm_s"].values())) + r["codec_s"]
                  for pol, r in p.items() if "compute_s" in r and "codec_s" in r}
        if len(hidden) == len(p):
            out.append(f"On {name}, with communication fully hidden behind compute (as on the "
                       f"throttled link of experiments/network.py wherever it is the shorter of the "
                       f"two) instead of added to it: naive "
                       f"{100 * (hidden['baseline'] / hidden['naive'] - 1):+.1f}%, hybrid "
                       f"{100 * (hidden['baseline'] / hidden['hybrid'] - 1):+.1f}%: only the "
                       f"codec's time would remain of what compression changes. That is the "
                       f"other bound: on GPUs Megatron's tensor-parallel all-reduces sit on the "
                       f"critical path, and only the data-parallel traffic overlaps the "
                       f"backward pass.")
        out.append(f"On {name} the projected baseline spends {share:.1%} of its step "
                   f"communicating, which bounds any gain from compression at "
                   f"{100 * (1 / (1 - share) - 1):+.1f}%; the paper's naive gain needs at least "
                   f"{need:.1%} of the baseline step to be communication that compression "
                   f"removes.")
    return out


# ---------------------------------------------------------------- micro benchmarks

def collectives_section(col: dict) -> str:
    size = max(r["elements"] for r in col["rows"])
    rows = [[r["op"], r["axis"], r["codec"], human_bytes(r["bytes_per_device"]),
             fmt(r["byte_ratio"], ".3f"), fmt(r["rel_err"], ".2e"), fmt(r["time_ratio"], ".2f")]
            for r in col["rows"] if r["elements"] == size]
    head = (f"{col['device_count']} {col['backend']} devices, mesh {col['mesh']}, "
            f"{size} float32 elements per device, median of {col['repeats']} calls; date "
            f"{col['date']}.")
    out = head + "\n\n" + table(["op", "axis", "codec", "bytes/device", "bytes vs lax",
                                 "rel. error", "time vs lax"], rows)
    structured = [r for r in col.get("structured_rows", [])
                  if r["matrix"][0] * r["matrix"][1] == size]
    if structured:
        out += ("\n\nStructured codecs beside the jax.lax op they replace, on [m, n] matrices: "
                "PowerSGD (one call from a random Q, no warm start) on a rank-4 matrix shared by "
                "the devices plus 10% noise of each device's own; the autoencoder untrained (a "
                "random orthonormal projection to n/4, so its error is not a trained one's).\n\n"
                + table(["codec", "axis", "vs", "matrix", "bytes/device", "bytes vs lax",
                         "rel. error", "time vs lax"],
                        [[r["codec"], r["axis"], r["reference"],
                          f"{r['matrix'][0]}x{r['matrix'][1]}", human_bytes(r["bytes_per_device"]),
                          fmt(r["byte_ratio"], ".3f"), fmt(r["rel_err"], ".2e"),
                          fmt(r["time_ratio"], ".2f")] for r in structured]))
    return out


def sizes_section(sz: dict) -> str:
    """Bytes vs jax.lax per op, codec and axis size, one column per size."""
    sizes = sorted({r["elements"] for r in sz["rows"]})
    keys = list(dict.fromkeys((r["op"], r["codec"], r["n"]) for r in sz["rows"]))
    by = {(r["op"], r["codec"], r["n"], r["elements"]): r for r in sz["rows"]}
    cell = lambda r: "-" if r is None or r["ratio"] is None else (
        "raw" if r["raw"] else fmt(r["ratio"], ".3f"))
    rows = [[op, codec, n] + [cell(by.get((op, codec, n, e))) for e in sizes]
            for op, codec, n in keys]
    head = (f"{sz['backend']} backend, jax {sz['jax_version']}, commit {sz['commit']}, date "
            f"{sz['date']}. Bytes one device sends per call relative to the jax.lax op, read "
            "from each compiled program; raw = sent uncompressed (exactly lax's bytes). "
            + ("Checks: pass." if not sz["violations"] else
               "Checks failed: " + "; ".join(sz["violations"])))
    return head + "\n\n" + table(["op", "codec", "n"] + [str(e) for e in sizes], rows)


def lr_section(sweep: list) -> tuple[str, list[str]]:
    """The baseline's learning-rate sweep (convergence_lr/lr*/summary.json, each the
    baseline at one rate): a table and the rate every setting then runs at."""
    rows = sorted((s["lr"], r["seed"], r["final_val_loss"], (r.get("git_commit") or "-")[:7],
                   s["steps"]) for s in sweep for r in s["runs"] if r["name"] == "baseline")
    best = min(rows, key=lambda r: r[2])
    text = "\n".join([
        "The uncompressed baseline at each learning rate (`python -m experiments.convergence "
        "--suite seeds --only baseline --steps 600 --seeds 0 --lr LR --out "
        "experiments/results/convergence_lr/lrLR`); the seeds suite runs every setting at the "
        "rate with the lowest final val_loss.", "",
        table(["optim.lr", "seed", "steps", "final val_loss", "commit"],
              [[f"{lr:g}", seed, steps, f"{v:.4f}", c] for lr, seed, v, c, steps in rows])])
    edge = best[0] in (rows[0][0], rows[-1][0])
    claim = (f"Learning-rate sweep of the baseline ({', '.join(f'{r[0]:g}' for r in rows)}; "
             f"seed {rows[0][1]}, {rows[0][4]} steps): the lowest final val_loss is at "
             f"{best[0]:g} ({best[2]:.4f})" + (", the edge of the swept range: a higher rate "
                                             "may do better" if edge else "") + ".")
    return text, [claim]


def parallel_section(par: dict) -> str:
    rows = [[",".join(map(str, r["shape"])), r["policy"], r["microbatches"], fmt(r["time_s"], ".3f"),
             fmt(r.get("time_ratio"), ".2f"), human_bytes(r["wire_bytes_total"]),
             fmt(r.get("wire_ratio"), ".3f"), fmt(r["predicted_bubble"], ".2f"),
             fmt(r.get("measured_bubble"), ".2f")] for r in par["rows"]]
    head = f"{par['device_count']} {par['backend']} devices; model {par['model']}; date {par['date']}."
    return head + "\n\n" + table(["mesh d,t,p", "policy", "M", "step s", "time vs baseline",
                                  "bytes/step", "bytes vs baseline", "bubble pred.",
                                  "bubble meas."], rows)


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
        commands.append(probelink.command(probed))
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
        text, found = probelink.report_section(probed)
        page += ["## The probe's link against tc's rate (experiments/probelink.py)", "", text, ""]
        claims += found
    if overlap:
        page += ["## Does an exchange hide behind compute? (experiments/overlap.py)", "",
                 report_streaming.overlap_section(overlap), ""]
    page += ["## GPU (benchmarks/gpu.py)", "", report_network.gpu_section(gpu), ""]
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
