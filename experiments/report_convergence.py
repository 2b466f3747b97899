"""RESULTS.md's sections on convergence studies run at one seed
(convergence*/summary.json of experiments/convergence.py) and on the
baseline's learning-rate sweep (convergence_lr/lr*/summary.json): each set's
table of runs and the claims computed from it (the hybrid and naive targets,
matched byte budgets, codecs per axis, error feedback, where to compress);
report.py calls these. Studies at several seeds are report_seeds.py's.
"""
from __future__ import annotations

import math

from experiments import report_network
from experiments.report_format import AXES, _num, fmt, table
from jcomp.train.run.metrics import human_bytes

GAP_TARGET_PCT = 1.0     # hybrid "reaches baseline loss": within 1% of its val_loss
BYTES_TARGET = 0.25      # and sends at most a quarter of its bytes


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
