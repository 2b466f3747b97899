"""The structured codecs' specs, `powersgd:...` and `ae:...`: only the immutable
spec objects, so that `codecs.parse` reads every codec without importing from
above; the algorithms live above the collectives they use (jcomp.powersgd,
jcomp.autoencoder). Where each `kind` may stand: policy.PLACEMENT. Their
grammar (options, valid forms, the reader) is jcomp.codecs.spec's;
`parse_powersgd` and `parse_ae` hand it the class.
"""
from __future__ import annotations

import dataclasses
import math
import numbers

from jcomp.codecs.spec import _AE_OPTIONS, _POWERSGD_OPTIONS, parse_byte, structured_codec

INITS = ("orthogonal", "normal")
RESTS = ("none", "bf16", "fp16", "fp8", "int8", "int4", "int2", "mxfp8", "mxfp4", "nvfp4")


@dataclasses.dataclass(frozen=True)
class PowerSGD:
    """Rank-`rank` gradient reduction (jcomp.powersgd). `factor_codec` codes the P
    and Q all-reduces, `fallback` the leaves that stay dense."""

    rank: int
    factor_codec: str = "none"
    fallback: str = "none"
    min_compression: float = 2.0
    name = "powersgd"
    kind = "lowrank"

    def __post_init__(self):
        if isinstance(self.rank, bool) or not isinstance(self.rank, numbers.Integral):
            raise TypeError(f"PowerSGD rank must be an int; got {self.rank!r}")
        if self.rank < 1:
            raise ValueError(f"PowerSGD rank must be >= 1; got {self.rank}")
        mc = self.min_compression
        if isinstance(mc, bool) or not isinstance(mc, numbers.Real):
            raise TypeError(f"PowerSGD min_compression must be a number; got {mc!r}")
        if not (math.isfinite(mc) and mc >= 1):
            raise ValueError(f"PowerSGD min_compression must be finite and >= 1; got {mc}")
        for field in ("factor_codec", "fallback"):
            codec = parse_byte(getattr(self, field))  # ValueError/TypeError names the spec
            object.__setattr__(self, field, str(codec))
        object.__setattr__(self, "rank", int(self.rank))
        object.__setattr__(self, "min_compression", float(mc))

    @property
    def needs_key(self) -> bool:
        return any(parse_byte(c).needs_key for c in (self.factor_codec, self.fallback))

    @property
    def row_multiple(self) -> int:
        """The fallback's row length: dense leaves go through it."""
        return parse_byte(self.fallback).row_multiple

    def __str__(self):
        return _text(self, _POWERSGD_OPTIONS)


@dataclasses.dataclass(frozen=True)
class Autoencoder:
    """A learned linear code of width `dim` for tensor-parallel activations
    (jcomp.autoencoder); `rest` codes the tensor messages outside the blocks."""

    dim: int
    init: str = "orthogonal"
    rest: str = "none"
    name = "ae"
    kind = "learned"
    needs_key = False
    row_multiple = 1

    def __post_init__(self):
        if isinstance(self.dim, bool) or not isinstance(self.dim, int) or self.dim < 1:
            raise ValueError(f"ae dim must be an int >= 1; got {self.dim!r}")
        if self.init not in INITS:
            raise ValueError(f"ae init must be one of {', '.join(INITS)}; got {self.init!r}")
        if self.rest not in RESTS:
            raise ValueError(f"ae rest must be one of {', '.join(RESTS)}; got {self.rest!r}")

    def __str__(self):
        return _text(self, _AE_OPTIONS)


def _text(codec, options) -> str:
    """NAME, then key=value for the first option and every other one off its default."""
    defaults = {f.name: f.default for f in dataclasses.fields(codec)}
    parts = [codec.name]
    for i, (key, (field, read)) in enumerate(options.items()):
        value = getattr(codec, field)
        if i == 0 or value != defaults[field]:
            parts.append(f"{key}={value!r}" if read is float else f"{key}={value}")
    return ":".join(parts)


def parse_powersgd(spec) -> PowerSGD:
    """Reads "powersgd:rank=R[:factor=C][:fallback=C][:min_compression=F]"."""
    return structured_codec(spec, PowerSGD)


def parse_ae(spec) -> Autoencoder:
    """Reads "ae:dim=A[:init=...][:rest=...]"."""
    return structured_codec(spec, Autoencoder)
