"""compression.auto's fields read once (`read`) into a frozen `AutoSettings`:
the mode, the profile's path, the budget, overlap, compute_s and trial.
What auto decides with them is `jcomp.train.auto.decide`.

Entries the user sets are refused, not kept: compression.policy other than
"baseline", any compression.AXIS.KIND or compression.dcn.KIND, and a schedule
naming a codec (a bare "@STEP" start is kept, as are warmup_steps, layers,
stages and error_feedback). A half-chosen policy would price the messages
against codecs the user fixed without saying so.
"""
from __future__ import annotations

import dataclasses
import math

from jcomp import tune
from jcomp.gpt import policy as policy_lib
from jcomp.train.run.faults import UsageError

MODES = ("off", "on", "reprobe")
OUTER = "outer"            # the budget's key allowing an outer loop: "outer=H"
# The outer loop's pseudo-gradients: int4 with a rotation, the best of the
# settings measured every 10 steps here (experiments/RESULTS.md, outer suite:
# outer_h10_int4rot +2.16% [-0.01%, +4.34%] over 3 seeds, 78x fewer bytes across).
OUTER_CODEC = "int4:rot"
# The intervals H the outer loop's loss was measured at with OUTER_CODEC
# (configs/base.py, 600 steps, 3 seeds; experiments/RESULTS.md): H=10 +2.16%
# [-0.01%, +4.34%], H=50 +7.47% [+6.42%, +8.51%]. The budget admits H up to
# MEASURED_OUTER_H (syncing more often moves toward every-step training); a
# larger H is an extrapolation from that evidence, allowed only where the
# budget says so: outer=H:extrapolate.
MEASURED_OUTER_H = 10
EXTRAPOLATE = "extrapolate"
# compression.trial's most steps per candidate. configs/auto.py's 6 took a
# candidate within 5% of the fastest on the two-hop rig (docs/trainer.md);
# each timed candidate costs N + 1 steps before training starts, so a far
# longer trial only delays the run (one of 1e9 steps never ends).
MAX_TRIAL = 100


@dataclasses.dataclass(frozen=True)
class AutoSettings:
    """compression.auto's fields, checked. `profile` is None until `decide`
    reads the file, and only where it decides afresh: a resume keeping its
    decision never reads it."""

    mode: str                  # on, reprobe
    profile_path: str          # "": probe the run's mesh at start
    budget: dict | None        # {kind: most compressed codec, "outer": H}; None: the defaults
    overlap: float
    compute_s: float
    trial: int
    profile: tune.Profile | None = None


def read(comp) -> AutoSettings | None:
    """config.compression's auto fields -> AutoSettings; None with auto off."""
    mode = comp.get("auto", "off")
    if mode not in MODES:
        raise UsageError(f"compression.auto={mode!r}; allowed: {', '.join(MODES)}")
    if mode == "off":
        return None
    _refuse_explicit(comp)
    budget = parse_budget(comp.get("budget", ""))
    overlap = check_overlap(comp.get("overlap", 0.0))
    compute_s = check_compute(comp.get("compute_s", 0.0))
    trial = check_trial(comp.get("trial", 0))
    if trial and compute_s:
        raise UsageError(f"compression.compute_s={compute_s!r} with compression.trial={trial}: "
                         "the trial measures the step's compute; set compute_s=0 or trial=0")
    path = comp.get("profile", "")
    if not isinstance(path, str):
        raise UsageError(f"compression.profile={path!r}; allowed: a profile JSON's path, or '' "
                         "(probe the run's mesh at start)")
    return AutoSettings(mode=mode, profile_path=path, budget=budget, overlap=overlap,
                        compute_s=compute_s, trial=trial)


def _refuse_explicit(comp):
    leave = "(leave it '' or set compression.auto='off')"
    why = f"compression.auto chooses it {leave}"
    if comp.policy != "baseline":
        raise UsageError(f"compression.policy={comp.policy!r}: with compression.auto on the "
                         f"starting point is 'baseline' and compression.auto chooses the "
                         f"codecs {leave}")
    for axis, kind in (*policy_lib.MESSAGES, *policy_lib.HOP_MESSAGES):
        spec = comp.get(axis, {}).get(kind, "")
        if spec:
            raise UsageError(f"compression.{axis}.{kind}={spec!r}: {why}")
    for axis, kind in policy_lib.MESSAGES:
        spec = comp.schedule[axis][kind]
        if spec and not spec.strip().startswith("@"):
            raise UsageError(f"compression.schedule.{axis}.{kind}={spec!r} names a codec: {why}; "
                             "a bare '@STEP' start is allowed")


def parse_budget(text) -> dict | None:
    """"grad=int4:rot,act=int8" -> {"grad": "int4:rot", "act": "int8"}, checked against
    the ladders; "" -> None (tune's defaults)."""
    field = f"compression.budget={text!r}"
    if not isinstance(text, str):
        raise UsageError(f"{field} must be a string like 'grad=int4:rot,act=int8'")
    if not text.strip():
        return None
    budget = {}
    for item in text.split(","):
        kind, eq, codec = (s.strip() for s in item.partition("="))
        if not eq or not kind or not codec or kind in budget:
            raise UsageError(f"{field}: want KIND=CODEC,... with each kind once (kinds: "
                             f"{', '.join(tune.DEFAULT_LADDERS)}; and outer=H); got "
                             f"{item.strip()!r}")
        budget[kind] = codec
    every = budget.pop(OUTER, None)
    if every is not None:
        every, _, opt_in = every.partition(":")
        if not (every.isdigit() and int(every) >= 2) or opt_in not in ("", EXTRAPOLATE):
            raise UsageError(f"{field}: outer={every}{':' + opt_in if opt_in else ''!s}; "
                             "allowed: outer=H, an int >= 2 (an outer loop syncing every H "
                             f"steps may be chosen), or outer=H:{EXTRAPOLATE}")
        if int(every) > MEASURED_OUTER_H and not opt_in:
            raise UsageError(
                f"{field}: outer={every} is beyond the interval the outer loop's loss was "
                f"measured at (H={MEASURED_OUTER_H}: +2.16% [-0.01%, +4.34%], 3 seeds; H=50: "
                f"+7.47% [+6.42%, +8.51%]; docs/trainer.md); allowed: H <= "
                f"{MEASURED_OUTER_H}, or outer={every}:{EXTRAPOLATE} to weigh it anyway")
    try:
        tune.ladders(budget=budget)
    except (TypeError, ValueError) as e:
        raise UsageError(f"{field}: {e}") from None
    return {**budget, **({OUTER: int(every)} if every else {})}


def check_overlap(value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            math.isfinite(value) and 0.0 <= value <= 1.0):
        raise UsageError(f"compression.overlap={value!r}; allowed: a number in [0, 1] (the "
                         "share of link time hidden behind compute)")
    return float(value)


def check_compute(value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            math.isfinite(value) and value >= 0.0):
        raise UsageError(f"compression.compute_s={value!r}; allowed: a number >= 0 (seconds of "
                         "a step's computation, e.g. an uncompressed step's on a fast link; 0: "
                         "not known, communication alone is predicted)")
    return float(value)


def check_trial(value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_TRIAL:
        raise UsageError(f"compression.trial={value!r}; allowed: an int in [0, {MAX_TRIAL}] "
                         "(steps timed per candidate before training; 0: the model alone "
                         "decides)")
    return value
