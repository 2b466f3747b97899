"""A nanoDO-shaped train step, written from nanoDO's structure (model.py, fsdp.py,
loss.py, train.py), shrunk to test size.

- One mesh axis, "data", over every device; the batch and the parameters are
  both split over it (FSDP: `fsdp.init` partitions each kernel on one dimension
  over "data" with `nn.with_partitioning`).
- The parameters stay boxed (`nn.Partitioned`), as in nanoDO's TrainState; the
  jit's shardings come from `nn.get_sharding`.
- The loss closes over the batch (`get_loss_fn(in_BxL, apply_fn)(params)`),
  sums the cross entropy over the non-padding targets and divides by their
  count; `aux` carries that count (int32) and the log perplexity.
- The step constrains the batch to P("data") and calls
  `jax.value_and_grad(loss_fn, has_aux=True)(params)`.
"""
from __future__ import annotations

import functools

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

VOCAB, D, H, DH, F, LAYERS, L, BATCH = 128, 64, 4, 16, 128, 2, 16, 16
PAD = 0


def _init(layer_type):
    """fsdp.init: which dimension of each kernel is split over "data"."""
    axes = {"embedding": (None, "data"), "attn_in_proj": ("data", None, None),
            "attn_out_proj": (None, None, "data"), "mlp_kernel": ("data", None),
            "head": ("data", None)}[layer_type]
    base = nn.initializers.normal(0.02) if layer_type == "embedding" else nn.initializers.xavier_uniform()
    return nn.with_partitioning(base, axes)


class CausalAttn(nn.Module):
    """nanoDO's: q, k, v and the output projection are `nn.DenseGeneral`s, whose
    kernels flax creates flat (2-D) under 3-D partition names; flax checks the
    names against the value only where a mesh context is set."""
    @nn.compact
    def __call__(self, x_BxLxD):
        multilinear = functools.partial(nn.DenseGeneral, axis=-1, features=(H, DH),
                                        kernel_init=_init("attn_in_proj"), use_bias=False)
        q_BxLxHxK, k_BxLxHxK, v_BxLxHxK = (multilinear(name=n)(x_BxLxD)
                                           for n in ("query", "key", "value"))
        att_BxHxLxL = jnp.einsum("blhk,bmhk->bhlm", q_BxLxHxK, k_BxLxHxK) / np.sqrt(DH)
        att_BxHxLxL = jnp.where(jnp.tril(jnp.ones((L, L), bool)), att_BxHxLxL, -jnp.inf)
        out_BxLxHxK = jnp.einsum("bhlm,bmhk->blhk", jax.nn.softmax(att_BxHxLxL), v_BxLxHxK)
        return nn.DenseGeneral(features=D, axis=(-2, -1), name="attn_out_proj",
                               kernel_init=_init("attn_out_proj"),
                               use_bias=False)(out_BxLxHxK)


class Block(nn.Module):
    @nn.compact
    def __call__(self, x_BxLxD):
        x_BxLxD = x_BxLxD + CausalAttn()(nn.LayerNorm()(x_BxLxD))
        h_BxLxF = nn.gelu(nn.Dense(F, kernel_init=_init("mlp_kernel"))(nn.LayerNorm()(x_BxLxD)))
        return x_BxLxD + nn.Dense(D, kernel_init=_init("mlp_kernel"))(h_BxLxF)


class TransformerDo(nn.Module):
    @nn.compact
    def __call__(self, x_BxL):
        x_BxLxD = nn.Embed(VOCAB, D, embedding_init=_init("embedding"))(x_BxL)
        x_BxLxD = x_BxLxD + self.param("pos", nn.initializers.normal(0.02), (L, D))
        for _ in range(LAYERS):
            x_BxLxD = Block()(x_BxLxD)
        return nn.Dense(VOCAB, kernel_init=_init("head"))(nn.LayerNorm()(x_BxLxD))


@flax.struct.dataclass
class LossAuxData:
    ntokens: jax.Array
    state: dict
    log_perplexity: jax.Array


def get_loss_fn(in_BxL, apply_fn):
    """loss.get_default_loss_fn: loss_fn(params) closing over the batch."""
    def loss_fn(params):
        x_BxL, y_BxL = in_BxL[:, :-1], in_BxL[:, 1:]
        weights_BxL = jnp.where(y_BxL != PAD, 1, 0)
        logits_BxLxV = apply_fn({"params": params}, x_BxL)
        losses_BxL = optax.softmax_cross_entropy_with_integer_labels(logits_BxLxV, y_BxL)
        ntokens = weights_BxL.sum()
        mean_loss = jnp.sum(losses_BxL * weights_BxL) / ntokens
        return mean_loss, LossAuxData(ntokens=ntokens, state={}, log_perplexity=mean_loss)
    return loss_fn


def make_mesh():
    return Mesh(np.array(jax.devices()), ("data",))


def init(mesh, seed=0):
    """_init_train_state: boxed params placed with nn.get_sharding. -> (params,
    shardings, tx, opt_state)."""
    model = TransformerDo()
    dummy = jnp.zeros((1, L), jnp.int32)
    abstract = jax.eval_shape(lambda: model.init(jax.random.key(seed), dummy)["params"])
    shardings = nn.get_sharding(abstract, mesh)
    params = jax.jit(lambda: model.init(jax.random.key(seed), dummy)["params"],
                     out_shardings=shardings)()
    tx = optax.adamw(1e-2, weight_decay=0.01)
    opt_shardings = nn.get_sharding(jax.eval_shape(tx.init, abstract), mesh)  # TrainState's
    return params, shardings, tx, jax.jit(tx.init, out_shardings=opt_shardings)(params)


def batches(mesh, steps, seed=0):
    """Rows of a fixed random chain (each token's successor is perm[token]),
    padded after a random length per row (the first half of the rows short),
    replicated as nanoDO's jit receives them."""
    perm = np.random.default_rng(1234).permutation(np.arange(1, VOCAB))
    succ = np.zeros(VOCAB, np.int32)
    succ[np.arange(1, VOCAB)] = perm
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        in_BxL = np.zeros((BATCH, L + 1), np.int32)
        in_BxL[:, 0] = rng.integers(1, VOCAB, BATCH)
        for t in range(L):
            in_BxL[:, t + 1] = succ[in_BxL[:, t]]
        lengths = rng.integers(3, L + 2, (BATCH, 1))
        lengths[: BATCH // 2] = 3
        in_BxL[np.arange(L + 1)[None, :] >= lengths] = PAD
        yield jax.device_put(in_BxL, NamedSharding(mesh, P()))


def make_train_step(mesh, shardings, tx, value_and_grad_line):
    """nanoDO's _train_step; value_and_grad_line(in_BxL, params) is its one
    gradient line."""
    def step(params, opt_state, in_BxL):
        in_BxL = jax.lax.with_sharding_constraint(in_BxL, NamedSharding(mesh, P("data")))
        (loss, aux), grads = value_and_grad_line(in_BxL, params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, aux
    return jax.jit(step, donate_argnums=(0, 1))


def plain_line(apply_fn):
    return lambda in_BxL, params: jax.value_and_grad(
        get_loss_fn(in_BxL, apply_fn), has_aux=True)(params)
