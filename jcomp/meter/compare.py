"""A program's bytes against its plain twin's, per mesh axis.

Compression pays only where the compiled program sends fewer bytes than the
program it replaces, and a change that saves bytes on one axis can cost more
on another (a tensor-parallel weight gathered at a map's boundary, a leaf read
as replicated). `compare` compiles both and puts their bytes side by side:

    from jcomp.meter import compare
    c = compare.compare(plain_step, step, params, opt_state, batch, mesh=mesh)
    print(c.table())
    c.extra()              # {axis: (plain bytes, step bytes)} where step sends more
    c.warn("my step")      # an ExtraBytesWarning naming each such axis

Bytes are per device per call, averaged over the mesh (`wire.measure`), per
mesh axis: a collective over several axes counts for each of them
(`WireReport.by_mesh_axis`), so a flat all-reduce over ("dcn", "ici") and its
hierarchical form (a reduce-scatter and gather over "ici" around an all-reduce
over "dcn") are weighed link by link.
"""
from __future__ import annotations

import collections
import dataclasses
import warnings

from jcomp.meter import wire


class ExtraBytesWarning(UserWarning):
    """A program sends more bytes on some mesh axis than its plain twin does."""


@dataclasses.dataclass(frozen=True)
class Comparison:
    """Two wire reports of programs that compute the same thing: `plain` (the
    program as its authors wrote it) and `step` (the one that should send no
    more on any axis). `rel` and `atol` say how much more counts as more."""

    plain: wire.WireReport
    step: wire.WireReport
    rel: float = 0.01
    atol: float = 64.0

    def by_axis(self) -> dict[str, tuple[float, float]]:
        """{axis: (plain bytes, step bytes)} over every axis either sends on."""
        p, s = self.plain.by_mesh_axis(), self.step.by_mesh_axis()
        return {a: (p.get(a, 0.0), s.get(a, 0.0)) for a in sorted(set(p) | set(s))}

    def extra(self) -> dict[str, tuple[float, float]]:
        """The axes on which `step` sends more than `plain` * (1 + rel) + atol."""
        return {a: (p, s) for a, (p, s) in self.by_axis().items()
                if s > p * (1 + self.rel) + self.atol}

    def added(self, axis: str) -> list[wire.Collective]:
        """The step's collectives crossing `axis` that the plain program lacks
        (matched by kind, dtype, shape and axes, with multiplicity)."""
        key = lambda c: (c.kind, c.dtype, c.shape, c.axes)
        have = collections.Counter(key(c) for c in self.plain.collectives if axis in c.axes)
        out = []
        for c in self.step.collectives:
            if axis not in c.axes:
                continue
            if have[key(c)]:
                have[key(c)] -= 1
            else:
                out.append(c)
        return out

    def table(self) -> str:
        rows = [("axis", "plain", "step", "step/plain")]
        for a, (p, s) in self.by_axis().items():
            rows.append((a, _fmt(p), _fmt(s), f"{s / p:.3f}" if p else "-"))
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        lines = ["  ".join(v.rjust(w) if i else v.ljust(w) for i, (v, w) in
                           enumerate(zip(r, widths))) for r in rows]
        for a in self.extra():
            lines.append(f"! {a}: sends more than the plain program")
        return "\n".join(lines)

    def message(self, what: str, culprits: dict[str, str] | None = None) -> str | None:
        """One line per axis on which `what` sends more, or None; `culprits` adds
        what is known of the cause per axis (the leaves, say)."""
        extra = self.extra()
        if not extra:
            return None
        parts = []
        for a, (p, s) in extra.items():
            added = self.added(a)
            shapes = ", ".join(sorted({f"{c.kind} {c.dtype}{list(c.shape)}" for c in added})[:4])
            why = (culprits or {}).get(a)
            line = f"axis {a!r}: {_fmt(s)} B against {_fmt(p)} B"
            line += f" ({s / p:.2f}x)" if p else ""
            line += f"; {why}" if why else ""
            line += f"; collectives the plain program lacks: {shapes}" if shapes else ""
            parts.append(line)
        return f"{what} sends more bytes than the plain program on " + "; ".join(parts)

    def warn(self, what: str, culprits: dict[str, str] | None = None, stacklevel: int = 2):
        """An ExtraBytesWarning naming each axis on which `what` sends more."""
        msg = self.message(what, culprits)
        if msg:
            warnings.warn(ExtraBytesWarning(msg), stacklevel=stacklevel + 1)


def compare(plain, step, *args, mesh, rel: float = 0.01, atol: float = 64.0,
            **kwargs) -> Comparison:
    """Compile `plain(*args, **kwargs)` and `step(*args, **kwargs)` (jitting each
    unless it has `.lower`; args may be arrays or `jax.ShapeDtypeStruct`s with
    shardings) and put their bytes per mesh axis side by side."""
    return Comparison(wire.measure(plain, *args, mesh=mesh, **kwargs),
                      wire.measure(step, *args, mesh=mesh, **kwargs), rel, atol)


def _fmt(b: float) -> str:
    return f"{b:,.0f}"
