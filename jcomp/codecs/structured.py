"""The structured codecs' specs, `powersgd:...` and `ae:...`: only the immutable
spec objects, so that `codecs.parse` reads every codec without importing from
above; the algorithms live above the collectives they use (jcomp.powersgd,
jcomp.autoencoder). Where each `kind` may stand: policy.PLACEMENT.
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
AE_FORM = ("ae:dim=A[:init=orthogonal|normal][:rest=CODEC] (A an int >= 1; CODEC one of "
           "none, bf16, fp16, fp8, int8, int4, int2, mxfp8, mxfp4, nvfp4)")
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


# Each spec option -> (the field it sets, how its text is read).
_POWERSGD_OPTIONS = {"rank": ("rank", int), "factor": ("factor_codec", str),
                     "fallback": ("fallback", str), "min_compression": ("min_compression", float)}
_AE_OPTIONS = {"dim": ("dim", int), "init": ("init", str), "rest": ("rest", str)}


def _text(codec, options) -> str:
    """NAME, then key=value for the first option and every other one off its default."""
    defaults = {f.name: f.default for f in dataclasses.fields(codec)}
    parts = [codec.name]
    for i, (key, (field, read)) in enumerate(options.items()):
        value = getattr(codec, field)
        if i == 0 or value != defaults[field]:
            parts.append(f"{key}={value!r}" if read is float else f"{key}={value}")
    return ":".join(parts)


def _read(spec, cls, options, form: str, what: str):
    """`cls` from its spec "NAME:key=value:..." (case-insensitive; an object of
    `cls` passes through). The first option is required. ValueError names the
    spec and `form`; TypeError for a spec that is not a string."""
    if isinstance(spec, cls):
        return spec
    if not isinstance(spec, str):
        raise TypeError(f"{what} spec must be a string; got {type(spec).__name__}")

    def bad(why):
        return ValueError(f"invalid {what} spec {spec!r}: {why}. Valid form: {form}")

    head, opts = split(spec)
    if head != cls.name:
        raise bad(f"it must start with {cls.name!r}, not {head!r}")
    texts = key_value_options(opts, options, bad)
    first = next(iter(options))
    if first not in texts:
        raise bad(f"{first} is missing")
    fields = {}
    for key, text in texts.items():
        field, read = options[key]
        try:
            fields[field] = read(text)
        except ValueError:
            raise bad(f"{key} must be {'an int' if read is int else 'a number'}, "
                      f"got {text!r}") from None
    try:
        return cls(**fields)
    except (TypeError, ValueError) as e:
        raise bad(str(e)) from None


def parse_powersgd(spec) -> PowerSGD:
    """Reads "powersgd:rank=R[:factor=C][:fallback=C][:min_compression=F]"."""
    return _read(spec, PowerSGD, _POWERSGD_OPTIONS, POWERSGD_FORM, "PowerSGD")


def parse_ae(spec) -> Autoencoder:
    """Reads "ae:dim=A[:init=...][:rest=...]"."""
    return _read(spec, Autoencoder, _AE_OPTIONS, AE_FORM, "autoencoder")
