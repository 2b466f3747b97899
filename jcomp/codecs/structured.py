"""The structured codecs' specs: what `powersgd:...` and `ae:...` mean.

Their algorithms live above the collectives they use (jcomp.powersgd: the
low-rank reduction; jcomp.autoencoder: the learned code inside the model's
blocks). Only the immutable spec objects live here, beside the byte codecs,
so that `codecs.parse` reads every codec without importing anything above
this package. `kind` says where a structured codec may stand
(policy.PLACEMENT): "lowrank" at data.grad, "learned" at tensor.act/act_grad.
"""
from __future__ import annotations

import dataclasses
import math
import numbers

from jcomp.codecs.reader import parse_byte, split
from jcomp.codecs.spec import key_value_options


POWERSGD_FORM = ("powersgd:rank=R[:factor=CODEC][:fallback=CODEC][:min_compression=F] "
                 "(R an int >= 1, F a number >= 1, CODEC a codec spec without ':' such as "
                 "none, bf16, int8)")


@dataclasses.dataclass(frozen=True)
class PowerSGD:
    """Rank-`rank` gradient reduction. `factor_codec` codes the P and Q
    all-reduces, `fallback` the leaves that stay dense (see the module docstring)."""

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
        parts = [f"{self.name}:rank={self.rank}"]
        if self.factor_codec != "none":
            parts.append(f"factor={self.factor_codec}")
        if self.fallback != "none":
            parts.append(f"fallback={self.fallback}")
        if self.min_compression != 2.0:
            parts.append(f"min_compression={self.min_compression!r}")
        return ":".join(parts)


def _bad_powersgd(spec, why: str) -> ValueError:
    return ValueError(f"invalid PowerSGD spec {spec!r}: {why}. Valid form: {POWERSGD_FORM}")


def _fields(spec, name: str, keys, bad, what: str) -> dict:
    """The key=value options of a "NAME:key=value:..." spec string; `bad(spec,
    why)` makes the ValueError, `what` names the codec in the TypeError."""
    if not isinstance(spec, str):
        raise TypeError(f"{what} spec must be a string; got {type(spec).__name__}")
    head, opts = split(spec)
    if head != name:
        raise bad(spec, f"it must start with {name!r}, not {head!r}")
    return key_value_options(opts, keys, lambda why: bad(spec, why))


def parse_powersgd(spec) -> PowerSGD:
    """Reads "powersgd:rank=R[:factor=C][:fallback=C][:min_compression=F]"
    (case-insensitive). A PowerSGD object passes through unchanged."""
    if isinstance(spec, PowerSGD):
        return spec
    fields = _fields(spec, "powersgd", ("rank", "factor", "fallback", "min_compression"),
                     _bad_powersgd, "PowerSGD")
    if "factor" in fields:
        fields["factor_codec"] = fields.pop("factor")
    if "rank" not in fields:
        raise _bad_powersgd(spec, "rank is missing")
    try:
        fields["rank"] = int(fields["rank"])
    except ValueError:
        raise _bad_powersgd(spec, f"rank must be an int >= 1, got {fields['rank']!r}") from None
    if "min_compression" in fields:
        try:
            fields["min_compression"] = float(fields["min_compression"])
        except ValueError:
            raise _bad_powersgd(spec, "min_compression must be a number >= 1") from None
    try:
        return PowerSGD(**fields)
    except (TypeError, ValueError) as e:
        raise _bad_powersgd(spec, str(e)) from None


AE_FORM = ("ae:dim=A[:init=orthogonal|normal][:rest=CODEC] (A an int >= 1; CODEC one of "
           "none, bf16, fp16, fp8, int8, int4, int2)")
INITS = ("orthogonal", "normal")
RESTS = ("none", "bf16", "fp16", "fp8", "int8", "int4", "int2")


@dataclasses.dataclass(frozen=True)
class Autoencoder:
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
        out = f"ae:dim={self.dim}"
        if self.init != "orthogonal":
            out += f":init={self.init}"
        if self.rest != "none":
            out += f":rest={self.rest}"
        return out


def _bad_ae(spec, why) -> ValueError:
    return ValueError(f"invalid autoencoder spec {spec!r}: {why}; expected {AE_FORM}")


def parse_ae(spec) -> Autoencoder:
    """Reads "ae:dim=A[:init=...][:rest=...]" (case-insensitive)."""
    if isinstance(spec, Autoencoder):
        return spec
    fields = _fields(spec, "ae", ("dim", "init", "rest"), _bad_ae, "autoencoder")
    if "dim" not in fields:
        raise _bad_ae(spec, "dim is missing")
    try:
        fields["dim"] = int(fields["dim"])
    except ValueError:
        raise _bad_ae(spec, f"dim must be an int >= 1, got {fields['dim']!r}") from None
    try:
        return Autoencoder(**fields)
    except ValueError as e:
        raise _bad_ae(spec, str(e)) from None
