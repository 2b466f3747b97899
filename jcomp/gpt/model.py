"""Decoder-only GPT (GPT-NeoX-like): pre-LayerNorm blocks, causal attention
with rotary position embeddings, GELU MLP, tied or untied embeddings.

Shapes (jcomp's legend): B batch, L sequence, D d_model, H heads, K head_dim, F MLP hidden,
V vocab, N layers. Master parameters are float32; matmuls run in the compute
dtype; LayerNorm statistics, softmax, RoPE and the loss run in float32.

Block parameter layout (one layer; `init_params` stacks N of them on a new
leading axis). The dim in brackets is the one split across tensor ranks;
`PARAM_AXES` names every dim (heads, mlp and vocab are the split ones):

    ln1/scale [D], ln1/bias [D]
    qkv/kernel [D, 3, H, K] (2)       qkv/bias [3, H, K] (1)     column-parallel
    attn_out/kernel [H, K, D] (0)     attn_out_bias [D]          row-parallel
    ln2/scale [D], ln2/bias [D]
    mlp_in/kernel [D, F] (1)          mlp_in/bias [F] (0)        column-parallel
    mlp_out/kernel [F, D] (0)         mlp_out_bias [D]           row-parallel

Megatron tensor parallelism enters only through two callables of `Block`:
`tp_enter` wraps the LayerNorm output before each column-parallel matmul
(identity forward, all-reduce backward when parallel), `tp_exit` wraps each
row-parallel matmul output before its bias and the residual are added
(all-reduce forward). Row-parallel biases are separate parameters added after
`tp_exit` so they count once. A Block given H/T heads and F/T hidden units of
a rank's slice returns that rank's partial sums at `tp_exit`.

What travels at those two points may be coded by the model itself (a learned
autoencoder): `enter_coder` / `exit_coder`, called as coder(block, sub, hook,
x) with sub "attn" or "mlp", return the hooked activations and may create
parameters of the block (block.param). The default passes x to the hook as
it is. This module knows nothing of codecs; jcomp.gpt.autoencoder provides one.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp


DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}

# Logical axes of each Block parameter (one layer), in the letters' names
# (D embed, H heads, K head_dim, F mlp; qkv: the 3 of q, k, v). A layout maps
# them to mesh axes (jcomp.gpt.sharding.AXIS_RULES); Megatron splits TENSOR_SPLIT.
PARAM_AXES = {
    ("ln1", "scale"): ("embed",),
    ("ln1", "bias"): ("embed",),
    ("qkv", "kernel"): ("embed", "qkv", "heads", "head_dim"),
    ("qkv", "bias"): ("qkv", "heads", "head_dim"),
    ("attn_out", "kernel"): ("heads", "head_dim", "embed"),
    ("attn_out_bias",): ("embed",),
    ("ln2", "scale"): ("embed",),
    ("ln2", "bias"): ("embed",),
    ("mlp_in", "kernel"): ("embed", "mlp"),
    ("mlp_in", "bias"): ("mlp",),
    ("mlp_out", "kernel"): ("mlp", "embed"),
    ("mlp_out_bias",): ("embed",),
}
EMBED_AXES = ("vocab", "embed")  # the embedding [V, D], and an untied head
TENSOR_SPLIT = ("heads", "mlp", "vocab")


def _identity(x):
    return x


def _plain(block, sub, hook, x_BxLxD):
    """The default coder: the hook on the activations as they are."""
    return hook(x_BxLxD)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Model hyperparameters; `validate()` runs on construction."""

    vocab_size: int = 256
    d_model: int = 128
    n_heads: int = 4
    n_layers: int = 2
    d_ff: int = 512
    max_seq_len: int = 256
    tie_embeddings: bool = True
    dtype: str = "float32"
    rope_base: float = 10000.0
    init_std: float = 0.02
    ln_eps: float = 1e-5

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        """Raises TypeError/ValueError naming the first bad field."""
        for name in ("vocab_size", "d_model", "n_heads", "n_layers", "d_ff", "max_seq_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"model.{name} must be an int; got {value!r}")
            if value < 1:
                raise ValueError(f"model.{name} must be >= 1; got {value}")
        if self.d_model % self.n_heads:
            raise ValueError(
                f"model.d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(
                f"model.d_model / n_heads must be even for rotary embeddings; got head_dim "
                f"{self.head_dim} (d_model={self.d_model}, n_heads={self.n_heads})"
            )
        if not isinstance(self.tie_embeddings, bool):
            raise TypeError(f"model.tie_embeddings must be a bool; got {self.tie_embeddings!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"model.dtype must be one of {sorted(DTYPES)}; got {self.dtype!r}")
        for name in ("rope_base", "init_std", "ln_eps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"model.{name} must be a number; got {value!r}")
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"model.{name} must be finite and > 0; got {value}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def compute_dtype(self):
        return DTYPES[self.dtype]


def rope(x_BxLxHxK, base: float):
    """Rotary embedding (rotate-half form) at positions 0..L-1, in float32."""
    _, L, _, K = x_BxLxHxK.shape
    inv_freq_K2 = base ** (-jnp.arange(K // 2, dtype=jnp.float32) / (K // 2))
    angle_LxK2 = jnp.arange(L, dtype=jnp.float32)[:, None] * inv_freq_K2[None, :]
    cos, sin = jnp.cos(angle_LxK2)[:, None, :], jnp.sin(angle_LxK2)[:, None, :]
    x1, x2 = jnp.split(x_BxLxHxK.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def causal_attention(q_BxLxHxK, k_BxLxHxK, v_BxLxHxK, dtype):
    """Softmax(q k^T / sqrt(K)) v with a causal mask; scores in float32."""
    L, K = q_BxLxHxK.shape[1], q_BxLxHxK.shape[3]
    s_BxHxLxL = jnp.einsum(
        "bqhk,bshk->bhqs", q_BxLxHxK, k_BxLxHxK, preferred_element_type=jnp.float32
    ) / math.sqrt(K)
    causal_LxL = jnp.tril(jnp.ones((L, L), dtype=bool))
    s_BxHxLxL = jnp.where(causal_LxL, s_BxHxLxL, -jnp.inf)
    p_BxHxLxL = jax.nn.softmax(s_BxHxLxL, axis=-1).astype(dtype)
    return jnp.einsum("bhqs,bshk->bqhk", p_BxHxLxL, v_BxLxHxK)


class Block(nn.Module):
    """Pre-LN transformer block holding `n_heads` heads and `d_ff` hidden units
    (the local share on a tensor rank). x_BxLxD -> x_BxLxD in `dtype`."""

    n_heads: int
    head_dim: int
    d_ff: int
    d_model: int
    dtype: Any = jnp.float32
    rope_base: float = 10000.0
    eps: float = 1e-5
    init_std: float = 0.02
    n_layers: int = 1  # output projections start at init_std / sqrt(2 * n_layers)
    tp_enter: Callable = _identity
    tp_exit: Callable = _identity
    enter_coder: Callable = _plain  # see the module docstring
    exit_coder: Callable = _plain

    def _enter(self, sub, h_BxLxD):
        return self.enter_coder(self, sub, self.tp_enter, h_BxLxD)

    def _exit(self, sub, y_BxLxD):
        return self.exit_coder(self, sub, self.tp_exit, y_BxLxD)

    def _ln(self, name, x_BxLxD):
        ln = nn.LayerNorm(epsilon=self.eps, dtype=jnp.float32, param_dtype=jnp.float32, name=name)
        return ln(x_BxLxD.astype(jnp.float32)).astype(self.dtype)

    def _row_bias(self, name, y_BxLxD):
        bias_D = self.param(name, nn.initializers.zeros, (self.d_model,), jnp.float32)
        return y_BxLxD + bias_D.astype(self.dtype)

    @nn.compact
    def __call__(self, x_BxLxD):
        H, K, D, dt = self.n_heads, self.head_dim, self.d_model, self.dtype
        init = nn.initializers.normal(self.init_std)
        out_init = nn.initializers.normal(self.init_std / math.sqrt(2 * self.n_layers))

        h_BxLxD = self._enter("attn", self._ln("ln1", x_BxLxD))
        qkv_BxLx3xHxK = nn.DenseGeneral((3, H, K), dtype=dt, kernel_init=init, name="qkv")(h_BxLxD)
        q, k, v = (qkv_BxLx3xHxK[:, :, i] for i in range(3))
        q = rope(q, self.rope_base).astype(dt)
        k = rope(k, self.rope_base).astype(dt)
        a_BxLxHxK = causal_attention(q, k, v, dt)
        a_BxLxD = nn.DenseGeneral(
            D, axis=(-2, -1), use_bias=False, dtype=dt, kernel_init=out_init, name="attn_out"
        )(a_BxLxHxK)
        x_BxLxD = x_BxLxD + self._row_bias("attn_out_bias", self._exit("attn", a_BxLxD))

        h_BxLxD = self._enter("mlp", self._ln("ln2", x_BxLxD))
        u_BxLxF = nn.Dense(self.d_ff, dtype=dt, kernel_init=init, name="mlp_in")(h_BxLxD)
        u_BxLxF = nn.gelu(u_BxLxF, approximate=False)
        m_BxLxD = nn.Dense(D, use_bias=False, dtype=dt, kernel_init=out_init, name="mlp_out")(u_BxLxF)
        return x_BxLxD + self._row_bias("mlp_out_bias", self._exit("mlp", m_BxLxD))


def make_block(cfg: ModelConfig, n_heads=None, d_ff=None, tp_enter=_identity, tp_exit=_identity,
               coders=None):
    """A Block for `cfg`; n_heads/d_ff default to the full (unsharded) sizes.
    `coders`: {"enter": coder, "exit": coder} (see the module docstring)."""
    coders = coders or {}
    return Block(
        enter_coder=coders.get("enter", _plain),
        exit_coder=coders.get("exit", _plain),
        n_heads=cfg.n_heads if n_heads is None else n_heads,
        head_dim=cfg.head_dim,
        d_ff=cfg.d_ff if d_ff is None else d_ff,
        d_model=cfg.d_model,
        dtype=cfg.compute_dtype,
        rope_base=cfg.rope_base,
        eps=cfg.ln_eps,
        init_std=cfg.init_std,
        n_layers=cfg.n_layers,
        tp_enter=tp_enter,
        tp_exit=tp_exit,
    )


def _final_ln(cfg: ModelConfig):
    return nn.LayerNorm(epsilon=cfg.ln_eps, dtype=jnp.float32, param_dtype=jnp.float32)


def init_params(cfg: ModelConfig, key, coders=None) -> dict:
    """Float32 parameters with full (unsharded) shapes.

    {"embed": [V, D], "layers": Block params each with a leading [N] axis,
     "final_ln": {"scale": [D], "bias": [D]}, "head": [V, D] only if untied}.
    `coders` that create parameters add them to every block
    (`jcomp.gpt.autoencoder.coders(policy)` gives a policy's).
    """
    k_embed, k_layers, k_head = jax.random.split(key, 3)
    block = make_block(cfg, coders=coders)
    x_1x1xD = jnp.zeros((1, 1, cfg.d_model), cfg.compute_dtype)
    init_layer = lambda k: block.init(k, x_1x1xD)["params"]
    normal_VxD = nn.initializers.normal(cfg.init_std)
    params = {
        "embed": normal_VxD(k_embed, (cfg.vocab_size, cfg.d_model), jnp.float32),
        "layers": jax.vmap(init_layer)(jax.random.split(k_layers, cfg.n_layers)),
        "final_ln": _final_ln(cfg).init(k_head, jnp.zeros((1, cfg.d_model)))["params"],
    }
    if not cfg.tie_embeddings:
        params["head"] = normal_VxD(k_head, (cfg.vocab_size, cfg.d_model), jnp.float32)
    return params


def _check_ints(name, x):
    if not jnp.issubdtype(jnp.asarray(x).dtype, jnp.integer):
        raise TypeError(f"{name} must hold integer token ids; got dtype {jnp.asarray(x).dtype}")


def embed(params_embed_VxD, tokens_BxL, dtype):
    """Token embeddings x_BxLxD in `dtype`; ids outside [0, V) give NaN rows."""
    _check_ints("tokens", tokens_BxL)
    rows = params_embed_VxD.at[tokens_BxL].get(mode="fill", wrap_negative_indices=False)
    return rows.astype(dtype)


def apply_layers(params_layers, x_BxLxD, cfg: ModelConfig, tp_enter=_identity, tp_exit=_identity,
                 remat: bool = False, coders=None):
    """Runs the stacked layers (leading axis = layers held) over x_BxLxD.

    The number of layers, heads and hidden units come from the parameter
    shapes, so a pipeline stage's layers or a tensor rank's slice work as is.
    `remat` recomputes each layer's activations in the backward pass.
    `coders` as in `make_block`; parameters no coder reads are left unused (a
    compression schedule before an autoencoder's start).
    """
    if x_BxLxD.ndim != 3 or x_BxLxD.shape[-1] != cfg.d_model:
        raise ValueError(f"x must have shape [B, L, d_model={cfg.d_model}]; got {x_BxLxD.shape}")
    if x_BxLxD.shape[1] > cfg.max_seq_len:
        raise ValueError(f"sequence length {x_BxLxD.shape[1]} exceeds max_seq_len={cfg.max_seq_len}")
    n_heads_local = params_layers["qkv"]["kernel"].shape[3]
    d_ff_local = params_layers["mlp_in"]["kernel"].shape[2]
    block = make_block(cfg, n_heads_local, d_ff_local, tp_enter, tp_exit, coders)

    def layer(x, params_layer):
        return block.apply({"params": params_layer}, x), None

    if remat:
        layer = jax.checkpoint(layer, prevent_cse=False)
    x_BxLxD, _ = jax.lax.scan(layer, x_BxLxD, params_layers)
    return x_BxLxD


def head_logits(params, x_BxLxD, cfg: ModelConfig):
    """Final LayerNorm, then logits_BxLxV = x W^T (W = head or embed), float32."""
    if cfg.tie_embeddings == ("head" in params):
        raise ValueError(
            f"params must {'not ' if cfg.tie_embeddings else ''}have a 'head' entry when "
            f"model.tie_embeddings={cfg.tie_embeddings}"
        )
    w_VxD = params["embed"] if cfg.tie_embeddings else params["head"]
    h_BxLxD = _final_ln(cfg).apply({"params": params["final_ln"]}, x_BxLxD.astype(jnp.float32))
    dt = cfg.compute_dtype
    return jnp.einsum(
        "bld,vd->blv", h_BxLxD.astype(dt), w_VxD.astype(dt), preferred_element_type=jnp.float32
    )


def loss(logits_BxLxV, targets_BxL):
    """Mean cross-entropy in float32; targets outside [0, V) give NaN."""
    _check_ints("targets", targets_BxL)
    if logits_BxLxV.shape[:-1] != targets_BxL.shape:
        raise ValueError(
            f"targets shape {targets_BxL.shape} must equal logits shape without the vocab "
            f"axis {logits_BxLxV.shape[:-1]}"
        )
    logp_BxLxV = jax.nn.log_softmax(logits_BxLxV.astype(jnp.float32), axis=-1)
    logp_BxLx1 = jnp.take_along_axis(
        logp_BxLxV, targets_BxL[..., None], axis=-1, mode="fill", wrap_negative_indices=False
    )
    return -jnp.mean(logp_BxLx1)


def forward(params, tokens_BxL, cfg: ModelConfig, remat: bool = False, coders=None):
    """Single-device reference: tokens_BxL -> logits_BxLxV (float32)."""
    if jnp.ndim(tokens_BxL) != 2:
        raise ValueError(f"tokens must have shape [B, L]; got {jnp.shape(tokens_BxL)}")
    x_BxLxD = embed(params["embed"], tokens_BxL, cfg.compute_dtype)
    x_BxLxD = apply_layers(params["layers"], x_BxLxD, cfg, remat=remat, coders=coders)
    return head_logits(params, x_BxLxD, cfg)


def loss_fn(params, batch_BxL1, cfg: ModelConfig, remat: bool = False, coders=None):
    """Next-token loss of batch_Bx(L+1): inputs batch[:, :-1], targets batch[:, 1:]."""
    if jnp.ndim(batch_BxL1) != 2 or jnp.shape(batch_BxL1)[1] < 2:
        raise ValueError(f"batch must have shape [B, L+1] with L >= 1; got {jnp.shape(batch_BxL1)}")
    logits_BxLxV = forward(params, batch_BxL1[:, :-1], cfg, remat=remat, coders=coders)
    return loss(logits_BxLxV, batch_BxL1[:, 1:])


def param_count(params) -> int:
    """Total number of parameter elements."""
    return sum(int(x.size) for x in jax.tree_util.tree_leaves(params))
