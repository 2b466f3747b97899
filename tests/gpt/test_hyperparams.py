"""jcomp.gpt.hyperparams: the optax optimizer and schedule, and their checks."""
import jax.numpy as jnp
import numpy as np
import pytest

from jcomp.gpt import hyperparams

HP = dict(lr=1e-2, warmup_steps=1, total_steps=20, min_lr_ratio=0.1, b1=0.9, b2=0.95,
          eps=1e-8, weight_decay=0.1)


@pytest.mark.parametrize("field,value", [
    ("lr", 0.0), ("warmup_steps", -1), ("total_steps", 0), ("warmup_steps", 20),
    ("b1", 1.0), ("b2", -0.1), ("eps", 0.0), ("weight_decay", -1e-3), ("min_lr_ratio", 1.5),
])
def test_bad_hyperparameters_raise(field, value):
    with pytest.raises(ValueError, match=field):
        hyperparams.make_tx(**{**HP, field: value})


def test_bad_types_raise():
    with pytest.raises(TypeError, match="lr"):
        hyperparams.make_tx(**{**HP, "lr": "1e-3"})
    with pytest.raises(TypeError, match="total_steps"):
        hyperparams.make_tx(**{**HP, "total_steps": 10.0})


def test_sgd_is_heavy_ball_momentum_and_names_are_checked():
    """optim.name="sgd": updates are -lr * (momentum trace of the gradients) plus
    decoupled weight decay, the same schedule as AdamW's."""
    hp = dict(HP, weight_decay=0.0)
    tx = hyperparams.make_tx(**hp, name="sgd")
    params = {"w": jnp.ones(3)}
    state = tx.init(params)
    g = {"w": jnp.array([1.0, -2.0, 0.5])}
    trace = jnp.zeros(3)
    sched = hyperparams.make_schedule(lr=hp["lr"], warmup_steps=hp["warmup_steps"],
                              total_steps=hp["total_steps"], min_lr_ratio=hp["min_lr_ratio"])
    for i in range(3):
        updates, state = tx.update(g, state, params)
        trace = hp["b1"] * trace + g["w"]
        np.testing.assert_allclose(updates["w"], -sched(i) * trace, rtol=1e-6)
    with pytest.raises(ValueError, match="adamw, sgd"):
        hyperparams.make_tx(**HP, name="lion")


def test_decay_mask_skips_norm_scales_biases_and_vectors():
    params = {"w": jnp.ones((2, 3)), "bias": jnp.ones((3,)), "ln_scale": jnp.ones((4, 3)),
              "v": jnp.ones(3), "blocks": {"attn_bias": jnp.ones((2, 3)),
                                           "kernel": jnp.ones((2, 3, 3))}}
    assert hyperparams.decay_mask(params) == {
        "w": True, "bias": False, "ln_scale": False, "v": False,
        "blocks": {"attn_bias": False, "kernel": True}}
