"""The optimizer and its learning-rate schedule, as optax builds them.

    tx = make_tx(lr=3e-4, warmup_steps=100, total_steps=10_000,
                 weight_decay=0.1, decay_mask=decay_mask)

The ZeRO update (`jcomp.gpt.zero`) applies `tx` to flat float32 shards, so the
optimizer must be elementwise (Adam, decoupled weight decay, schedules); the
weight-decay mask is computed from the full parameters beforehand.
"""
from __future__ import annotations

import math
import numbers

import jax
import optax

NO_DECAY_NAMES = ("bias", "scale")


def _number(name, value, *, integer=False):
    kinds = numbers.Integral if integer else numbers.Real
    if isinstance(value, bool) or not isinstance(value, kinds):
        raise TypeError(f"{name} must be {'an int' if integer else 'a number'}; got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite; got {value}")
    return value


def _check(name, value, ok: bool, allowed: str):
    if not ok:
        raise ValueError(f"{name} must be {allowed}; got {value}")


def check_clip_norm(clip_norm) -> None:
    """Global-norm clipping threshold: a finite number >= 0 (0 disables)."""
    _check("clip_norm", _number("clip_norm", clip_norm), clip_norm >= 0, ">= 0 (0 disables)")


def make_schedule(*, lr, warmup_steps, total_steps, min_lr_ratio=0.0) -> optax.Schedule:
    """Linear warm-up from 0 to `lr` over `warmup_steps`, then cosine decay to
    `min_lr_ratio * lr` at `total_steps` (constant after). ValueError names a bad field."""
    _check("lr", _number("lr", lr), lr > 0, "> 0")
    _number("warmup_steps", warmup_steps, integer=True)
    _number("total_steps", total_steps, integer=True)
    _check("total_steps", total_steps, total_steps > 0, "> 0")
    _check("warmup_steps", warmup_steps, 0 <= warmup_steps < total_steps,
           f">= 0 and < total_steps ({total_steps})")
    _number("min_lr_ratio", min_lr_ratio)
    _check("min_lr_ratio", min_lr_ratio, 0 <= min_lr_ratio <= 1, "in [0, 1]")
    return optax.warmup_cosine_decay_schedule(
        0.0, lr, int(warmup_steps), int(total_steps), end_value=min_lr_ratio * lr)


OPTIMIZERS = ("adamw", "sgd")


def make_tx(*, lr, warmup_steps, total_steps, min_lr_ratio=0.0, b1=0.9, b2=0.95, eps=1e-8,
            weight_decay=0.0, decay_mask=None, name="adamw") -> optax.GradientTransformation:
    """AdamW as optax.chain(scale_by_adam, add_decayed_weights(mask), scale_by_learning_rate);
    name="sgd" puts optax.trace(b1) (heavy-ball momentum; b2 and eps unused) in
    scale_by_adam's place: a linear optimizer, under which error feedback's
    delayed gradient adds up to the gradients it delayed.

    decay_mask: pytree of bools shaped like the params (see `decay_mask`) or None
    (decay every leaf). Clipping is not part of it: under sharding optax would
    only see the local norm; `apply_updates` clips by the global one.
    """
    if name not in OPTIMIZERS:
        raise ValueError(f"name={name!r}; allowed: {', '.join(OPTIMIZERS)}")
    schedule = make_schedule(lr=lr, warmup_steps=warmup_steps, total_steps=total_steps,
                             min_lr_ratio=min_lr_ratio)
    for field, value in (("b1", b1), ("b2", b2)):
        _check(field, _number(field, value), 0 <= value < 1, "in [0, 1)")
    # eps > 0 keeps the zero padding of every shard at exactly 0 (0 / eps), never NaN.
    _check("eps", _number("eps", eps), eps > 0, "> 0")
    _check("weight_decay", _number("weight_decay", weight_decay), weight_decay >= 0, ">= 0")
    return optax.chain(
        optax.scale_by_adam(b1=b1, b2=b2, eps=eps) if name == "adamw" else optax.trace(decay=b1),
        optax.add_decayed_weights(weight_decay, decay_mask),
        optax.scale_by_learning_rate(schedule),
    )


def _leaf_name(path) -> str:
    last = path[-1] if path else None
    for attr in ("key", "name", "idx"):
        if hasattr(last, attr):
            return str(getattr(last, attr))
    return ""


def decay_mask(params):
    """True where weight decay applies. No decay for LayerNorm scales and biases:
    leaves whose name is 'bias'/'scale' or ends in '_bias'/'_scale' (this catches
    stacked per-layer vectors of shape [N, D]), and any leaf of ndim <= 1.
    `params` may hold arrays or jax.ShapeDtypeStruct (only shapes are read)."""

    def keep(path, leaf):
        name = _leaf_name(path)
        named = name in NO_DECAY_NAMES or name.endswith(tuple("_" + n for n in NO_DECAY_NAMES))
        return not (named or len(leaf.shape) <= 1)

    return jax.tree_util.tree_map_with_path(keep, params)
