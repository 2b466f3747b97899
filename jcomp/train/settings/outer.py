"""config.outer read and checked: the outer loop's settings (`settings`). When
each fragment's sync starts and is merged is `jcomp.train.outer.fragments`'s
`due` and `applied`; the trainer's outer loop is `jcomp.train.outer`."""
from __future__ import annotations

import dataclasses
import math

import optax

from jcomp import codecs
from jcomp.collectives.outer.sparseloco import SparseLoCo
from jcomp.train.run.faults import UsageError

FIELDS = ("every", "codec", "error_feedback", "lr", "momentum", "fragments", "delay", "mix")
# configs/base.py's outer.*: with every=0 (off) every other field must keep its default.
DEFAULTS = {"every": 0, "codec": "none", "error_feedback": "off", "lr": 1.0, "momentum": 0.0,
            "fragments": 1, "delay": 0, "mix": 0.5}


@dataclasses.dataclass(frozen=True)
class OuterSettings:
    """config.outer, checked (`settings`)."""

    every: int           # H: inner steps between two syncs of a fragment
    codec: str           # the pseudo-gradient's codec across islands
    error_feedback: bool
    lr: float
    momentum: float      # Nesterov momentum; 0: none
    fragments: int = 1
    delay: int = 0       # tau: inner steps between a sync's start and its merge; 0: blocking
    mix: float = 0.5     # with delay: the islands' own share of a merged fragment

    def tx(self):
        """DiLoCo's outer optimizer: SGD, Nesterov momentum where momentum > 0."""
        m = self.momentum
        return optax.sgd(self.lr, momentum=m or None, nesterov=m > 0)

    def codec_object(self):
        """What `cc.outer_sync` takes as codec: the spec, or a SparseLoCo."""
        return _sparseloco(self.codec) if _is_sparseloco(self.codec) else self.codec

    def record(self) -> dict:
        """What a checkpoint records of them (a resume must not change any)."""
        out = {"every": self.every, "codec": self.codec,
               "error_feedback": "on" if self.error_feedback else "off",
               "lr": self.lr, "momentum": self.momentum, "fragments": self.fragments}
        # Recorded only where set, so that checkpoints without them (delay 0) stay
        # as they were and resume both ways.
        return {**out, "delay": self.delay, "mix": self.mix} if self.delay else out


def settings(o) -> OuterSettings | None:
    """config.outer -> OuterSettings, or None where outer.every = 0 (off).
    UsageError naming the field and what is allowed; with every = 0 any other
    field away from its default (DEFAULTS) is refused as unused."""
    if o is None:
        return None
    every = o.get("every", 0)
    if isinstance(every, bool) or not isinstance(every, int) or every < 0:
        raise UsageError(f"outer.every={every!r}; allowed: an integer >= 0 (0: no outer loop)")
    if every == 0:
        _check_unused(o)
        return None
    fragments = o.get("fragments", 1)
    if isinstance(fragments, bool) or not isinstance(fragments, int) or fragments < 1:
        raise UsageError(f"outer.fragments={fragments!r}; allowed: an integer >= 1")
    if every % fragments:
        raise UsageError(f"outer.fragments={fragments} does not divide outer.every={every}; "
                         "allowed: a divisor of outer.every (fragment f syncs at steps "
                         "n % every == f * every / fragments)")
    for name, low, high, text in (("lr", 0, None, "> 0"), ("momentum", 0, 1, "in [0, 1)")):
        v = o.get(name)
        ok = (not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v)
              and (v > low if high is None else low <= v < high))
        if not ok:
            raise UsageError(f"outer.{name}={v!r}; allowed: a number {text}")
    timing = _timing(o, every, fragments)
    spec = o.get("codec", "none")
    if _is_sparseloco(spec):
        return dataclasses.replace(_sparseloco_settings(o, every, fragments, spec), **timing)
    try:
        codec = codecs.parse(spec)
    except (TypeError, ValueError) as e:
        raise UsageError(f"outer.codec={spec!r}: {e}") from None
    if codec.kind in ("lowrank", "learned"):
        raise UsageError(f"outer.codec={spec!r}: the pseudo-gradient takes an elementwise or "
                         "sparse codec (none, bf16, int8, int4:rot, topk:F, ...), not "
                         f"{codec.kind} (powersgd, ae)")
    ef = o.get("error_feedback", "off")
    if ef not in ("on", "off"):
        raise UsageError(f"outer.error_feedback={ef!r}; allowed: on, off")
    if ef == "on" and codec.kind == "identity":
        raise UsageError(f"outer.error_feedback='on' has nothing to feed back: outer.codec="
                         f"{spec!r} is lossless; set a lossy codec (e.g. topk:0.03) or 'off'")
    return OuterSettings(every=every, codec=str(spec), error_feedback=ef == "on",
                         lr=float(o.lr), momentum=float(o.momentum), fragments=fragments,
                         **timing)


def _timing(o, every, fragments) -> dict:
    """outer.delay and outer.mix checked: a fragment's result must be merged before
    that fragment's next sync starts (every steps later), else two results of one
    fragment would be in flight and the merge order undefined."""
    delay = o.get("delay", 0)
    if isinstance(delay, bool) or not isinstance(delay, int) or delay < 0:
        raise UsageError(f"outer.delay={delay!r}; allowed: an integer >= 0 (0: the sync "
                         "blocks and is merged at once)")
    if delay >= every:
        raise UsageError(f"outer.delay={delay} is not below outer.every={every}: a fragment's "
                         "next sync would start before its last result is merged; allowed: "
                         f"0 to {every - 1}")
    mix = o.get("mix", 0.5)
    if isinstance(mix, bool) or not isinstance(mix, (int, float)) or not 0 <= mix <= 1:
        raise UsageError(f"outer.mix={mix!r}; allowed: a number in [0, 1] (the islands' own "
                         "share of a fragment merged outer.delay steps after its sync started)")
    if delay == 0 and mix != DEFAULTS["mix"]:
        raise UsageError(f"outer.mix={mix!r} applies to a delayed sync only, and outer.delay=0 "
                         "merges none; set outer.delay > 0, or leave outer.mix at its default "
                         f"{DEFAULTS['mix']!r}")
    return {"delay": delay, "mix": float(mix)}


def _is_sparseloco(spec) -> bool:
    return isinstance(spec, str) and spec.split(":")[0] == "sparseloco"


def _sparseloco(spec: str) -> SparseLoCo:
    """"sparseloco[:k=K][:chunk=C][:beta=B][:coder=packed|index]" -> SparseLoCo
    (ValueError naming the option)."""
    fields = {}
    for opt in spec.split(":")[1:]:
        key, eq, value = opt.partition("=")
        if key not in ("k", "chunk", "beta", "coder") or not eq or key in fields:
            raise ValueError(f"option {opt!r} unknown or repeated; allowed: "
                             "sparseloco[:k=K][:chunk=C][:beta=B][:coder=packed|index]")
        if key == "coder":
            fields[key] = value
            continue
        try:
            fields[key] = float(value) if key == "beta" else int(value)
        except ValueError:
            raise ValueError(f"option {opt!r} is not a number") from None
    return SparseLoCo(**fields)


def _sparseloco_settings(o, every, n_fragments, spec) -> OuterSettings:
    """SparseLoCo: error feedback always (its decaying residual), no momentum."""
    try:
        _sparseloco(spec)
    except ValueError as e:
        raise UsageError(f"outer.codec={spec!r}: {e}") from None
    m = o.get("momentum", 0.0)
    if m != 0:
        raise UsageError(f"outer.momentum={m!r} with outer.codec={spec!r}: SparseLoCo takes no "
                         "outer momentum (its decaying residual stands in for it); allowed: 0")
    lr = o.get("lr", 1.0)
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not (math.isfinite(lr)
                                                                       and lr > 0):
        raise UsageError(f"outer.lr={lr!r}; allowed: a number > 0")
    ef = o.get("error_feedback", "off")
    if ef not in ("on", "off"):
        raise UsageError(f"outer.error_feedback={ef!r}; allowed: on, off (SparseLoCo keeps "
                         "its residual either way)")
    return OuterSettings(every=every, codec=str(spec), error_feedback=True, lr=float(lr),
                         momentum=0.0, fragments=n_fragments)


def _check_unused(o):
    """With outer.every=0 no outer loop runs: a field set away from its default
    would be ignored, so it is refused (as compression.dcn.* without a split)."""
    for name in FIELDS[1:]:
        v, default = o.get(name, DEFAULTS[name]), DEFAULTS[name]
        if isinstance(v, bool) or v != default:
            raise UsageError(f"outer.{name}={v!r} applies to an outer loop only, and "
                             "outer.every=0 runs none; set outer.every > 0, or leave "
                             f"outer.{name} at its default {default!r}")

