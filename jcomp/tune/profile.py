"""What a machine's links and codecs cost: the figures `choose` plans with.

    prof = Profile(links={"data": Link(latency_s=2e-5, bytes_per_s=4.5e11)},
                   codecs={"int8": CodecCost(encode_s_per_byte=5e-13,
                                             decode_s_per_byte=5e-13)},
                   device="8x H100 SXM")
    save(prof, "configs/profiles/mine.json"); prof = load("configs/profiles/mine.json")

A `Link` is one mesh axis (or a named hop such as "dcn"): one collective over
it of `w` bytes per device takes `latency_s + w / bytes_per_s`, where `w` is
what jcomp.meter.wire counts per device (an all-reduce's 2(n-1)/n x buffer, an
all-gather's (n-1)/n x output, ...), so `bytes_per_s` is the bus bandwidth of
NCCL's tests. A `CodecCost` is the device time a codec spends per byte of
uncompressed input: encoding it, and decoding it back. Codec names are the
canonical specs of jcomp.codecs ("int4:rot", "bf16"); "none" costs nothing and
is never listed. Every figure must be finite and within physical bounds
(`LATENCY_S`, `BYTES_PER_S`, `CODEC_S_PER_BYTE`); a ValueError names the field
and what it may hold. `comment` fields say what a figure rests on and travel with
it through JSON.
"""
from __future__ import annotations

import dataclasses
import json
import math
from typing import Any, Mapping

from jcomp.collectives import arguments

# What a figure may hold. A finite figure far outside these (a bandwidth of
# 5e-324 B/s, a latency of 1e308 s) prices a step at inf or nan, which the
# decision, the table and the metrics would carry on; the bounds are wide
# enough for any real machine.
# A collective's fixed cost: 0 to a minute (no run trains over a link slower
# to answer).
LATENCY_S = (0.0, 60.0)
# Bus bytes per second per device: 1 kB/s (below any modem) to 1 PB/s (over
# 500x NVLink 5's 1.8 TB/s).
BYTES_PER_S = (1e3, 1e15)
# Device seconds per byte coded: 0 (free) to 1 ms per byte (1 kB/s of coding).
CODEC_S_PER_BYTE = (0.0, 1e-3)


def _number(value, where: str, bounds: tuple[float, float], unit: str) -> float:
    lo, hi = bounds
    allowed = f"a number in [{lo:g}, {hi:g}] ({unit})"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{where} must be {allowed}; got {value!r}")
    if not (math.isfinite(value) and lo <= value <= hi):
        raise ValueError(f"{where} must be {allowed}; got {value!r}")
    return float(value)


def _text(value, where: str) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{where} must be a string; got {value!r}")
    return value


def codec_name(spec, where: str = "codec") -> str:
    """The canonical spec of a codec a collective can send with ("INT4:Rot" ->
    "int4:rot"); ValueError naming `where` for anything else (PowerSGD and the
    autoencoder do not travel through a collective's codec)."""
    try:
        return str(arguments.parse(spec))
    except (ValueError, TypeError) as e:
        raise ValueError(f"{where}: {e}") from None


@dataclasses.dataclass(frozen=True)
class Link:
    """One mesh axis: seconds per collective, and bus bytes per second per device."""

    latency_s: float
    bytes_per_s: float
    comment: str = ""

    def __post_init__(self):
        _number(self.latency_s, "Link.latency_s", LATENCY_S, "seconds per collective")
        _number(self.bytes_per_s, "Link.bytes_per_s", BYTES_PER_S,
                "bus bytes per second per device")
        _text(self.comment, "Link.comment")

    def seconds(self, wire_bytes: float, collectives: float) -> float:
        """Time of `collectives` collectives moving `wire_bytes` per device in all."""
        return collectives * self.latency_s + wire_bytes / self.bytes_per_s


@dataclasses.dataclass(frozen=True)
class CodecCost:
    """Device seconds per byte of uncompressed input, to encode and to decode."""

    encode_s_per_byte: float
    decode_s_per_byte: float
    comment: str = ""

    def __post_init__(self):
        _number(self.encode_s_per_byte, "CodecCost.encode_s_per_byte", CODEC_S_PER_BYTE,
                "device seconds per uncompressed byte")
        _number(self.decode_s_per_byte, "CodecCost.decode_s_per_byte", CODEC_S_PER_BYTE,
                "device seconds per uncompressed byte")
        _text(self.comment, "CodecCost.comment")

    @property
    def s_per_byte(self) -> float:
        """A byte that travels is encoded by its sender and decoded by its receiver."""
        return self.encode_s_per_byte + self.decode_s_per_byte


@dataclasses.dataclass(frozen=True)
class Profile:
    """Links by mesh axis (or hop) name, codec costs by canonical codec spec."""

    links: Mapping[str, Link]
    codecs: Mapping[str, CodecCost]
    device: str
    comment: str = ""

    def __post_init__(self):
        _text(self.device, "Profile.device")
        _text(self.comment, "Profile.comment")
        if not isinstance(self.links, Mapping):
            raise TypeError(f"Profile.links must map axis names to Link; got {self.links!r}")
        if not isinstance(self.codecs, Mapping):
            raise TypeError(f"Profile.codecs must map codec specs to CodecCost; got {self.codecs!r}")
        links = {}
        for axis, link in self.links.items():
            if not isinstance(axis, str) or not axis:
                raise ValueError(f"Profile.links: axis names must be non-empty strings; got {axis!r}")
            if not isinstance(link, Link):
                raise TypeError(f"Profile.links[{axis!r}] must be a Link; got {link!r}")
            links[axis] = link
        costs = {}
        for spec, cost in self.codecs.items():
            name = codec_name(spec, f"Profile.codecs[{spec!r}]")
            if name == "none":
                raise ValueError("Profile.codecs['none']: sending raw costs no codec time; "
                                 "leave it out")
            if name in costs:
                raise ValueError(f"Profile.codecs: {spec!r} names {name!r} a second time")
            if not isinstance(cost, CodecCost):
                raise TypeError(f"Profile.codecs[{spec!r}] must be a CodecCost; got {cost!r}")
            costs[name] = cost
        # Plain dicts keyed by canonical names, so that lookups and equality
        # do not depend on how a caller spelled a codec.
        object.__setattr__(self, "links", links)
        object.__setattr__(self, "codecs", costs)

    def link(self, axis: str) -> Link:
        if axis not in self.links:
            raise ValueError(f"the profile has no link for mesh axis {axis!r}; it has "
                             f"{sorted(self.links)} (probe it, or add it)")
        return self.links[axis]

    def codec(self, spec) -> CodecCost | None:
        """The cost of a codec; None for "none", ValueError if not profiled."""
        name = codec_name(spec)
        if name == "none":
            return None
        if name not in self.codecs:
            raise ValueError(f"the profile has no cost for codec {name!r}; it has "
                             f"{sorted(self.codecs)} (probe it, or leave it out of the ladder)")
        return self.codecs[name]

    def to_dict(self) -> dict:
        out = {"device": self.device,
               "links": {a: _fields(l) for a, l in self.links.items()},
               "codecs": {c: _fields(k) for c, k in self.codecs.items()}}
        if self.comment:
            out["comment"] = self.comment
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Profile":
        if not isinstance(data, Mapping):
            raise TypeError(f"a profile must be a mapping; got {type(data).__name__}")
        _known(data, ("device", "links", "codecs", "comment"), ("device", "links", "codecs"),
               "profile")
        for key in ("links", "codecs"):
            if not isinstance(data[key], Mapping):
                raise TypeError(f"profile.{key} must be a mapping; got {data[key]!r}")
        links = {a: _build(Link, v, f"links[{a!r}]") for a, v in data["links"].items()}
        costs = {c: _build(CodecCost, v, f"codecs[{c!r}]") for c, v in data["codecs"].items()}
        return cls(links=links, codecs=costs, device=data["device"],
                   comment=data.get("comment", ""))


def _fields(obj) -> dict:
    out = dataclasses.asdict(obj)
    if not out.get("comment"):
        out.pop("comment", None)
    return out


def _known(data: Mapping, allowed, required, where: str):
    unknown = sorted(set(data) - set(allowed))
    if unknown:
        raise ValueError(f"{where}: unknown fields {unknown}; allowed: {', '.join(allowed)}")
    missing = [k for k in required if k not in data]
    if missing:
        raise ValueError(f"{where}: missing fields {missing}")


def _build(cls, data, where: str):
    if not isinstance(data, Mapping):
        raise TypeError(f"profile.{where} must be a mapping; got {data!r}")
    names = [f.name for f in dataclasses.fields(cls)]
    _known(data, names, [n for n in names if n != "comment"], f"profile.{where}")
    try:
        return cls(**data)
    except (ValueError, TypeError) as e:
        raise type(e)(f"profile.{where}: {e}") from None


def save(profile: Profile, path) -> None:
    """Writes `profile` as JSON (NaN and Inf cannot occur: the profile refuses them)."""
    if not isinstance(profile, Profile):
        raise TypeError(f"profile must be a Profile; got {type(profile).__name__}")
    with open(path, "w") as f:
        json.dump(profile.to_dict(), f, indent=2, allow_nan=False)
        f.write("\n")


def load(path) -> Profile:
    """A Profile from JSON written by `save` (or by hand, in the same form)."""
    with open(path) as f:
        # JSON's NaN/Infinity literals are refused, not read as floats.
        data = json.load(f, parse_constant=_refuse_constant)
    return Profile.from_dict(data)


def _refuse_constant(name):
    raise ValueError(f"profile JSON holds {name}; every figure must be a finite number")
