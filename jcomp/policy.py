"""Which codec each message uses: one table over (mesh axis, kind of message).

    pol = policy.preset("hybrid")
    pol["data", "grad"]      # -> the codec for data-parallel gradient reduction

Kinds of message:
  grad      data-parallel gradient reduction (all-reduce or ZeRO reduce-scatter)
  param     ZeRO parameter all-gather after the sharded update
  act       tensor/pipeline activations, forward
  act_grad  gradients of those activations, backward

Presets:
  baseline  every entry "none": the plain jax.lax program.
  naive     one aggressive codec (int4) on every message of every axis.
  hybrid    as in Xu et al., CCGrid 2024: aggressive on data-parallel gradients
            (int4 with error feedback), mild (int8) on activations, their
            gradients and parameter gathers. Gradients have low-rank structure
            and error feedback repairs their bias; activations feed straight
            into the next layer's math and get no second chance.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from jcomp import codecs

AXES = ("data", "tensor", "pipeline")
KINDS = ("grad", "param", "act", "act_grad")
PRESETS = ("baseline", "naive", "hybrid")


@dataclasses.dataclass(frozen=True)
class Policy:
    """An immutable (axis, kind) -> codec table, plus error feedback on gradients."""

    table: tuple  # ((axis, kind, codec), ...) over every axis and kind
    error_feedback: bool = False

    def __getitem__(self, axis_kind):
        axis, kind = axis_kind
        _check(axis, kind)
        for a, k, c in self.table:
            if (a, k) == (axis, kind):
                return c
        raise KeyError(axis_kind)

    def as_dict(self) -> dict[str, dict[str, str]]:
        out: dict[str, dict[str, str]] = {a: {} for a in AXES}
        for a, k, c in self.table:
            out[a][k] = str(c)
        return out

    def replace(self, overrides: Mapping[str, Any]) -> "Policy":
        """Overrides keyed "axis.kind", e.g. {"data.grad": "topk:0.01"}."""
        entries = {(a, k): c for a, k, c in self.table}
        for key, spec in overrides.items():
            axis, _, kind = str(key).partition(".")
            _check(axis, kind, where=f"policy override {key!r}")
            codec = codecs.parse(spec)
            if getattr(codec, "kind", None) == "lowrank" and (axis, kind) != ("data", "grad"):
                raise ValueError(f"policy override {key!r}: {codec} compresses data-parallel "
                                 "gradients only (data.grad)")
            if getattr(codec, "kind", None) == "learned" and (axis, kind) not in (
                    ("tensor", "act"), ("tensor", "act_grad")):
                raise ValueError(f"policy override {key!r}: the learned autoencoder {codec} "
                                 "codes tensor-parallel activations only (tensor.act, "
                                 "tensor.act_grad)")
            entries[axis, kind] = codec
        return Policy(_freeze(entries), self.error_feedback)

    def __str__(self):
        rows = [f"{a}: " + ", ".join(f"{k}={c}" for aa, k, c in self.table if aa == a)
                for a in AXES]
        return "; ".join(rows) + f"; error_feedback={self.error_feedback}"


def _check(axis, kind, where="policy"):
    if axis not in AXES:
        raise ValueError(f"{where}: unknown mesh axis {axis!r}; allowed: {', '.join(AXES)}")
    if kind not in KINDS:
        raise ValueError(f"{where}: unknown message kind {kind!r}; allowed: {', '.join(KINDS)}")


def _freeze(entries) -> tuple:
    return tuple((a, k, entries[a, k]) for a in AXES for k in KINDS)


def uniform(spec, error_feedback: bool = False) -> Policy:
    c = codecs.parse(spec)
    return Policy(_freeze({(a, k): c for a in AXES for k in KINDS}), error_feedback)


def preset(name: str) -> Policy:
    """One of PRESETS; ValueError otherwise."""
    if name == "baseline":
        return uniform("none")
    if name == "naive":
        return uniform("int4", error_feedback=True)
    if name == "hybrid":
        return uniform("int8", error_feedback=True).replace({"data.grad": "int4"})
    raise ValueError(f"unknown policy preset {name!r}; allowed: {', '.join(PRESETS)}")


def build(name: str = "baseline", overrides: Mapping[str, Any] | None = None,
          error_feedback: bool | None = None) -> Policy:
    """A preset, then "axis.kind" overrides, then an explicit error-feedback switch."""
    pol = preset(name).replace(dict(overrides or {}))
    if error_feedback is not None:
        pol = dataclasses.replace(pol, error_feedback=bool(error_feedback))
    return pol
