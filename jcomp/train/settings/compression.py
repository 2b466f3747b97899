"""config.compression read once (`from_config`) into a frozen
`CompressionSettings`, with the one place its policy and schedule are built:
`_phases`, the policy in force from step 0, ((first step, Policy), ...), each
codec parsed there. A variant (another error_feedback, entries set by
compression.auto, another mesh.dcn_data) is built again by `rebuilt`.

compression.auto's fields are read here too, by `jcomp.train.settings.auto`,
into `CompressionSettings.auto`.
"""
from __future__ import annotations

import dataclasses

from jcomp.gpt import policy as policy_lib
from jcomp.gpt import schedule as schedule_lib
from jcomp.train.run.faults import UsageError
from jcomp.train.settings import auto as auto_settings
from jcomp.train.settings import sections

EF_MODES = {"auto": None, "on": True, "off": False}


@dataclasses.dataclass(frozen=True)
class CompressionSettings:
    """config.compression, checked; entries as written ("" unset)."""

    policy: str                # a preset of jcomp.gpt.policy
    error_feedback: str        # auto, on, off
    entries: tuple             # (("data.grad", spec), ...): the set entries of MESSAGES
    hop_entries: tuple         # (("dcn.grad", spec), ...): the set slow-hop entries
    places: tuple              # (("tensor.act", "layers" value), ...) of policy_lib.PLACES
    schedule: tuple            # (("data.grad", "CODEC@N,..."), ...) of MESSAGES
    warmup_steps: int
    bucket_bytes: int          # the optimizer's flat buffers, at least 1 byte
    auto: auto_settings.AutoSettings | None  # compression.auto; None: off
    dcn_data: int              # mesh.dcn_data, which the slow hop's entries need > 1
    phases: tuple              # ((first step, Policy), ...) from step 0: `_phases`

    def rebuilt(self, *, entries: dict | None = None, dcn_data: int | None = None,
                error_feedback: str | None = None) -> "CompressionSettings":
        """These settings with the "axis.kind" `entries` set (the slow hop's among
        them, as if written in the config), another mesh.dcn_data or another
        error_feedback, and their phases built again."""
        entries, hop = entries or {}, {f"{a}.{k}" for a, k in policy_lib.HOP_MESSAGES}
        fields = dict(
            policy=self.policy,
            error_feedback=self.error_feedback if error_feedback is None else error_feedback,
            entries=tuple((dict(self.entries) | {k: v for k, v in entries.items()
                                                 if k not in hop}).items()),
            hop_entries=tuple((dict(self.hop_entries) | {k: v for k, v in entries.items()
                                                         if k in hop}).items()),
            places=self.places, schedule=self.schedule, warmup_steps=self.warmup_steps,
            dcn_data=self.dcn_data if dcn_data is None else dcn_data)
        return CompressionSettings(**fields, bucket_bytes=self.bucket_bytes, auto=self.auto,
                                   phases=_phases(**fields))


def from_config(comp, dcn_data: int = 1) -> CompressionSettings:
    """config.compression (on a mesh of `dcn_data` slow-hop groups) ->
    CompressionSettings, its phases built; UsageError naming the field."""
    if comp.policy not in policy_lib.PRESETS:
        raise UsageError(f"compression.policy={comp.policy!r} is not one of "
                         f"{', '.join(policy_lib.PRESETS)}")
    if comp.error_feedback not in EF_MODES:
        raise UsageError(f"compression.error_feedback={comp.error_feedback!r}; "
                         "allowed: auto, on, off")
    w = sections.check_number(comp.warmup_steps, "compression.warmup_steps", zero_ok=True)
    mib = sections.check_number(comp.bucket_mib, "compression.bucket_mib", integer=False)
    entries = tuple((f"{a}.{k}", comp[a][k]) for a, k in policy_lib.MESSAGES if comp[a][k])
    hop = tuple((f"{a}.{k}", comp.get(a, {}).get(k, "")) for a, k in policy_lib.HOP_MESSAGES)
    fields = dict(
        policy=comp.policy, error_feedback=comp.error_feedback, entries=entries,
        hop_entries=tuple((k, v) for k, v in hop if v),
        places=tuple((f"{a}.{k}", comp[place][a][k])
                     for (a, k), place in policy_lib.PLACES.items()),
        schedule=tuple((f"{a}.{k}", comp.schedule[a][k]) for a, k in policy_lib.MESSAGES),
        warmup_steps=w, dcn_data=dcn_data)
    phases = _phases(**fields)
    return CompressionSettings(**fields, bucket_bytes=max(int(mib * 2**20), 1), phases=phases,
                               auto=auto_settings.read(comp))


def _phases(*, policy, error_feedback, entries, hop_entries, places, schedule, warmup_steps,
            dcn_data) -> tuple:
    """The policy in force from step 0: ((first step, Policy), ...) (see
    `jcomp.gpt.schedule`); the last one lays out the train state. The slow
    hop's entries (compression.dcn.*) need mesh.dcn_data > 1."""
    overrides = {}
    for entry, spec in entries:
        axis, _, kind = entry.partition(".")
        try:
            overrides[entry] = policy_lib.parse_entry(axis, kind, spec,
                                                      where=f"compression.{entry}")
        except (TypeError, ValueError) as e:
            raise UsageError(str(e)) from None
    for entry, spec in hop_entries:
        field = f"compression.{entry}"
        if dcn_data == 1:
            raise UsageError(f"{field}={spec!r} codes the slow hop of a split data axis; it "
                             "needs mesh.dcn_data > 1 (or leave it '')")
        try:
            overrides[entry] = policy_lib.parse_hop_entry(entry.partition(".")[2], spec,
                                                          where=field)
        except (TypeError, ValueError) as e:
            raise UsageError(str(e)) from None
    try:
        pol = policy_lib.build(policy, overrides, EF_MODES[error_feedback])
    except (TypeError, ValueError) as e:
        raise UsageError(f"compression: {e}") from None
    for entry, value in places:
        axis, _, kind = entry.partition(".")
        try:
            pol = pol.restrict({entry: value})
        except (TypeError, ValueError) as e:
            raise UsageError(f"compression.{policy_lib.PLACES[axis, kind]}.{entry}: {e}") \
                from None
    try:
        sched = schedule_lib.parse(dict(schedule), base=pol, warmup_steps=warmup_steps,
                                   prefix="compression.")
        out = tuple(schedule_lib.phases(pol, sched))
    except (TypeError, ValueError) as e:
        raise UsageError(str(e)) from None
    _check_randomness(out)
    return out


def _check_randomness(phases):
    """Codecs that draw random numbers get a per-step key only where the optimizer
    sends (data.grad, data.param); inside the model they would have none."""
    keyed = (("data", "grad"), ("data", "param"))
    for _, pol in phases:
        for axis, kind in policy_lib.MESSAGES:
            spec = pol[axis, kind]
            if (axis, kind) not in keyed and getattr(spec, "needs_key", False):
                raise UsageError(
                    f"compression.{axis}.{kind}={spec}: codecs that draw random numbers "
                    "(stochastic rounding ':sr', randk) are supported at data.grad and "
                    "data.param only; use a deterministic codec here (e.g. int8)")


def check_reaches_the_run(c: CompressionSettings, phases, steps: int):
    """A compression setting no step of the run would use is refused: error
    feedback with nothing lossy to feed back, or a warm-up or schedule whose
    compressed phases all start at or after train.steps."""
    final = phases[-1][1]
    hop_lossy = bool(dict(c.hop_entries).get("dcn.grad")) \
        and final["dcn", "grad"].kind != "identity"
    if c.error_feedback == "on" and final["data", "grad"].kind == "identity" and not hop_lossy:
        raise UsageError(
            "compression.error_feedback='on' has nothing to feed back: compression.data.grad "
            f"is {final['data', 'grad']} (lossless); error feedback corrects a lossy "
            "data.grad codec: set one (e.g. int8), or error_feedback='auto' or 'off'")
    starts = [s for s, pol in phases if schedule_lib.is_compressed(pol)]
    if starts and min(starts) >= steps:
        if c.warmup_steps >= steps:
            raise UsageError(f"compression.warmup_steps={c.warmup_steps} is not below "
                             f"train.steps={steps}: no step would be compressed; allowed: "
                             f"0 to {steps - 1}")
        raise UsageError(f"compression.schedule: the first compressed phase starts at step "
                         f"{min(starts)}, not below train.steps={steps}: no step would be "
                         "compressed")


def check_one_lossy_hop(plans, layout):
    """With two hops and error feedback the state keeps one hop's residual: every
    phase must code the same hop lossily (or none)."""
    if not layout.error_feedback or len(layout.data_axes) == 1:
        return
    lossy = {axis for pl in plans for axis, g, _ in pl.data_hops() if g.codec.kind != "identity"}
    if len(lossy) > 1:
        raise UsageError("compression.error_feedback: the phases code both hops' gradients "
                         "lossily (data.grad and dcn.grad), but the state keeps one hop's "
                         "residual; code one hop only, or set error_feedback='off'")
