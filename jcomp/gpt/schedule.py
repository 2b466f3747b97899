"""When each (axis, kind) entry of a policy starts compressing, and with which
codec, as training goes on.

    sched = schedule.parse({"data.grad": "bf16@0,int8@200,int4@1000", "tensor.act": "@500"})
    schedule.policy_at(base, sched, 300)   # data.grad=int8, tensor.act="none", rest as base
    schedule.phases(base, sched)           # [(0, policy), (200, ...), (500, ...), (1000, ...)]

Items are `CODEC@STEP` or `@STEP` (the base's codec), steps strictly increasing;
before its first item an entry sends "none"; `warmup_steps=W` is `@W` on every
entry without a spec. The train state is laid out for `final_policy`, so a codec
with state of its own shape (PowerSGD, an autoencoder) must be its entry's only
item.

The slow hop's entries (dcn.grad, dcn.param; jcomp.gpt.policy) take no
schedule of their own: each follows its data entry's. Unset, it is the data
entry, codec for codec; set, it sends "none" while its data entry's schedule
has not started (its first item, or warmup_steps) and its own codec from then
on.
"""
from __future__ import annotations

import bisect
import dataclasses
import numbers
from typing import Mapping

from jcomp import codecs
from jcomp.gpt import policy as policy_lib

STATEFUL_KINDS = ("lowrank", "learned")  # codec kinds that own train state


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Scheduled entries only: ((axis, kind, ((step, codec or None), ...)), ...),
    in policy table order; None stands for the base policy's codec."""

    entries: tuple = ()

    def __str__(self):
        items = lambda its: ",".join(f"{'' if c is None else c}@{s}" for s, c in its)
        return "; ".join(f"{a}.{k}={items(its)}" for a, k, its in self.entries) or "(none)"


def _step(value, field: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{field} must be an int; got {value!r}")
    if value < 0:
        raise ValueError(f"{field} must be >= 0; got {value}")
    return int(value)


def _parse_entry(spec: str, field: str) -> tuple:
    """"int8@100,int4@500" -> ((100, IntQuant), (500, IntQuant)); "@7" -> ((7, None),)."""
    if not isinstance(spec, str):
        raise TypeError(f"{field} must be a string of CODEC@STEP items; got {spec!r}")
    items = []
    for raw in spec.split(","):
        text = raw.strip()
        name, at, step_text = text.rpartition("@")
        bad = lambda why: ValueError(f"{field}={spec!r}: {why}")
        if not at:
            raise bad(f"item {text!r} is not CODEC@STEP or @STEP (e.g. 'int8@100,int4@500' "
                      "or '@100')")
        try:
            step = int(step_text.strip())
        except ValueError:
            raise bad(f"step {step_text!r} of item {text!r} is not an integer") from None
        if step < 0:
            raise bad(f"step {step} must be >= 0")
        if items and step <= items[-1][0]:
            raise bad(f"steps must strictly increase; {step} comes after {items[-1][0]}")
        try:
            items.append((step, codecs.parse(name) if name.strip() else None))
        except (TypeError, ValueError) as e:
            raise bad(e) from None
    return tuple(items)


def _check_stateful(axis, kind, items, base, field, spec):
    resolved = [base[axis, kind] if c is None and base is not None else c for _, c in items]
    for c in resolved:
        policy_lib.check_placement(c, axis, kind, f"{field}={spec!r}")
    stateful = [c for c in resolved if getattr(c, "kind", None) in STATEFUL_KINDS]
    if stateful and len(items) > 1:
        raise ValueError(f"{field}={spec!r}: {stateful[0]} must be the only item (CODEC@N or "
                         "@N): the train state it keeps cannot serve another codec's phases")


def parse(specs: Mapping[str, str], *, base: policy_lib.Policy | None = None,
          warmup_steps: int = 0, prefix: str = "") -> Schedule:
    """{"axis.kind": "CODEC@STEP,..."} -> Schedule; empty specs are unscheduled.

    `base`, when given, is checked against the schedule (a bare @N on a PowerSGD
    base follows the PowerSGD rules). Errors name `{prefix}schedule.axis.kind`
    or `{prefix}warmup_steps`: ValueError for bad values, TypeError for bad types.
    """
    if not isinstance(specs, Mapping):
        raise TypeError(f"{prefix}schedule must be a mapping of 'axis.kind' to a spec; "
                        f"got {type(specs).__name__}")
    warmup = _step(warmup_steps, f"{prefix}warmup_steps")
    parsed = {}
    for key, spec in specs.items():
        field = f"{prefix}schedule.{key}"
        axis, _, kind = str(key).partition(".")
        if (axis, kind) not in policy_lib.MESSAGES:
            raise ValueError(f"{field}: no message of the step is {key!r}; allowed: "
                             + ", ".join(f"{a}.{k}" for a, k in policy_lib.MESSAGES))
        if isinstance(spec, str) and not spec.strip():
            continue
        items = _parse_entry(spec, field)
        _check_stateful(axis, kind, items, base, field, spec)
        if items[0][0] < warmup:
            raise ValueError(f"{field}={spec!r} starts at step {items[0][0]}, inside "
                             f"{prefix}warmup_steps={warmup}; start it at {warmup} or later, "
                             "or drop warmup_steps and give every entry its own start")
        parsed[axis, kind] = items
    return Schedule(tuple((a, k, parsed.get((a, k), ((warmup, None),)))
                          for a, k in policy_lib.MESSAGES if (a, k) in parsed or warmup))


def policy_at(base: policy_lib.Policy, sched: Schedule, step: int) -> policy_lib.Policy:
    """The policy in force at (0-based) training step `step`."""
    step = _step(step, "step")
    overrides = {}
    for axis, kind, items in sched.entries:
        k = bisect.bisect_right([s for s, _ in items], step) - 1
        codec = "none" if k < 0 else items[k][1]
        overrides[f"{axis}.{kind}"] = base[axis, kind] if codec is None else codec
        if axis == "data" and k < 0 and kind in dict(base.dcn):  # the slow hop waits too
            overrides[f"{policy_lib.HOP_AXIS}.{kind}"] = "none"
    return base.replace(overrides)


def change_steps(sched: Schedule) -> list[int]:
    """Sorted steps > 0 at which some entry switches codec."""
    return sorted({s for _, _, items in sched.entries for s, _ in items if s > 0})


def final_policy(base: policy_lib.Policy, sched: Schedule) -> policy_lib.Policy:
    """The policy from the last change on: the one the train state is laid out for."""
    return policy_at(base, sched, (change_steps(sched) or [0])[-1])


def phases(base: policy_lib.Policy, sched: Schedule) -> list[tuple[int, policy_lib.Policy]]:
    """[(first step, policy)] from step 0, one per change of the policy in force."""
    out = [(0, policy_at(base, sched, 0))]
    for s in change_steps(sched):
        pol = policy_at(base, sched, s)
        if pol != out[-1][1]:
            out.append((s, pol))
    return out


def phase_at(phase_list, step: int) -> policy_lib.Policy:
    """The policy of `phases(...)` in force at `step`."""
    return phase_list[bisect.bisect_right([s for s, _ in phase_list], step) - 1][1]


def is_compressed(pol: policy_lib.Policy) -> bool:
    """Whether any entry sends something other than the raw array."""
    return any(codecs.parse(c).kind != "identity"
               for c in [c for _, _, c in pol.table] + [c for _, c in pol.dcn])


def changes(old: policy_lib.Policy, new: policy_lib.Policy) -> str:
    """The entries that differ, e.g. "data.grad=none->int8"; "" if none. Slow-hop
    entries are listed where either policy sets them."""
    set_hop = {k for k, _ in old.dcn + new.dcn}  # an unset dcn entry changes with data's
    entries = [(a, k) for a, k, _ in old.table] + [
        (a, k) for a, k in policy_lib.HOP_MESSAGES if k in set_hop]
    return " ".join(f"{a}.{k}={codecs.parse(old[a, k])}->{codecs.parse(new[a, k])}"
                    for a, k in entries if old[a, k] != new[a, k])
