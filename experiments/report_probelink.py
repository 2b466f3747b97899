"""RESULTS.md's section on the probe's link against tc's rate (probelink.json of
experiments/probelink.py): per rate, the probe's link figure over the runs of
the newest commit and each psum size's, with the claims checking the probe
within WITHIN of tc's rate; and the command that wrote those rows. report.py
calls these."""
from __future__ import annotations

import re
import statistics

from experiments.probelink import DEVICES_PER_PROCESS
from experiments.report_network import _f, _table
from tools.netns import rate_bits


WITHIN = 0.15  # the probe's link within this of tc's rate


def _newest(data: dict) -> list[dict]:
    """The rows of the commit of the last row written."""
    commit = data["rows"][-1]["commit"]
    return [r for r in data["rows"] if r["commit"] == commit]


def command(data: dict) -> str:
    """The command that wrote the newest commit's rows."""
    rows = _newest(data)
    rates = sorted({r["rate"] for r in rows}, key=rate_bits)
    return (f"python -m experiments.probelink --rates {' '.join(rates)} "
            f"--repeats {1 + max(r['repeat'] for r in rows)} --burst {rows[0]['burst']}")


def report_section(data: dict) -> tuple[str, list[str]]:
    """(markdown, claims) for probelink.json: per rate, the probe's link against
    tc's rate over the runs of the newest commit, and each psum size's."""
    if not data.get("rows"):
        return "No probelink.py run yet.", []
    rows = _newest(data)
    commit = rows[0]["commit"]
    rates = sorted({r["rate"] for r in rows}, key=rate_bits)
    sizes = sorted({int(s) for r in rows for s in r["psum_over_tc_by_size"]})
    table, claims = [], []
    for rate in rates:
        rs = [r for r in rows if r["rate"] == rate]
        ratio = [r["link_over_tc"] for r in rs]
        timed = sorted({m.group(1) if m else "?" for m in
                        (re.search(r"sizes (\[[^]]*\])", r["comment"]) for r in rs)})
        by_size = [[r["psum_over_tc_by_size"][str(s)] for r in rs
                    if str(s) in r["psum_over_tc_by_size"]] for s in sizes]
        table.append([rate, len(rs),
                      _f(statistics.median(r["link_bytes_per_s"] for r in rs) / 1e6, ".2f"),
                      f"{statistics.median(ratio):.3f} ({min(ratio):.3f}-{max(ratio):.3f})",
                      "; ".join(timed)]
                     + [_f(statistics.median(v) if v else None, ".2f") for v in by_size]
                     + [statistics.median(r["retransmitted_segments"] for r in rs)])
        ok = all(abs(x - 1) <= WITHIN for x in ratio)
        claims.append(f"The probe's link at {rate}: {statistics.median(ratio):.3f}x tc's rate, "
                      f"{min(ratio):.3f}-{max(ratio):.3f} over {len(rs)} runs: "
                      f"{'PASS' if ok else 'FAIL'} (every run within {WITHIN:.0%}).")
    earlier = {}
    for r in data["rows"]:
        if r["commit"] != commit:
            earlier.setdefault(r["commit"], []).append(r["link_over_tc"])
    if earlier:
        table_note = "Earlier commits in the file, probe x tc over all their runs: " + "; ".join(
            f"{c[:7]} {min(v):.3f}-{max(v):.3f} ({len(v)} runs)" for c, v in earlier.items()) + "."
    dirty = " (tracked files differed from it)" if any(r["dirty"] for r in rows) else ""
    text = [f"Commit {commit[:7]}{dirty}; burst {rows[0]['burst']}. Two processes of "
            f"{DEVICES_PER_PROCESS} CPU devices in namespaces of their own, only the veth "
            "between them throttled; `jcomp.tune.probe` on the mesh compression.auto probes "
            "for its per-hop route, then the 'dcn' psum alone at each size (median of its "
            "calls). Figures across: per device x the devices of a process, against tc's rate; "
            "medians over runs.", "",
            _table(["tc rate", "runs", "probe MB/s", "probe x tc (range)", "sizes the probe timed"]
                   + [f"psum {s >> 10} KiB x tc" for s in sizes] + ["retransmitted"], table)]
    if earlier:
        text += ["", table_note]
    return "\n".join(text), claims
