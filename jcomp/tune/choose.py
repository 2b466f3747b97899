"""Picks a codec per (mesh axis, message kind) from a Profile: the one with the
least predicted time per step, among those the ladder of its kind allows.

    d = choose(profile, {("data", "grad"): (64e6, 1), ("tensor", "act"): (8e6, 96)},
               budget={"grad": "int8"})
    d.codec_dict("grad")        # {"data": "int8"}: cc.psum / cc.value_and_grad's codec=
    print(d.table())

For a message of raw bytes B and c collectives per step over a link, with a
codec sending r x B in c' collectives (c' = 2c for a coded all-reduce) and
costing e and d seconds per byte to encode and decode, of which the coded
collective codes E x B and D x B bytes (Traffic.codec_work: an all-reduce
over 2 devices encodes 1.5 B and decodes 2 B),

    t = (1 - overlap) * (c' * latency_s + r * B / bytes_per_s) + (e E + d D) * B

`overlap` is the share of the link's time hidden behind compute; the codec's
time runs on the device and is not hidden. "none" (r = 1, c' = c, no codec
time) is always a candidate, so a choice (by time) is never predicted slower
than sending raw; a codec that sends no fewer bytes than raw at this row length is
never chosen (the collectives would send raw anyway). Ties go to the milder
codec, the earlier on the ladder.

A ladder orders a kind's codecs from "none" to the most compressed allowed,
bytes never growing along it. `budget` cuts a kind's ladder at a codec on it
({"grad": "int8"}: nothing beyond int8); `ladder` replaces the ladders, for
every kind (a sequence) or per kind (a mapping), which is how a codec the
defaults leave out is allowed. A default ladder's codec that the profile has
no cost for is left out and named in `Decision.unpriced` (and the table); a
given ladder's must all be priced.

With by="bytes" each message instead takes the most compressed codec its
ladder allows that saves bytes (a codec sending no fewer than raw is still
never taken): the other end of what the budget allows, with its predicted
time, for a caller that measures rather than trusts the prediction (the
trainer's trial, jcomp.train.auto.pick).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Mapping

from jcomp.tune.profile import Profile, codec_name
from jcomp.tune.traffic import DEFAULT_ROW, Traffic, as_traffic

DEFAULT_LADDERS = {
    # Data-parallel gradients: int4 without error feedback ended +0.31%
    # [-0.34%, +0.96%] from the baseline's validation loss over three seeds
    # (experiments/RESULTS.md, grad_int4_efoff), int4 with a rotation +0.26%
    # [-1.47%, +1.98%] (grad_int4rot_efoff); Xu et al. (CCGrid 2024) send int4
    # there too. The two send the same bytes, so by bytes plain int4 (the
    # first of equals) is taken and by time the cheaper to code. Nothing
    # coarser has been measured to hold.
    "grad": ("none", "bf16", "int8", "int4", "int4:rot"),
    # ZeRO's parameter gather: int8, as ZeRO++'s quantized weights and every
    # preset of jcomp.gpt.policy that codes it; 4-bit weights are unmeasured here.
    "param": ("none", "bf16", "int8"),
    # Activations and their gradients: int8, as in Xu et al.'s recipe
    # (hybrid_paper: +0.83% [+0.32%, +1.33%] over five seeds, with int4
    # gradients); the 4-bit activation settings measured cost more
    # (hybrid_rot4: +4.7%; experiments/RESULTS.md).
    "act": ("none", "bf16", "int8"),
    "act_grad": ("none", "bf16", "int8"),
}


@dataclasses.dataclass(frozen=True)
class Choice:
    """One (axis, kind): the codec picked, its predicted seconds per step and raw's,
    and every candidate weighed as (codec, seconds), in ladder order."""

    axis: str
    kind: str
    codec: str
    traffic: Traffic
    seconds: float
    raw_seconds: float
    candidates: tuple

    @property
    def coded_bytes(self) -> float:
        return self.traffic.coded_bytes(self.codec)


@dataclasses.dataclass(frozen=True)
class Decision:
    """The choices of `choose`, and what they predict for a step's communication."""

    choices: tuple
    overlap: float
    device: str
    unpriced: tuple = ()  # (kind, codec) of a default ladder the profile has no cost for


    @property
    def seconds(self) -> float:
        """Predicted exposed communication and codec seconds per step."""
        return math.fsum(c.seconds for c in self.choices)

    @property
    def raw_seconds(self) -> float:
        """The same, with every message sent raw."""
        return math.fsum(c.raw_seconds for c in self.choices)

    def codec(self, axis: str, kind: str) -> str:
        for c in self.choices:
            if (c.axis, c.kind) == (axis, kind):
                return c.codec
        raise ValueError(f"no message ({axis!r}, {kind!r}) was planned; planned: "
                         f"{[(c.axis, c.kind) for c in self.choices]}")

    def codec_dict(self, kind: str = "grad", axes=None) -> dict:
        """{mesh axis: codec} for the messages of `kind` (over `axes` only, if given):
        the per-axis `codec=` of cc.psum, cc.psum_scatter, cc.all_gather and
        cc.value_and_grad (axes it leaves out travel raw)."""
        kinds = sorted({c.kind for c in self.choices})
        if kind not in kinds:
            raise ValueError(f"kind {kind!r} has no planned message; kinds: {kinds}")
        if axes is not None:
            axes = (axes,) if isinstance(axes, str) else tuple(axes)
        return {c.axis: c.codec for c in self.choices
                if c.kind == kind and (axes is None or c.axis in axes)}

    def table(self) -> str:
        head = ("axis", "kind", "codec", "raw MB", "sent MB", "colls", "ms", "raw ms")
        rows = [head] + [
            (c.axis, c.kind, c.codec, f"{c.traffic.raw_bytes / 1e6:.3g}",
             f"{c.coded_bytes / 1e6:.3g}", f"{c.traffic.coded_collectives(c.codec):g}",
             f"{c.seconds * 1e3:.4g}", f"{c.raw_seconds * 1e3:.4g}") for c in self.choices]
        widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
        lines = ["  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows]
        lines.append(f"per step: {self.seconds * 1e3:.4g} ms predicted, {self.raw_seconds * 1e3:.4g}"
                     f" ms raw (overlap {self.overlap:g}; {self.device})")
        if self.unpriced:
            lines.append("not weighed, the profile has no cost for them (probe them to weigh "
                         "them): " + ", ".join(f"{c} ({k})" for k, c in self.unpriced))
        return "\n".join(lines)


def predict(profile: Profile, axis: str, traffic: Traffic, codec, overlap: float) -> float:
    """Predicted seconds per step of one message sent with `codec` (module doc)."""
    link = profile.link(axis)
    wire = link.seconds(traffic.coded_bytes(codec), traffic.coded_collectives(codec))
    cost = profile.codec(codec)
    if cost is None:
        return (1.0 - overlap) * wire
    encoded, decoded = traffic.codec_work()
    coding = (cost.encode_s_per_byte * encoded + cost.decode_s_per_byte * decoded) \
        * traffic.raw_bytes
    return (1.0 - overlap) * wire + coding


def _check_ladder(specs, where: str) -> tuple:
    if isinstance(specs, str) or not hasattr(specs, "__iter__"):
        raise TypeError(f"{where} must be a sequence of codec specs; got {specs!r}")
    names = tuple(codec_name(s, f"{where}[{i}]") for i, s in enumerate(specs))
    if not names or names[0] != "none":
        raise ValueError(f"{where} must start at 'none' (sending raw is always a candidate); "
                         f"got {list(names)}")
    seen = set()
    for n in names:
        if n in seen:
            raise ValueError(f"{where} names {n!r} twice")
        seen.add(n)
    # Bytes never grow along a ladder, so that a budget cut keeps the milder codecs.
    probe = Traffic(raw_bytes=1.0, collectives=0.0, row=DEFAULT_ROW)
    sizes = [probe.coded_bytes(n) for n in names]
    for i in range(1, len(names)):
        if sizes[i] > sizes[i - 1]:
            raise ValueError(f"{where} must run from least to most compressed: {names[i]!r} "
                             f"sends more bytes than {names[i - 1]!r} before it")
    return names


def ladders(ladder=None, budget=None) -> dict:
    """{kind: codecs allowed, ladder order}: the defaults, or `ladder`, cut by `budget`."""
    given = {}
    if isinstance(ladder, Mapping):
        given = {k: (v, f"ladder[{k!r}]") for k, v in ladder.items()}
    elif ladder is not None:
        given = {k: (ladder, "ladder") for k in DEFAULT_LADDERS}
    out = {k: (v, f"DEFAULT_LADDERS[{k!r}]") for k, v in DEFAULT_LADDERS.items()}
    out.update(given)
    out = {k: _check_ladder(v, where) for k, (v, where) in out.items()}
    if budget is None:
        return out
    if not isinstance(budget, Mapping):
        raise TypeError(f"budget must map kinds to the most compressed codec allowed, e.g. "
                        f"{{'grad': 'int8'}}; got {budget!r}")
    for kind, spec in budget.items():
        if kind not in out:
            raise ValueError(f"budget: unknown kind {kind!r}; kinds: {', '.join(out)}")
        name = codec_name(spec, f"budget[{kind!r}]")
        if name not in out[kind]:
            raise ValueError(f"budget[{kind!r}]: {name!r} is not on the ladder of {kind!r} "
                             f"{list(out[kind])}; allow it with ladder=")
        out[kind] = out[kind][: out[kind].index(name) + 1]
    return out


BY = ("time", "bytes")


def choose(profile: Profile, messages: Mapping, ladder=None, budget=None,
           overlap: float = 0.0, by: str = "time") -> Decision:
    """The codec per (axis, kind) of `messages` ({(axis, kind): Traffic or (raw
    bytes per step, collectives per step)}) that minimises predicted time, or
    with by="bytes" the bytes sent (module doc). ladder / budget: see the module
    doc. overlap: the share of the link's time hidden behind compute, in [0, 1]."""
    if by not in BY:
        raise ValueError(f"by must be one of {', '.join(map(repr, BY))}; got {by!r}")
    if not isinstance(profile, Profile):
        raise TypeError(f"profile must be a Profile; got {type(profile).__name__}")
    if not isinstance(messages, Mapping):
        raise TypeError(f"messages must map (axis, kind) to Traffic; got {messages!r}")
    if not messages:
        # A plain jit step's gradient reduction is XLA's and carries no message
        # name, so messages_from on its report finds nothing to plan.
        raise ValueError(
            "messages is empty: nothing to choose a codec for. For a jax.jit step pass "
            "tune.messages_from_grads(params, param_specs, mesh=mesh, data_axes=...) (its "
            "gradient reduction over the batch axes); for code sent under "
            "wire.message_scope, tune.messages_from(report, kinds); or by hand "
            "{(axis, kind): (raw bytes per step, collectives per step)}")
    if isinstance(overlap, bool) or not isinstance(overlap, (int, float)) or not (
            math.isfinite(overlap) and 0.0 <= overlap <= 1.0):
        raise ValueError(f"overlap must be a number in [0, 1] (the share of link time hidden "
                         f"behind compute); got {overlap!r}")
    allowed = ladders(ladder, budget)
    # A default ladder's codec that the profile has no cost for (a profile
    # probed before the ladder grew) is left out and named; a ladder the caller
    # gives must be priced in full.
    given = set(ladder) if isinstance(ladder, Mapping) else set(allowed) if ladder else set()
    unpriced = tuple(sorted({(k, c) for k, codecs in allowed.items() if k not in given
                             for c in codecs if c != "none" and c not in profile.codecs}))
    allowed = {k: tuple(c for c in codecs if (k, c) not in unpriced)
               for k, codecs in allowed.items()}
    choices = []
    for key, value in messages.items():
        if not (isinstance(key, tuple) and len(key) == 2 and all(isinstance(k, str) for k in key)):
            raise ValueError(f"messages: keys must be (axis, kind) pairs of strings; got {key!r}")
        axis, kind = key
        traffic = as_traffic(value, f"messages[{key!r}]")
        if kind not in allowed:
            raise ValueError(f"messages[{key!r}]: no ladder for kind {kind!r}; kinds: "
                             f"{', '.join(allowed)} (give one with ladder={{{kind!r}: ...}})")
        raw = traffic.raw_bytes
        weighed = [(c, predict(profile, axis, traffic, c, overlap)) for c in allowed[kind]
                   if c == "none" or traffic.coded_bytes(c) < raw]
        # The first of equals: the mildest.
        best = min(weighed, key=(lambda cs: cs[1]) if by == "time"
                   else (lambda cs: traffic.coded_bytes(cs[0])))
        choices.append(Choice(axis, kind, best[0], traffic, best[1], weighed[0][1],
                              tuple(weighed)))
    kinds = {k for _, k in messages}
    return Decision(tuple(choices), float(overlap), profile.device,
                    tuple(u for u in unpriced if u[0] in kinds))
