"""The config's plain sections read once, each into a frozen value beside its
checks: model, mesh, train, optim, data, checkpoint and seed (`read`).

What needs two sections at once (a layout against the mesh, an outer loop
against train.steps) is checked where both are known, in
`jcomp.train.settings.runspec`.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np

from jcomp.gpt import hyperparams
from jcomp.gpt import mesh as mesh_lib
from jcomp.gpt import model as gpt
from jcomp.train.run.faults import UsageError

MAX_SEED = 2**63 - 1  # jax.random.key takes a signed 64-bit seed


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
class Sections:
    """The plain sections of one config, checked."""

    model: gpt.ModelConfig
    shape: tuple               # mesh sizes along mesh_lib.AXES (data: both hops together)
    dcn_data: int              # mesh.dcn_data: slow-hop groups of the data axis (1: none)
    optim: OptimSettings
    train: TrainSettings
    data: DataSettings
    checkpoint_every: int
    checkpoint_keep: int
    seed: int


def read(cfg, n_devices: int) -> Sections:
    """config.model, .mesh, .train, .optim, .data, .checkpoint and .seed ->
    Sections; UsageError naming the first field that is wrong."""
    model = _model(cfg.model)
    shape, dcn_data = _mesh(cfg.mesh, n_devices)
    for name in ("train.steps", "train.batch_size", "train.microbatches", "train.log_every",
                 "train.eval_every", "train.nonfinite_limit", "data.seq_len",
                 "data.eval_batches", "checkpoint.every", "checkpoint.keep"):
        _positive(cfg, name)
    for name in ("optim.warmup_steps", "data.val_permille", "seed"):
        _positive(cfg, name, zero_ok=True)
    if cfg.seed > MAX_SEED:
        raise UsageError(f"seed must be <= {MAX_SEED} (2**63 - 1); got {cfg.seed}")
    _positive(cfg, "optim.lr", integer=False)
    for name in ("optim.weight_decay", "optim.clip_norm", "optim.min_lr_ratio",
                 "train.ef_reset_norm"):
        _positive(cfg, name, zero_ok=True, integer=False)
    optim, train, data = _optim(cfg.optim), _train(cfg.train), _data(cfg.data)
    if data.seq_len > model.max_seq_len:
        raise UsageError(f"data.seq_len={data.seq_len} exceeds "
                         f"model.max_seq_len={model.max_seq_len}")
    if train.batch_size % jax.process_count():
        raise UsageError(f"train.batch_size={train.batch_size} is not divisible by the "
                         f"{jax.process_count()} processes")
    return Sections(model=model, shape=shape, dcn_data=dcn_data, optim=optim, train=train,
                    data=data, checkpoint_every=cfg.checkpoint.every,
                    checkpoint_keep=cfg.checkpoint.keep, seed=cfg.seed)


def _positive(cfg, name, *, zero_ok=False, integer=True):
    value = cfg
    for part in name.split("."):
        value = value[part]
    return check_number(value, name, zero_ok=zero_ok, integer=integer)


def check_number(value, name, *, zero_ok=False, integer=True):
    """`value` of the field `name`: an int (or with integer=False a finite number)
    > 0, or >= 0 with zero_ok; UsageError naming the field otherwise."""
    kind = int if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kind):
        raise UsageError(f"{name} must be {'an integer' if integer else 'a number'}; got {value!r}")
    if not np.isfinite(value) or value < 0 or (value == 0 and not zero_ok):
        raise UsageError(f"{name} must be {'>= 0' if zero_ok else '> 0'}; got {value}")
    return value


def _model(m) -> gpt.ModelConfig:
    try:
        return gpt.ModelConfig(**m.to_dict())
    except (TypeError, ValueError) as e:
        raise UsageError(str(e)) from None


def _mesh(m, n_devices: int) -> tuple[tuple, int]:
    """config.mesh -> (sizes along mesh_lib.AXES, mesh.dcn_data)."""
    sizes = m.to_dict()
    dcn_data = sizes.pop("dcn_data", 1)
    try:
        shape = mesh_lib.resolve_shape(sizes, n_devices)
    except (TypeError, ValueError) as e:
        raise UsageError(f"mesh: {e}") from None
    check_dcn_data(dcn_data, shape[0])
    return tuple(shape), int(dcn_data)


def check_dcn_data(dcn_data, data: int):
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


def _optim(o) -> OptimSettings:
    if o.name not in hyperparams.OPTIMIZERS:
        raise UsageError(f"optim.name={o.name!r}; allowed: {', '.join(hyperparams.OPTIMIZERS)}")
    if o.zero_stage not in (1, 2):
        raise UsageError(f"optim.zero_stage={o.zero_stage!r}; allowed: 1, 2")
    return OptimSettings(name=o.name, lr=o.lr, warmup_steps=o.warmup_steps,
                         min_lr_ratio=o.min_lr_ratio, b1=o.b1, b2=o.b2, eps=o.eps,
                         weight_decay=o.weight_decay, clip_norm=o.clip_norm,
                         zero_stage=o.zero_stage)


def _train(t) -> TrainSettings:
    if t.nonfinite not in ("skip", "stop"):
        raise UsageError(f"train.nonfinite={t.nonfinite!r}; allowed: skip, stop")
    return TrainSettings(steps=t.steps, batch_size=t.batch_size, microbatches=t.microbatches,
                         remat=t.remat, log_every=t.log_every, eval_every=t.eval_every,
                         nonfinite=t.nonfinite, nonfinite_limit=t.nonfinite_limit,
                         ef_reset_norm=t.ef_reset_norm,
                         profile_steps=profile_steps(t.profile_steps, t.steps))


def profile_steps(spec: str, total_steps: int, field: str = "train.profile_steps"):
    """"A-B" -> (A, B) with 1 <= A <= B <= total_steps; "" -> None. UsageError
    naming `field` otherwise."""
    if spec is None or spec == "":
        return None
    parts = spec.split("-") if isinstance(spec, str) else []
    if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
        raise UsageError(f"{field}={spec!r}: want FIRST-LAST step numbers, e.g. '5-7', or ''")
    first, last = (int(p) for p in parts)
    if not 1 <= first <= last <= total_steps:
        raise UsageError(f"{field}={spec!r}: need 1 <= FIRST <= LAST <= train.steps "
                         f"({total_steps})")
    return first, last


def _data(d) -> DataSettings:
    """An empty source is refused (an unset $CORPUS, say); fields that apply to one
    kind of source only are refused for the other, instead of being ignored."""
    if not isinstance(d.source, str) or d.source.strip() in ("", "text:", "tokens:"):
        raise UsageError(f"data.source={d.source!r} names no corpus; allowed: 'kjv', a text "
                         "file, directory or glob, or 'tokens:TRAIN[,VAL]'")
    tokens = d.source.startswith("tokens:")
    if tokens and d.tokenizer:
        raise UsageError(f"data.tokenizer={d.tokenizer!r} does not apply to data.source="
                         f"{d.source!r}: token files hold token ids already; pass "
                         "--config.data.tokenizer='' (and data.token_dtype)")
    if not tokens and d.token_dtype:
        raise UsageError(f"data.token_dtype={d.token_dtype!r} applies only to a 'tokens:' "
                         f"source; data.source={d.source!r} is text: pass "
                         "--config.data.token_dtype=''")
    return DataSettings(source=d.source, tokens=tokens,
                        tokenizer=(d.tokenizer or None) if not tokens else None,
                        token_dtype=(d.token_dtype or None) if tokens else None,
                        val_permille=d.val_permille, seq_len=d.seq_len,
                        eval_batches=d.eval_batches)
