"""A MaxText-shaped pre-training step, written from MaxText's structure (base.yml's
logical axis rules, the pre-train `loss_fn` / `train_step`, its `Embed`,
attention and `with_logical_constraint` helpers), shrunk to test size.

- Mesh `('data', 'fsdp', 'tensor')`, Auto axes, set with `jax.set_mesh`.
- Parameters carry logical names (`nn.with_logical_partitioning`), mapped by
  logical axis rules: `embed` over `fsdp`, `mlp`/`heads`/`vocab` over `tensor`.
- The embedding is a table lookup (`table[ids]`), table split `('vocab', 'embed')`.
- Activations are constrained with logical names whose batch maps to
  `('data', 'fsdp')` (`nn.with_logical_constraint`).
- Decoder layers are `nn.scan`ned under `nn.remat`; compute in bf16.
- The loss is token-weighted: summed cross entropy over the non-padding targets,
  divided by their count; padding is uneven over the batch. `aux` returns the
  token count (int32) and the summed loss, as MaxText's does.

`train_step(..., grads_of=...)` is MaxText's step with the gradient call
passed in: `jax.value_and_grad(loss_fn, has_aux=True)` for the plain step,
one `cc.value_and_grad(...)` line for jcomp's.
"""
from __future__ import annotations

import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

VOCAB, EMBED, HEADS, HEAD_DIM, MLP, LAYERS, SEQ, BATCH = 128, 64, 4, 16, 128, 2, 16, 16
DTYPE = jnp.dtype(os.environ.get("MT_DTYPE", "bfloat16"))

# base.yml's rules, the axes this mesh has.
RULES = (
    ("activation_batch", ("data", "fsdp")),
    ("activation_length", None),
    ("activation_embed", "tensor"),
    ("activation_heads", "tensor"),
    ("activation_mlp", "tensor"),
    ("activation_vocab", "tensor"),
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("mlp", "tensor"),
    ("heads", "tensor"),
    ("kv", None),
    ("norm", None),
    ("layers", None),
)


def make_mesh(data=2, fsdp=2, tensor=2):
    return jax.make_mesh((data, fsdp, tensor), ("data", "fsdp", "tensor"),
                         axis_types=(AxisType.Auto,) * 3)


def _constrain(x, names):
    return nn.with_logical_constraint(x, names)


class Embed(nn.Module):
    @nn.compact
    def __call__(self, ids_BxL):
        table_VxD = self.param("embedding", nn.with_logical_partitioning(
            nn.initializers.normal(1.0), ("vocab", "embed")), (VOCAB, EMBED), jnp.float32)
        x_BxLxD = jnp.asarray(table_VxD, DTYPE)[ids_BxL]
        return _constrain(x_BxLxD, ("activation_batch", "activation_length", "activation_embed"))


class DenseGeneral(nn.Module):
    """MaxText's DenseGeneral: a float32 kernel of shape in_dims + features,
    contracted with the input's last `n_in` dimensions in DTYPE."""
    features: tuple
    axes: tuple
    n_in: int = 1

    @nn.compact
    def __call__(self, x):
        shape = x.shape[-self.n_in:] + tuple(self.features)
        kernel = self.param("kernel", nn.with_logical_partitioning(
            nn.initializers.lecun_normal(in_axis=tuple(range(self.n_in)),
                                         out_axis=tuple(range(self.n_in, len(shape)))),
            self.axes), shape, jnp.float32)
        contract = (tuple(range(x.ndim - self.n_in, x.ndim)), tuple(range(self.n_in)))
        return jax.lax.dot_general(x, jnp.asarray(kernel, DTYPE), (contract, ((), ())))


def _dense(features, axes, name):
    features = features if isinstance(features, tuple) else (features,)
    return DenseGeneral(features, axes, name=name)


class Decoder(nn.Module):
    @nn.compact
    def __call__(self, x_BxLxD, _):
        norm = lambda name: nn.RMSNorm(dtype=DTYPE, param_dtype=jnp.float32, name=name,
                                       scale_init=nn.with_logical_partitioning(
                                           nn.initializers.ones, ("norm",)))
        h = norm("pre_attn")(x_BxLxD)
        q_BxLxHxK = _dense((HEADS, HEAD_DIM), ("embed", "heads", "kv"), "query")(h)
        k_BxLxHxK = _dense((HEADS, HEAD_DIM), ("embed", "heads", "kv"), "key")(h)
        v_BxLxHxK = _dense((HEADS, HEAD_DIM), ("embed", "heads", "kv"), "value")(h)
        q_BxLxHxK = _constrain(q_BxLxHxK, ("activation_batch", "activation_length",
                                           "activation_heads", None))
        att_BxHxLxL = jnp.einsum("blhk,bmhk->bhlm", q_BxLxHxK, k_BxLxHxK) / np.sqrt(HEAD_DIM)
        causal = jnp.tril(jnp.ones((SEQ, SEQ), bool))
        att_BxHxLxL = jax.nn.softmax(jnp.where(causal, att_BxHxLxL.astype(jnp.float32), -1e9))
        o_BxLxHxK = jnp.einsum("bhlm,bmhk->blhk", att_BxHxLxL.astype(DTYPE), v_BxLxHxK)
        out = DenseGeneral((EMBED,), ("heads", "kv", "embed"), n_in=2, name="out")
        x_BxLxD = x_BxLxD + out(o_BxLxHxK)
        x_BxLxD = _constrain(x_BxLxD, ("activation_batch", "activation_length", "activation_embed"))
        h = norm("pre_mlp")(x_BxLxD)
        h_BxLxF = nn.silu(_dense(MLP, ("embed", "mlp"), "wi")(h))
        h_BxLxF = _constrain(h_BxLxF, ("activation_batch", "activation_length", "activation_mlp"))
        x_BxLxD = x_BxLxD + _dense(EMBED, ("mlp", "embed"), "wo")(h_BxLxF)
        return _constrain(x_BxLxD, ("activation_batch", "activation_length",
                                    "activation_embed")), None


class Transformer(nn.Module):
    @nn.compact
    def __call__(self, ids_BxL):
        x_BxLxD = Embed(name="token_embedder")(ids_BxL)
        layers = nn.scan(nn.remat(Decoder, prevent_cse=False), variable_axes={"params": 0},
                         split_rngs={"params": True}, length=LAYERS,
                         metadata_params={nn.PARTITION_NAME: "layers"})
        x_BxLxD, _ = layers(name="layers")(x_BxLxD, None)
        x_BxLxD = nn.RMSNorm(dtype=DTYPE, param_dtype=jnp.float32, name="final_norm",
                             scale_init=nn.with_logical_partitioning(nn.initializers.ones,
                                                                     ("norm",)))(x_BxLxD)
        logits_BxLxV = _dense(VOCAB, ("embed", "vocab"), "logits")(x_BxLxD)
        return _constrain(logits_BxLxV.astype(jnp.float32),
                          ("activation_batch", "activation_length", "activation_vocab"))


def loss_fn(params, batch):
    """MaxText's pre-train loss: cross entropy summed over the target tokens whose
    segmentation is nonzero, divided by their count."""
    logits_BxLxV = Transformer().apply({"params": params}, batch["inputs"])
    xent_BxL = optax.softmax_cross_entropy_with_integer_labels(logits_BxLxV, batch["targets"])
    weights_BxL = batch["targets_segmentation"] != 0
    total_loss = jnp.sum(xent_BxL * weights_BxL)
    total_weights = jnp.sum(weights_BxL)  # int32, as MaxText's
    loss = total_loss / (total_weights + 1e-8)
    # MaxText's aux carries these as the Python float 0.0 where the model has no
    # mixture of experts or multi-token prediction.
    moe_lb_loss = mtp_loss = 0.0
    return loss, {"total_loss": total_loss, "total_weights": total_weights,
                  "moe_lb_loss": moe_lb_loss, "mtp_loss": mtp_loss}


def init(mesh, seed=0):
    """-> (params (boxed, as flax makes them), logical specs, tx, opt_state)."""
    dummy = jnp.zeros((1, SEQ), jnp.int32)
    abstract = jax.eval_shape(lambda: Transformer().init(jax.random.key(seed), dummy))
    logical = nn.get_partition_spec(abstract)["params"]
    with nn.logical_axis_rules(RULES):
        shardings = nn.logical_to_mesh_sharding(logical, mesh, RULES)
    params = jax.jit(lambda: nn.unbox(Transformer().init(jax.random.key(seed), dummy)["params"]),
                     out_shardings=shardings)()
    tx = optax.adamw(1e-2, weight_decay=0.01)
    # MaxText jits the state's init with the state's shardings: the moments as
    # their parameters, so the train step compiles once.
    opt_shardings = optax.tree_map_params(
        tx, lambda _, s: s, jax.eval_shape(tx.init, params), shardings,
        transform_non_params=lambda _: NamedSharding(mesh, P()))
    return params, logical, tx, jax.jit(tx.init, out_shardings=opt_shardings)(params)


def param_specs(logical):
    return nn.logical_to_mesh(logical, RULES)


def batches(mesh, steps, seed=0):
    """Batches of a fixed random chain (each token's successor is perm[token], so
    the next token is learnable), each row padded after a random length: the
    first half of the rows short, so the data ranks hold different numbers of
    targets."""
    perm = np.random.default_rng(1234).permutation(np.arange(1, VOCAB))
    succ = np.zeros(VOCAB, np.int32)
    succ[np.arange(1, VOCAB)] = perm
    rng = np.random.default_rng(seed)
    sharding = NamedSharding(mesh, P(("data", "fsdp")))
    for _ in range(steps):
        ids = np.zeros((BATCH, SEQ + 1), np.int32)
        ids[:, 0] = rng.integers(1, VOCAB, BATCH)
        for t in range(SEQ):
            ids[:, t + 1] = succ[ids[:, t]]
        keep = np.arange(SEQ)[None, :] < rng.integers(2, SEQ + 1, (BATCH, 1))
        keep[: BATCH // 2] &= np.arange(SEQ)[None, :] < 4
        yield jax.device_put({"inputs": ids[:, :-1], "targets": ids[:, 1:],
                              "targets_segmentation": keep.astype(np.int32)}, sharding)


def train_step(params, opt_state, batch, *, tx, grads_of):
    """MaxText's train_step with the gradient call passed in."""
    (loss, aux), grads = grads_of(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss, aux


def plain_grads_of(params, batch):
    return jax.value_and_grad(loss_fn, has_aux=True)(params, batch)
