"""What a run is: the config checked once, before anything runs, into a
frozen `RunSpec` that the training loop reads everything from.

    run = validate(cfg, n_devices)    # UsageError naming the field, or a RunSpec
    run.model, run.mesh_shape, run.phases, run.plan(phase), run.zero, run.optim.tx(total_steps)

Bad configuration raises `UsageError` (a ValueError) naming the field and what
is allowed; nothing here reads or writes the workdir, so a refused run leaves
it as it was. The compression schedule is parsed here, once: `run.phases` is
[(first step, policy in force)] from step 0. Every codec is parsed here, once:
below this module the step and the optimizer receive a message plan per phase
(`run.plan(phase)`, jcomp.gpt.messages) and the ZeRO layout (`run.zero`, of
the last phase's plan), never a policy or a codec spec string.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np

from jcomp.gpt import autoencoder, hyperparams, messages, sharding, zero
from jcomp.gpt import mesh as mesh_lib
from jcomp.gpt import model as gpt
from jcomp.gpt import policy as policy_lib
from jcomp.gpt import schedule as schedule_lib
from jcomp.train.run import faults
from jcomp.train.run import profiler
from jcomp.train.outer import fragments as fragments_lib
from jcomp.train.outer import islands as outer_lib
from jcomp.train.settings import outer as outerconfig

UsageError = faults.UsageError  # a configuration or input the user must fix


@dataclasses.dataclass(frozen=True)
class OptimSettings:
    """config.optim: the optimizer and its learning-rate schedule."""

    name: str
    lr: float
    warmup_steps: int
    min_lr_ratio: float
    b1: float
    b2: float
    eps: float
    weight_decay: float
    clip_norm: float
    zero_stage: int

    def tx(self, total_steps: int):
        """AdamW (or SGD) whose schedule spans `total_steps`."""
        try:
            return hyperparams.make_tx(name=self.name, lr=self.lr, warmup_steps=self.warmup_steps,
                                       total_steps=total_steps, min_lr_ratio=self.min_lr_ratio,
                                       b1=self.b1, b2=self.b2, eps=self.eps,
                                       weight_decay=self.weight_decay,
                                       decay_mask=hyperparams.decay_mask)
        except (TypeError, ValueError) as e:
            raise UsageError(f"optim: {e}") from None

    def schedule(self, total_steps: int):
        """step -> learning rate, as `tx(total_steps)` applies it."""
        return hyperparams.make_schedule(lr=self.lr, warmup_steps=self.warmup_steps,
                                         total_steps=total_steps, min_lr_ratio=self.min_lr_ratio)


@dataclasses.dataclass(frozen=True)
class TrainSettings:
    """config.train; `profile_steps` parsed to (first, last) or None."""

    steps: int
    batch_size: int
    microbatches: int
    remat: bool
    log_every: int
    eval_every: int
    nonfinite: str
    nonfinite_limit: int
    ef_reset_norm: float
    profile_steps: tuple | None


@dataclasses.dataclass(frozen=True)
class DataSettings:
    """config.data, with the fields that do not apply to the source emptied."""

    source: str
    tokens: bool               # a 'tokens:' source: token files, no tokenizer
    tokenizer: str | None      # None for a 'tokens:' source
    token_dtype: str | None    # None for text
    val_permille: int
    seq_len: int
    eval_batches: int


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """Everything the training loop needs to know about a run, checked."""

    model: gpt.ModelConfig
    mesh_shape: tuple          # sizes along mesh_lib.AXES (data: both hops together)
    phases: tuple              # ((first step, Policy), ...) from step 0
    plans: tuple               # the messages.Plan of each phase, in phase order
    zero: zero.Layout          # the train state's ZeRO layout (the last phase's plan)
    optim: OptimSettings
    train: TrainSettings
    data: DataSettings
    checkpoint_every: int
    checkpoint_keep: int
    seed: int
    bucket_bytes: int          # the optimizer's flat buffers, at least 1 byte
    dcn_data: int = 1          # slow-hop groups the data axis is split into (mesh.dcn_data)
    outer: outerconfig.OuterSettings | None = None  # config.outer; None: no outer loop

    @property
    def islands(self) -> int:
        """The outer loop's islands (0 without one): the slow-hop groups with
        mesh.dcn_data > 1, else every data rank."""
        if self.outer is None:
            return 0
        return self.dcn_data if self.dcn_data > 1 else self.mesh_shape[0]

    def mesh_split(self) -> int:
        """The size of the mesh's 'dcn' axis (1: none): the islands, or mesh.dcn_data."""
        return self.islands or self.dcn_data

    def mesh_sizes(self) -> dict:
        """The mesh's axes and sizes (jcomp.gpt.mesh.axis_sizes): with dcn_data > 1
        (or islands) a 'dcn' axis leads and 'data' is the fast factor."""
        return mesh_lib.axis_sizes(self.mesh_shape, self.mesh_split())

    def plan_sizes(self) -> dict:
        """The sizes the message plans are made for: the mesh's, or one island's
        (no 'dcn') with an outer loop."""
        sizes = self.mesh_sizes()
        return {a: n for a, n in sizes.items() if a != mesh_lib.DCN} if self.outer else sizes

    def plan(self, phase) -> messages.Plan:
        """What the train step sends in `phase` (one of `phases`' policies)."""
        return self.plans[[p for _, p in self.phases].index(phase)]

    @property
    def policy(self) -> policy_lib.Policy:
        """The last phase's policy: the one the train state is laid out for."""
        return self.phases[-1][1]

    def step_options(self) -> dict:
        """Keyword arguments of `step.make_train_step` besides the phase's plan."""
        return dict(layout=self.zero, microbatches=self.train.microbatches,
                    clip_norm=float(self.optim.clip_norm), remat=self.train.remat,
                    seed=self.seed, bucket_bytes=self.bucket_bytes,
                    **({"islands": outer_lib.AXIS} if self.outer else {}))

    def fingerprint(self) -> dict:
        """What a checkpoint must have been written for to be restored into this run."""
        return {"model": dataclasses.asdict(self.model), "mesh": list(self.mesh_shape),
                "zero_stage": int(self.zero.stage), "policy": self.policy.as_dict(),
                "error_feedback": bool(self.zero.error_feedback)}


# ------------------------------------------------------------------ checks

def _positive(cfg, name, *, zero_ok=False, integer=True):
    value = cfg
    for part in name.split("."):
        value = value[part]
    kind = int if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kind):
        raise UsageError(f"{name} must be {'an integer' if integer else 'a number'}; got {value!r}")
    if not np.isfinite(value) or value < 0 or (value == 0 and not zero_ok):
        raise UsageError(f"{name} must be {'>= 0' if zero_ok else '> 0'}; got {value}")
    return value


def build_policy(comp, dcn_data: int = 1) -> policy_lib.Policy:
    """config.compression -> Policy (ValueError naming the field on bad input).
    The slow hop's entries (compression.dcn.*) need mesh.dcn_data > 1."""
    if comp.policy not in policy_lib.PRESETS:
        raise UsageError(f"compression.policy={comp.policy!r} is not one of "
                         f"{', '.join(policy_lib.PRESETS)}")
    if comp.error_feedback not in ("auto", "on", "off"):
        raise UsageError(f"compression.error_feedback={comp.error_feedback!r}; "
                         "allowed: auto, on, off")
    overrides = {}
    for axis, kind in policy_lib.MESSAGES:
        spec = comp[axis][kind]
        if spec:
            try:
                overrides[f"{axis}.{kind}"] = policy_lib.parse_entry(
                    axis, kind, spec, where=f"compression.{axis}.{kind}")
            except (TypeError, ValueError) as e:
                raise UsageError(str(e)) from None
    for axis, kind in policy_lib.HOP_MESSAGES:
        spec = comp.get(axis, {}).get(kind, "")
        if not spec:
            continue
        field = f"compression.{axis}.{kind}"
        if dcn_data == 1:
            raise UsageError(f"{field}={spec!r} codes the slow hop of a split data axis; it "
                             "needs mesh.dcn_data > 1 (or leave it '')")
        try:
            overrides[f"{axis}.{kind}"] = policy_lib.parse_hop_entry(kind, spec, where=field)
        except (TypeError, ValueError) as e:
            raise UsageError(str(e)) from None
    ef = {"auto": None, "on": True, "off": False}[comp.error_feedback]
    try:
        pol = policy_lib.build(comp.policy, overrides, ef)
    except (TypeError, ValueError) as e:
        raise UsageError(f"compression: {e}") from None
    for (axis, kind), place in policy_lib.PLACES.items():
        try:
            pol = pol.restrict({f"{axis}.{kind}": comp[place][axis][kind]})
        except (TypeError, ValueError) as e:
            raise UsageError(f"compression.{place}.{axis}.{kind}: {e}") from None
    return pol


def build_phases(comp, dcn_data: int = 1) -> list:
    """config.compression -> [(first step, policy in force)] from step 0 (see
    `jcomp.gpt.schedule`); the last one lays out the train state."""
    base = build_policy(comp, dcn_data)
    specs = {f"{a}.{k}": comp.schedule[a][k] for a, k in policy_lib.MESSAGES}
    try:
        sched = schedule_lib.parse(specs, base=base, warmup_steps=comp.warmup_steps,
                                   prefix="compression.")
        return schedule_lib.phases(base, sched)
    except (TypeError, ValueError) as e:
        raise UsageError(str(e)) from None


def _model_config(cfg) -> gpt.ModelConfig:
    try:
        return gpt.ModelConfig(**cfg.model.to_dict())
    except (TypeError, ValueError) as e:
        raise UsageError(str(e)) from None


MAX_SEED = 2**63 - 1


def validate(cfg, n_devices: int) -> RunSpec:
    """Checks the whole config before anything runs -> the RunSpec of the run."""
    model_cfg = _model_config(cfg)
    sizes = cfg.mesh.to_dict()
    dcn_data = sizes.pop("dcn_data", 1)
    try:
        shape = mesh_lib.resolve_shape(sizes, n_devices)
    except (TypeError, ValueError) as e:
        raise UsageError(f"mesh: {e}") from None
    _check_dcn_data(dcn_data, shape[0])
    outer = outerconfig.settings(cfg.get("outer"))
    split = _islands(cfg, outer, shape, dcn_data) if outer else dcn_data
    try:
        mesh_shape = mesh_lib.axis_sizes(shape, split)
        mesh_lib.check_processes(shape, split, jax.process_count())
    except (TypeError, ValueError) as e:
        raise UsageError(str(e)) from None
    plan_shape = ({a: n for a, n in mesh_shape.items() if a != mesh_lib.DCN} if outer
                  else mesh_shape)
    for name in ("train.steps", "train.batch_size", "train.microbatches", "train.log_every",
                 "train.eval_every", "train.nonfinite_limit", "data.seq_len",
                 "data.eval_batches", "checkpoint.every", "checkpoint.keep"):
        _positive(cfg, name)
    for name in ("optim.warmup_steps", "compression.warmup_steps", "data.val_permille", "seed"):
        _positive(cfg, name, zero_ok=True)
    if outer and outer.every // outer.fragments > cfg.train.steps:
        raise UsageError(f"outer.every={outer.every}: no sync would run within train.steps="
                         f"{cfg.train.steps} (the first after step "
                         f"{outer.every // outer.fragments}); allowed: outer.every <= "
                         "train.steps (x outer.fragments), or 0")
    if cfg.seed > MAX_SEED:  # jax.random.key takes a signed 64-bit seed
        raise UsageError(f"seed must be <= {MAX_SEED} (2**63 - 1); got {cfg.seed}")
    for name in ("optim.lr", "compression.bucket_mib"):
        _positive(cfg, name, integer=False)
    for name in ("optim.weight_decay", "optim.clip_norm", "optim.min_lr_ratio",
                 "train.ef_reset_norm"):
        _positive(cfg, name, zero_ok=True, integer=False)
    if cfg.optim.name not in hyperparams.OPTIMIZERS:
        raise UsageError(f"optim.name={cfg.optim.name!r}; allowed: "
                         f"{', '.join(hyperparams.OPTIMIZERS)}")
    if cfg.optim.zero_stage not in (1, 2):
        raise UsageError(f"optim.zero_stage={cfg.optim.zero_stage!r}; allowed: 1, 2")
    if cfg.train.nonfinite not in ("skip", "stop"):
        raise UsageError(f"train.nonfinite={cfg.train.nonfinite!r}; allowed: skip, stop")
    try:
        profile_steps = profiler.parse_profile_steps(cfg.train.profile_steps, cfg.train.steps)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if cfg.data.seq_len > model_cfg.max_seq_len:
        raise UsageError(f"data.seq_len={cfg.data.seq_len} exceeds "
                         f"model.max_seq_len={model_cfg.max_seq_len}")
    try:
        sharding.check_layout(model_cfg, mesh_shape, cfg.train.batch_size, cfg.train.microbatches)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if cfg.train.batch_size % jax.process_count():
        raise UsageError(f"train.batch_size={cfg.train.batch_size} is not divisible by the "
                         f"{jax.process_count()} processes")
    _check_data_fields(cfg.data)
    phases = build_phases(cfg.compression, dcn_data)
    _check_randomness(phases)
    pol = phases[-1][1]
    _check_compression_reaches_the_run(cfg, phases)
    try:
        ae = autoencoder.dims(pol)
    except ValueError as e:
        raise UsageError(f"compression.tensor: {e}") from None
    for kind, dim in (("act", ae["out_dim"]), ("act_grad", ae["in_dim"])):
        if dim > model_cfg.d_model:
            raise UsageError(f"compression.tensor.{kind}: ae dim={dim} exceeds "
                             f"model.d_model={model_cfg.d_model}")
    try:
        pol.check_places(model_cfg.n_layers, mesh_shape[mesh_lib.AXES[2]])
    except ValueError as e:
        raise UsageError(f"compression.{e}") from None
    try:
        plans = tuple(messages.plan(p, model_cfg.n_layers, plan_shape) for _, p in phases)
    except ValueError as e:
        raise UsageError(str(e)) from None
    lowrank = [pl.grad_reduce.codec for pl in plans if pl.grad_reduce.codec.kind == "lowrank"]
    if outer and lowrank:
        raise UsageError(f"compression.data.grad={lowrank[0]}: PowerSGD inside the islands of "
                         "an outer loop (outer.every > 0) is not supported; use a byte codec")
    if outer and outer.fragments > 1:
        _check_fragments(outer, model_cfg, pol)
    try:
        layout = zero.for_plan(plans[-1], cfg.optim.zero_stage)
        for pl in plans[:-1]:  # every phase runs on the layout; each must fit one too
            zero.for_plan(pl, cfg.optim.zero_stage)
    except ValueError as e:
        raise UsageError(f"compression.{'dcn.grad' if dcn_data > 1 else 'data.grad'}: "
                         f"{e}") from None
    _check_one_lossy_hop(plans, layout)
    return RunSpec(model=model_cfg, mesh_shape=tuple(shape), phases=tuple(phases), plans=plans,
                   zero=layout,
                   optim=optim_settings(cfg.optim), train=_train_settings(cfg.train, profile_steps),
                   data=_data_settings(cfg.data), checkpoint_every=cfg.checkpoint.every,
                   checkpoint_keep=cfg.checkpoint.keep, seed=cfg.seed,
                   bucket_bytes=max(int(cfg.compression.bucket_mib * 2**20), 1),
                   dcn_data=int(dcn_data), outer=outer)


def _check_dcn_data(dcn_data, data: int):
    """mesh.dcn_data: a positive integer dividing mesh.data (1: no split)."""
    if isinstance(dcn_data, bool) or not isinstance(dcn_data, (int, np.integer)) or dcn_data < 1:
        raise UsageError(f"mesh.dcn_data={dcn_data!r}; {_dcn_allowed(data)}")
    if data % dcn_data:
        raise UsageError(f"mesh.dcn_data={dcn_data} does not divide mesh.data={data}; "
                         f"{_dcn_allowed(data)}")


def _dcn_allowed(data: int, shown: int = 8) -> str:
    # Built for a refusal only, from divisors up to the square root: mesh.data
    # may be huge where a plan resolves a config for many devices.
    small = [k for k in range(1, math.isqrt(data) + 1) if data % k == 0]
    divisors = small + [data // k for k in reversed(small) if k * k != data]
    names = [str(k) for k in divisors]
    if len(names) > shown + 1:
        listed = f"{', '.join(names[:shown])}, ... or {names[-1]} ({len(names)} in all)"
    else:
        listed = ", ".join(names[:-1]) + (" or " if len(names) > 1 else "") + names[-1]
    return (f"allowed: a divisor of mesh.data={data}, {listed} (1: no split; k > 1 splits "
            "the data axis into k slow-hop groups)")


def _check_fragments(outer, model_cfg, pol):
    """outer.fragments cuts the layers into blocks (`jcomp.train.outer.fragments`):
    checked on the model's abstract init, nothing compiled."""
    shapes = jax.eval_shape(lambda: gpt.init_params(model_cfg, jax.random.key(0),
                                                    coders=autoencoder.coders(pol)))
    try:
        fragments_lib.plan(shapes, outer.fragments)
    except ValueError as e:
        raise UsageError(str(e)) from None


def _islands(cfg, outer, shape, dcn_data) -> int:
    """The outer loop's islands (mesh.dcn_data's groups, or every data rank), or
    UsageError where the run cannot have them."""
    islands = dcn_data if dcn_data > 1 else shape[0]
    if islands < 2:
        raise UsageError(f"outer.every={outer.every} needs at least 2 islands: mesh.data >= 2 "
                         f"(each data rank an island) or mesh.dcn_data >= 2; got mesh.data="
                         f"{shape[0]}")
    procs = jax.process_count()
    if dcn_data == 1 and procs > 1 and islands != procs:
        # Every island must be one or several whole processes (mesh.check_processes):
        # with each data rank an island, that is one data rank per process.
        ks = " or ".join(f"mesh.dcn_data={k}" for k in range(2, procs + 1) if procs % k == 0)
        fix = (f"set mesh.dcn_data to a divisor of {procs} above 1 ({ks})"
               if shape[0] % procs == 0 else
               f"set mesh.data to a multiple of {procs} and mesh.dcn_data to a divisor of "
               f"{procs} above 1 ({ks})")
        raise UsageError(
            f"outer.every={outer.every} with mesh.dcn_data=1 (no split) makes each of the "
            f"mesh.data={shape[0]} data ranks an island, but in a run of {procs} processes "
            f"every island must be one or several whole processes: {fix}")
    for kind in ("grad", "param"):
        spec = cfg.compression.get("dcn", {}).get(kind, "")
        if spec:
            raise UsageError(f"compression.dcn.{kind}={spec!r}: with outer.every > 0 no inner "
                             "step crosses between islands; the pseudo-gradient's codec is "
                             "outer.codec (leave it '')")
    return islands


def _check_one_lossy_hop(plans, layout):
    """With two hops and error feedback the state keeps one hop's residual: every
    phase must code the same hop lossily (or none)."""
    if not layout.error_feedback or len(layout.data_axes) == 1:
        return
    lossy = {axis for pl in plans for axis, g, _ in pl.data_hops() if g.codec.kind != "identity"}
    if len(lossy) > 1:
        raise UsageError("compression.error_feedback: the phases code both hops' gradients "
                         "lossily (data.grad and dcn.grad), but the state keeps one hop's "
                         "residual; code one hop only, or set error_feedback='off'")


def optim_settings(o) -> OptimSettings:
    return OptimSettings(name=o.name, lr=o.lr, warmup_steps=o.warmup_steps,
                         min_lr_ratio=o.min_lr_ratio, b1=o.b1, b2=o.b2, eps=o.eps,
                         weight_decay=o.weight_decay, clip_norm=o.clip_norm,
                         zero_stage=o.zero_stage)


def _train_settings(t, profile_steps) -> TrainSettings:
    return TrainSettings(steps=t.steps, batch_size=t.batch_size, microbatches=t.microbatches,
                         remat=t.remat, log_every=t.log_every, eval_every=t.eval_every,
                         nonfinite=t.nonfinite, nonfinite_limit=t.nonfinite_limit,
                         ef_reset_norm=t.ef_reset_norm, profile_steps=profile_steps)


def _data_settings(d) -> DataSettings:
    tokens = isinstance(d.source, str) and d.source.startswith("tokens:")
    return DataSettings(source=d.source, tokens=tokens, tokenizer=(d.tokenizer or None) if not tokens else None,
                        token_dtype=(d.token_dtype or None) if tokens else None,
                        val_permille=d.val_permille, seq_len=d.seq_len,
                        eval_batches=d.eval_batches)


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


def _check_data_fields(d):
    """An empty source is refused (an unset $CORPUS, say); fields that apply to one
    kind of source only are refused for the other, instead of being ignored."""
    if not isinstance(d.source, str) or d.source.strip() in ("", "text:", "tokens:"):
        raise UsageError(f"data.source={d.source!r} names no corpus; allowed: 'kjv', a text "
                         "file, directory or glob, or 'tokens:TRAIN[,VAL]'")
    tokens = isinstance(d.source, str) and d.source.startswith("tokens:")
    if tokens and d.tokenizer:
        raise UsageError(f"data.tokenizer={d.tokenizer!r} does not apply to data.source="
                         f"{d.source!r}: token files hold token ids already; pass "
                         "--config.data.tokenizer='' (and data.token_dtype)")
    if not tokens and d.token_dtype:
        raise UsageError(f"data.token_dtype={d.token_dtype!r} applies only to a 'tokens:' "
                         f"source; data.source={d.source!r} is text: pass "
                         "--config.data.token_dtype=''")


def _check_compression_reaches_the_run(cfg, phases):
    """A compression setting no step of the run would use is refused: error
    feedback with nothing lossy to feed back, or a warm-up or schedule whose
    compressed phases all start at or after train.steps."""
    comp, steps, final = cfg.compression, cfg.train.steps, phases[-1][1]
    hop_lossy = bool(comp.get("dcn", {}).get("grad", "")) and final["dcn", "grad"].kind != "identity"
    if comp.error_feedback == "on" and final["data", "grad"].kind == "identity" and not hop_lossy:
        raise UsageError(
            "compression.error_feedback='on' has nothing to feed back: compression.data.grad "
            f"is {final['data', 'grad']} (lossless); error feedback corrects a lossy "
            "data.grad codec: set one (e.g. int8), or error_feedback='auto' or 'off'")
    starts = [s for s, pol in phases if schedule_lib.is_compressed(pol)]
    if starts and min(starts) >= steps:
        if comp.warmup_steps >= steps:
            raise UsageError(f"compression.warmup_steps={comp.warmup_steps} is not below "
                             f"train.steps={steps}: no step would be compressed; allowed: "
                             f"0 to {steps - 1}")
        raise UsageError(f"compression.schedule: the first compressed phase starts at step "
                         f"{min(starts)}, not below train.steps={steps}: no step would be "
                         "compressed")
