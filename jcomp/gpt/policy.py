"""Which codec each message uses: one table over (mesh axis, kind of message).

    pol = policy.preset("hybrid")
    pol["data", "grad"]      # -> the codec for data-parallel gradient reduction
    pol = pol.restrict({"tensor.act": "4-7", "pipeline.act_grad": "1"})
    pol.compresses("tensor", "act", layer=2)   # -> False: layer 2 sends raw

Kinds: grad (data-parallel gradient reduction), param (ZeRO's parameter
gather), act (tensor/pipeline activations, forward) and act_grad (their
gradients, backward); MESSAGES lists the entries that name a message the step
sends. `restrict` compresses tensor messages in some layers only and pipeline
sends from some stages only.

The slow hop. On a mesh whose data axis is split into a slow 'dcn' factor and a
fast 'data' one (mesh.dcn_data > 1, jcomp.gpt.mesh), the data entries code the
fast hop and the entries of HOP_MESSAGES, "dcn.grad" and "dcn.param", the slow
one. They are kept apart from the table (`Policy.dcn`): unset, a dcn entry is
its data entry (`pol["dcn", "grad"] == pol["data", "grad"]`), so a split mesh
under an unchanged policy codes both hops with the data codec, one after the
other. Set them with `replace({"dcn.grad": "int4:rot"})`; "" unsets.

Presets: baseline (all "none"), naive (int4 with error feedback), hybrid_paper
(Xu et al., CCGrid 2024: int4 with error feedback on data gradients, int8
elsewhere) and hybrid, the best setting experiments/RESULTS.md found at no more
than 1/6 of the baseline's bytes. The README ("Policies and presets") states the
rule it was chosen by (loss within 1% of the baseline's over seeds at 1/6 of the
bytes or fewer, then the fewest bytes no slower than the baseline) and that no
setting measured so far meets it.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Mapping

from jcomp import codecs
from jcomp.gpt.messages import format_indices  # noqa: F401  (policy.format_indices)

AXES = ("data", "tensor", "pipeline")
KINDS = ("grad", "param", "act", "act_grad")
PRESETS = ("baseline", "naive", "hybrid", "hybrid_paper")
# The hybrid preset's entries (the rest "none"); see the module docstring.
HYBRID = {"data.grad": "int4:rot", "data.param": "int8", "tensor.act": "int4:rot",
          "tensor.act_grad": "int4:rot", "pipeline.act": "int8", "pipeline.act_grad": "int8"}
# The entries that name a message the 3-D step sends. Data ranks exchange no
# activations, tensor ranks gather no parameters and pipeline stages reduce no
# gradients (each owns its layers): the other five stay "none", and a codec
# there is refused rather than reported as compressing something.
MESSAGES = (("data", "grad"), ("data", "param"), ("tensor", "grad"), ("tensor", "act"),
            ("tensor", "act_grad"), ("pipeline", "act"), ("pipeline", "act_grad"))
# What an entry's places are: global layer indices for tensor-parallel messages
# (each layer has its own all-reduces), stage indices for pipeline messages (a
# stage's sends: forward to the next stage, backward to the previous one).
# The slow hop's entries (see the module docstring); unset, each is its data entry.
HOP_AXIS = "dcn"
HOP_MESSAGES = ((HOP_AXIS, "grad"), (HOP_AXIS, "param"))
NONE = codecs.parse("none")  # what an entry sends where it does not compress
PLACES = {("tensor", "act"): "layers", ("tensor", "act_grad"): "layers",
          ("pipeline", "act"): "stages", ("pipeline", "act_grad"): "stages"}


@dataclasses.dataclass(frozen=True)
class Policy:
    """An immutable (axis, kind) -> codec table, plus error feedback on gradients."""

    table: tuple  # ((axis, kind, codec), ...) over every axis and kind
    error_feedback: bool = False
    only: tuple = ()  # ((axis, kind, (index, ...)), ...): entries compressed there only
    dcn: tuple = ()  # ((kind, codec), ...): the slow hop's entries that are set

    def __getitem__(self, axis_kind):
        axis, kind = axis_kind
        if axis == HOP_AXIS:
            _check_hop(kind)
            return dict(self.dcn).get(kind, self["data", kind])
        _check(axis, kind)
        for a, k, c in self.table:
            if (a, k) == (axis, kind):
                return c
        raise KeyError(axis_kind)  # a table built by hand may lack an entry

    def as_dict(self) -> dict[str, dict[str, str]]:
        """{axis: {kind: codec}}; a "dcn" axis only where a slow-hop entry is set."""
        out = {a: {k: str(c) for aa, k, c in self.table if aa == a} for a in AXES}
        if self.dcn:
            out[HOP_AXIS] = {k: str(c) for k, c in self.dcn}
        return out

    def replace(self, overrides: Mapping[str, Any]) -> "Policy":
        """Overrides keyed "axis.kind", e.g. {"data.grad": "topk:0.01"}; a "dcn.KIND"
        override of "" (or None) unsets that slow-hop entry."""
        entries = {(a, k): c for a, k, c in self.table}
        hop = dict(self.dcn)
        for key, spec in overrides.items():
            axis, _, kind = str(key).partition(".")
            where = f"policy override {key!r}"
            if axis == HOP_AXIS:
                _check_hop(kind, where)
                if spec is None or (isinstance(spec, str) and not spec.strip()):
                    hop.pop(kind, None)
                else:
                    hop[kind] = parse_hop_entry(kind, spec, where)
                continue
            entries[axis, kind] = parse_entry(axis, kind, spec, where=where)
        return dataclasses.replace(self, table=_freeze(entries),
                                   dcn=tuple((k, hop[k]) for a, k in HOP_MESSAGES if k in hop))

    def where(self, axis, kind) -> tuple | None:
        """The layers or stages where (axis, kind) compresses; None: everywhere."""
        if axis == HOP_AXIS:
            _check_hop(kind)
            return None
        _check(axis, kind)
        return next((idx for a, k, idx in self.only if (a, k) == (axis, kind)), None)

    def compresses(self, axis, kind, *, layer=None, stage=None) -> bool:
        """Whether (axis, kind) sends its codec at this layer or stage (its place
        kind, see PLACES); False also when the codec is "none"."""
        if codecs.parse(self[axis, kind]).kind == "identity":
            return False
        idx = self.where(axis, kind)
        if idx is None:
            return True
        place = PLACES[axis, kind]
        at = layer if place == "layers" else stage
        if at is None:
            raise ValueError(f"{axis}.{kind} compresses in some {place} only: pass "
                             f"{place[:-1]}=")
        return int(at) in idx

    def codec_at(self, axis, kind, *, layer=None, stage=None):
        """The codec (axis, kind) sends at this layer or stage: its own where it
        compresses, "none" (NONE) elsewhere."""
        return self[axis, kind] if self.compresses(axis, kind, layer=layer, stage=stage) else NONE

    def restrict(self, places: Mapping[str, Any]) -> "Policy":
        """Compress some entries only at the given layers or stages, keyed "axis.kind":
        {"tensor.act": "0-3,6", "pipeline.act": [0]}. A spec is comma-separated
        indices and inclusive ranges, or a sequence of ints; "" or None lifts the
        restriction. Allowed keys: PLACES."""
        only = {(a, k): idx for a, k, idx in self.only}
        for key, spec in places.items():
            axis, _, kind = str(key).partition(".")
            _check(axis, kind, where=f"places {key!r}")
            if (axis, kind) not in PLACES:
                raise ValueError(
                    f"places {key!r}: only {', '.join(f'{a}.{k}' for a, k in PLACES)} can "
                    "compress in some layers or stages only")
            idx = parse_indices(spec, f"{key} {PLACES[axis, kind]}")
            if idx is None:
                only.pop((axis, kind), None)
            else:
                only[axis, kind] = idx
        return dataclasses.replace(
            self, only=tuple((a, k, only[a, k]) for a, k in PLACES if (a, k) in only))

    def check_places(self, n_layers: int, n_stages: int):
        """ValueError naming the entry when a layer or stage index is out of range."""
        for a, k, idx in self.only:
            n = n_layers if PLACES[a, k] == "layers" else n_stages
            bad = [i for i in idx if i >= n]
            if bad:
                raise ValueError(f"{PLACES[a, k]}.{a}.{k}={format_indices(bad)}: the model "
                                 f"has {n} {PLACES[a, k]} (0..{n - 1})")

    def __str__(self):
        """e.g. "data: grad=int8, ...; tensor: act=int4[layers 4-7], ...; error_feedback=False"."""
        only = {(a, k): f"[{PLACES[a, k]} {format_indices(idx)}]" for a, k, idx in self.only}
        rows = [f"{a}: " + ", ".join(f"{k}={c}{only.get((a, k), '')}" for aa, k, c in self.table
                                     if aa == a) for a in AXES]
        if self.dcn:
            rows.append(f"{HOP_AXIS}: " + ", ".join(f"{k}={c}" for k, c in self.dcn))
        return "; ".join(rows) + f"; error_feedback={self.error_feedback}"


def parse_indices(spec, field: str) -> tuple | None:
    """ "0-3,6" or [0, 1, 2, 3, 6] -> (0, 1, 2, 3, 6); "" or None -> None."""
    if spec is None or (isinstance(spec, str) and not spec.strip()):
        return None
    if isinstance(spec, str):
        out = []
        for item in spec.split(","):
            lo, dash, hi = item.strip().partition("-")
            if not lo.isdigit() or (dash and not hi.isdigit()):
                raise ValueError(f"{field}={spec!r}: items must be N or N-M (inclusive), "
                                 "comma-separated, e.g. '0-3,6'")
            if dash and int(hi) < int(lo):
                raise ValueError(f"{field}={spec!r}: range {item.strip()} runs backwards")
            out.extend(range(int(lo), int(hi if dash else lo) + 1))
    elif isinstance(spec, (list, tuple)):
        if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in spec):
            raise ValueError(f"{field}={spec!r}: indices must be ints >= 0")
        out = list(spec)
        if not out:
            raise ValueError(f"{field}=[]: lists no index (to compress nowhere, set the "
                             "codec to 'none')")
    else:
        raise TypeError(f"{field} must be a string like '0-3,6' or a list of ints; got {spec!r}")
    if len(set(out)) != len(out):
        raise ValueError(f"{field}={spec!r}: an index is listed twice")
    return tuple(sorted(out))


# Where each structured codec may stand (byte codecs fit every message): its
# `kind` -> (the entries it fits, what it does). The one table of placements.
PLACEMENT = {
    "lowrank": ((("data", "grad"),), "compresses data-parallel gradients only"),
    "learned": ((("tensor", "act"), ("tensor", "act_grad")),
                "codes tensor-parallel activations only"),
}


def check_placement(codec, axis: str, kind: str, where: str) -> None:
    """ValueError, starting with `where`, if `codec` may not stand at axis.kind."""
    rule = PLACEMENT.get(getattr(codec, "kind", None))
    if rule and (axis, kind) not in rule[0]:
        fits = ", ".join(f"{a}.{k}" for a, k in rule[0])
        raise ValueError(f"{where}: {codec} {rule[1]} ({fits})")


def parse_entry(axis: str, kind: str, spec, where: str):
    """The codec of `spec` as the entry axis.kind of a policy; ValueError or
    TypeError, starting with `where`, if it cannot stand there."""
    _check(axis, kind, where=where)
    try:
        codec = codecs.parse(spec)
    except (TypeError, ValueError) as e:
        raise type(e)(f"{where}: {e}") from None
    if (axis, kind) not in MESSAGES and getattr(codec, "kind", None) != "identity":
        raise ValueError(
            f"{where}: the step sends no {kind} message over '{axis}', so there is nothing "
            "to compress; entries that name a message: "
            + ", ".join(f"{a}.{k}" for a, k in MESSAGES))
    check_placement(codec, axis, kind, where)
    return codec


def parse_hop_entry(kind: str, spec, where: str):
    """The codec of `spec` as the slow-hop entry dcn.KIND: what parse_entry would
    accept at data.KIND, less PowerSGD (the hops reduce-scatter)."""
    _check_hop(kind, where)
    codec = parse_entry("data", kind, spec, where)
    if getattr(codec, "kind", None) in ("lowrank", "learned"):
        raise ValueError(f"{where}: {codec} cannot code the slow hop; dcn.{kind} takes a "
                         "byte codec (e.g. int4:rot, int8)")
    return codec


def _check_hop(kind, where="policy"):
    if (HOP_AXIS, kind) not in HOP_MESSAGES:
        raise ValueError(f"{where}: the slow hop sends no {kind} message; allowed: "
                         + ", ".join(f"{a}.{k}" for a, k in HOP_MESSAGES))


def _check(axis, kind, where="policy"):
    if axis not in AXES:
        raise ValueError(f"{where}: unknown mesh axis {axis!r}; allowed: {', '.join(AXES)}")
    if kind not in KINDS:
        raise ValueError(f"{where}: unknown message kind {kind!r}; allowed: {', '.join(KINDS)}")


def _freeze(entries) -> tuple:
    return tuple((a, k, entries[a, k]) for a in AXES for k in KINDS)


def uniform(spec, error_feedback: bool = False) -> Policy:
    c = codecs.parse(spec)
    return Policy(_freeze({(a, k): c if (a, k) in MESSAGES else NONE
                           for a in AXES for k in KINDS}), error_feedback)


@functools.lru_cache(maxsize=None)  # a Policy is immutable: each preset is read once
def preset(name: str) -> Policy:
    """One of PRESETS; ValueError otherwise."""
    if name == "baseline":
        return uniform("none")
    if name == "naive":
        return uniform("int4", error_feedback=True)
    if name == "hybrid":
        return uniform("none").replace(HYBRID)
    if name == "hybrid_paper":
        return uniform("int8", error_feedback=True).replace({"data.grad": "int4"})
    raise ValueError(f"unknown policy preset {name!r}; allowed: {', '.join(PRESETS)}")


def build(name: str = "baseline", overrides: Mapping[str, Any] | None = None,
          error_feedback: bool | None = None) -> Policy:
    """A preset, then "axis.kind" overrides, then an explicit error-feedback switch."""
    pol = preset(name).replace(dict(overrides or {}))
    if error_feedback is not None:
        pol = dataclasses.replace(pol, error_feedback=bool(error_feedback))
    return pol
