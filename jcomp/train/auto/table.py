"""compression.auto's decision as the trainer prints it before training."""
from __future__ import annotations

from jcomp.train.auto.pick import FEWEST


def _human(n: float) -> str:
    from jcomp.train.run.traffic import human
    return human(n)


def table(summary: dict) -> str:
    """The decision as the trainer prints it before training."""
    head = ("entry", "link (latency, bandwidth)", "codec", "bytes/step raw -> coded",
            "comm ms: chosen", "raw")
    rows = [head]
    for entry, e in summary["entries"].items():
        rows.append((entry, f"{e['latency_s'] * 1e6:.3g} us, {e['bytes_per_s'] / 1e9:.3g} GB/s",
                     e["codec"], f"{_human(e['raw_bytes'])} -> {_human(e['coded_bytes'])}",
                     f"{e['seconds'] * 1e3:.4g}", f"{e['raw_seconds'] * 1e3:.4g}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["compression.auto: codecs chosen from measured links (" + summary["source"] + "):"]
    lines += ["  " + "  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows]
    raw, now = summary["raw_seconds"], summary["seconds"]
    for route, r in summary.get("routes", {}).items():
        lines.append(f"  route {route}: {r['seconds'] * 1e3:.4g} ms predicted")
    if summary.get("outer"):
        lines.append(f"  route taken: an outer loop across mesh.dcn_data={summary['dcn_data']}"
                     f" islands, syncing every {summary['outer']['every']} steps "
                     f"({summary['outer']['codec']} pseudo-gradients; allowed by "
                     "compression.budget's outer=H)")
    elif summary.get("dcn_data", 1) > 1:
        lines.append(f"  route taken: per hop, mesh.dcn_data={summary['dcn_data']}")
    if (summary.get("trial") or {}).get("taken", "").endswith(FEWEST):
        lines.append("  codecs taken: the budget's most compressed on that route, timed "
                     "fastest in the trial")
    if summary.get("not_weighed"):
        lines.append(f"  {summary['not_weighed']}")
    lines.append(f"  predicted communication per step: {now * 1e3:.4g} ms vs {raw * 1e3:.4g} ms "
                 f"uncompressed ({now / raw if raw else 1.0:.2f}x; overlap "
                 f"{summary['overlap']:g}; {summary['device']})")
    t = summary.get("trial")
    if t:
        timed = ", ".join(f"{name} {sec:.4g} s" for name, sec in t["measured_s"].items())
        lines.append(f"  trial ({t['steps']} steps each, median): {timed}; taken: {t['taken']}")
        lines.append(f"  predicted step: {summary['step_s']:.4g} s (its trial) vs "
                     f"{summary['raw_step_s']:.4g} s uncompressed (model: "
                     f"{t['predicted_s'][t['taken']]:.4g} s with compute "
                     f"{t['compute_s']:.4g} s from the uncompressed trial)")
    elif summary.get("step_s") is not None:
        lines.append(f"  predicted step: {summary['step_s']:.4g} s vs {summary['raw_step_s']:.4g} s "
                     f"uncompressed (compute {summary['compute_s']:.4g} s, "
                     "compression.compute_s)")
    return "\n".join(lines)
