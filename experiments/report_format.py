"""The formatting RESULTS.md's sections share: a number's cell, a markdown table,
the strings strict JSON holds for non-finite numbers, the mesh axes' column
order."""
from __future__ import annotations

import math

AXES = ("data", "tensor", "pipeline")


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


def _num(x):
    """JSON numbers stay; the strings "NaN"/"Infinity" (strict JSON) become floats."""
    return {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}.get(x, x) \
        if isinstance(x, str) else x
