"""What the train step sends, as the trainer shows it: the table a run starts
with and the closing line's bytes (the progress bar shows the total in MB).

    now = read(report, plan)              # the compiled step by axis and kind
    other = estimate(report, plan, other_plan, d_model, "float32")  # a model, or None
    print(start_text(report, plan, n_layers=4, mesh_shape=..., row=128, act_dtype="float32"))
    closing(total, uncompressed, measured)   # "1.56 MB/step sent per device, ~0.16x ..."

Two kinds of figures, never mixed. `read` takes the compiled step's wire report
(jcomp.meter.wire): its axis totals are the metrics file's wire_bytes_*.
`estimate` is a model, for a plan that was not compiled: each message's
measured bytes times the ratio of the other plan's codec's bytes to this
plan's, on rows as the message codes them (a token's d_model features; a long
flat buffer for the optimizer's gradients and parameters). It knows nothing of
the ZeRO layout, which a compressed run pads so that small leaves fill whole
codec blocks: from an uncompressed step it misses that padding, and from a
compressed step it gives the uncompressed step in that padded layout (on
configs/tiny.py exactly what the run's uncompressed warm-up phase measures).
Against the other preset's compiled step, baseline to hybrid and back:
configs/base.py -0.3% and +0.1%; configs/tiny.py, whose leaves are small,
-8.9% and +8.9%. Every figure is bytes per device per step, averaged over
the mesh.

On a mesh with two data hops (mesh.dcn_data > 1) the table has a 'dcn' row:
what crosses between the slow-hop groups, beside the 'data' row inside them.
"""
from __future__ import annotations

import dataclasses
import textwrap
from typing import Mapping

import jax.numpy as jnp
import numpy as np

from jcomp import codecs
from jcomp.gpt import messages
from jcomp.gpt import policy as policy_lib
from jcomp.meter import wire

KINDS = ("grad", "param", "act", "act_grad", "other")  # policy kinds; other: no message
AXES = ("dcn", "data", "tensor", "pipeline")  # dcn: the slow hop, on a split data axis
SEVERAL = "2+ axes"  # scalar reductions (loss, norms) over several axes, and any over none
# A flat optimizer buffer long enough that a block codec's ratio is its long-row one.
_FLAT_ELEMENTS = 1 << 20
WIDTH = 88  # the start table's text lines wrap here


@dataclasses.dataclass(frozen=True)
class Traffic:
    """Bytes per device per step (mesh average) by (row, kind): a row is a mesh
    axis of AXES or SEVERAL, a kind one of KINDS."""

    cells: Mapping[tuple[str, str], float]
    estimated: bool = False

    def row(self, name: str) -> float:
        return float(sum(v for (r, _), v in self.cells.items() if r == name))

    def column(self, kind: str) -> float:
        return float(sum(v for (_, k), v in self.cells.items() if k == kind))

    def total(self) -> float:
        return float(sum(self.cells.values()))

    def rows(self) -> list[str]:
        return [r for r in (*AXES, SEVERAL) if any(k[0] == r for k in self.cells)]


def _row_of(c: wire.Collective) -> str:
    return c.axes[0] if len(c.axes) == 1 and c.axes[0] in AXES else SEVERAL


def _kinds_by_message(plan: messages.Plan) -> dict[str, str]:
    return {m.name: m.entry.partition(".")[2] for m in plan.messages()}


def _cells(report: wire.WireReport, plan: messages.Plan, factor: Mapping[str, float]) -> dict:
    """{(row, kind): bytes}, each collective's bytes times its message's factor (1
    for messages without one)."""
    kind_of = _kinds_by_message(plan)
    cells: dict = {}
    for c in report.collectives:
        key = (_row_of(c), kind_of.get(c.message, "other"))
        cells[key] = cells.get(key, 0.0) + c.total_bytes * factor.get(c.message, 1.0)
    return cells


def read(report: wire.WireReport, plan: messages.Plan) -> Traffic:
    """The compiled step's bytes by axis and the policy kind of the message each
    collective belongs to ("other" for the few outside any message)."""
    return Traffic(_cells(report, plan, {}))


def codec_ratio(codec, rows: str, row: int, dtype) -> float | None:
    """Bytes `codec` sends per byte of the raw array, on rows of `row` elements
    coded one by one (rows="independent") or on one long flat buffer ("flat");
    None for codecs whose bytes depend on more than the row (PowerSGD, learned)."""
    codec = codecs.parse(codec)
    if codec.kind == "identity":
        return 1.0
    if codec.kind not in ("dense", "sparse"):
        return None
    n = int(row) if rows == "independent" else _FLAT_ELEMENTS
    fitted = codecs.fit_row(codec, n) if rows == "independent" else codecs.fit(codec, n)
    raw = n * jnp.dtype(dtype).itemsize
    # A collective whose codec cannot beat the raw bytes sends them raw.
    return min(fitted.wire_bytes((1, n), dtype) / raw, 1.0)


def _message_ratio(m: messages.Message, row: int, act_dtype) -> float | None:
    """The mean ratio over the message's places: each place (layer, stage) sends
    the same shapes, so each carries an equal share of the message's bytes."""
    dtype = jnp.float32 if m.rows == "flat" else act_dtype  # gradients and masters: float32
    ratios = [codec_ratio(c, m.rows, row, dtype) for c in m.codecs]
    return None if any(r is None for r in ratios) else float(np.mean(ratios))


def estimate(report: wire.WireReport, plan: messages.Plan, other: messages.Plan, row: int,
             act_dtype) -> Traffic | None:
    """What the step would send under `other` (a plan of the same model on the
    same mesh), from `report` (the compiled step of `plan`) and the two plans'
    codecs: see the module doc. None where a codec's bytes are not a ratio."""
    mine = {m.name: m for m in plan.messages()}
    theirs = {m.name: m for m in other.messages()}
    if set(theirs) - set(mine):
        return None  # a message this step does not send: nothing measured to scale
    factor = {}
    for name, m in mine.items():
        if name not in theirs:  # e.g. the autoencoder's gradients: `other` has none
            factor[name] = 0.0
            continue
        was, new = _message_ratio(m, row, act_dtype), _message_ratio(theirs[name], row, act_dtype)
        if was is None or new is None:
            return None
        factor[name] = new / was
    return Traffic(_cells(report, plan, factor), estimated=True)


# ------------------------------------------------------------------ text

def human(n: float) -> str:
    """Decimal units, three significant digits: '8 B', '34.1 kB', '9.79 MB'."""
    if round(n) < 1000:
        return f"{n:.0f} B"
    for unit in ("kB", "MB", "GB", "TB"):
        n /= 1000
        digits = 2 if n < 10 else 1 if n < 100 else 0
        if round(n, digits) < 1000 or unit == "TB":  # never "1000 kB"
            return f"{n:.{digits}f} {unit}"


def codecs_line(plan: messages.Plan) -> str:
    """The plan's compressed entries grouped by codec: "int4:rot on data.grad,
    tensor.act; int8 on data.param"."""
    by_codec: dict[str, list[str]] = {}
    for m in plan.messages():
        if m.compressed() and m.entry not in by_codec.get(m.describe(), []):
            by_codec.setdefault(m.describe(), []).append(m.entry)
    return "; ".join(f"{c} on {', '.join(e)}" for c, e in by_codec.items()) or "none"


def start_table(now: Traffic, other: Traffic | None, *, compressed: bool, other_name: str,
                footnote: list[str]) -> str:
    """The start table: `now` by axis and kind, the axis totals (metrics.jsonl's
    wire_bytes_<axis>; SEVERAL sums the keys of several axes) and the total, with
    `other` (named `other_name`) beside the totals when given. `compressed`:
    whether `now` is the compressed one of the two (for the ratio)."""
    kinds = [k for k in KINDS if now.column(k) > 0 or (other and other.column(k) > 0)]
    head = ["axis", *kinds, "total"] + ([f"| {other_name}*"] if other else [])
    body = []
    for r in now.rows() + ["total"]:
        cell = now.column if r == "total" else lambda k, r=r: now.cells.get((r, k), 0.0)
        line = [r] + [human(cell(k)) if cell(k) else "-" for k in kinds]
        line.append(human(now.total() if r == "total" else now.row(r)))
        if other:
            theirs = other.total() if r == "total" else other.row(r)
            text = f"| ~{human(theirs)}"
            if r == "total" and now.total() and theirs:
                ratio = now.total() / theirs if compressed else theirs / now.total()
                text += f" ({ratio:.2f}x)"
            line.append(text)
        body.append(line)
    widths = [max(len(x[i]) for x in [head] + body) for i in range(len(head))]
    fmt = lambda cells: "  " + "  ".join(
        c.ljust(w) if i == 0 or c.startswith("|") else c.rjust(w)
        for i, (c, w) in enumerate(zip(cells, widths))).rstrip()
    return "\n".join(["Bytes sent per device per step (mesh average), read from the compiled "
                      "train step:", fmt(head),
                      *map(fmt, body), *footnote])


def closing(total: float, uncompressed: float | None, measured: bool) -> str:
    """The closing line's traffic: "9.79 MB/step sent per device", and for a
    compressed step its ratio to the uncompressed one (`measured`: read from a
    compiled uncompressed step rather than estimated from the message plan)."""
    text = f"{human(total)}/step sent per device"
    if uncompressed:
        how = "measured" if measured else "estimated from the message plan"
        text += f", {'' if measured else '~'}{total / uncompressed:.2f}x the uncompressed " \
                f"{human(uncompressed)} ({how})"
    return text


# ------------------------------------------------------------------ a run's

def compresses(plan: messages.Plan) -> bool:
    """Whether any message the step sends is coded."""
    return any(m.compressed() for m in plan.messages())


def preset_plan(name: str, n_layers: int, mesh_shape: Mapping[str, int]) -> messages.Plan:
    return messages.plan(policy_lib.preset(name), n_layers, mesh_shape)


def start_text(report: wire.WireReport, plan: messages.Plan, *, n_layers: int,
               mesh_shape: Mapping[str, int], row: int, act_dtype) -> str:
    """The table a run starts with: what its compiled step (`report`, of `plan`)
    sends, and beside it, estimated from the message plan, what the hybrid preset
    would send (an uncompressed step) or what the step would send uncompressed
    (a compressed one). `row`: the model's d_model; `act_dtype` its dtype."""
    now = read(report, plan)
    compressed = compresses(plan)
    other_plan = preset_plan("baseline" if compressed else "hybrid", n_layers, mesh_shape)
    other = estimate(report, plan, other_plan, row, act_dtype)
    try_hybrid = "python train.py --config=configs/hybrid.py"
    if other is None:
        foot = ("The uncompressed step is not estimated: a learned (ae) or low-rank "
                "(powersgd) codec sends no fixed share of the raw bytes."
                if compressed else f"For the hybrid preset's bytes: {try_hybrid}")
    elif compressed:
        foot = ("* estimated from the message plan, not compiled: each message's bytes "
                "divided by its codec's byte ratio.")
    else:
        foot = ("* estimated from the message plan, not compiled: each message's bytes times "
                f"the byte ratio of the hybrid preset's codec ({codecs_line(other_plan)}). "
                f"To measure it: {try_hybrid}")
    return start_table(now, other, compressed=compressed,
                       other_name="uncompressed" if compressed else "hybrid preset",
                       footnote=textwrap.wrap(foot, WIDTH, subsequent_indent="  "))
