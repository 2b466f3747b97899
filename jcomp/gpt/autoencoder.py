"""A learned linear autoencoder for tensor-parallel activations (Bian et al.,
MLSys 2024): `ae:dim=A` at tensor.act and/or tensor.act_grad.

Its weights are model parameters, trained and checkpointed with the model; the
collectives see the code width A instead of d_model D. Per layer and sub-block
(attention, MLP), with E [D, A] and Dec [A, D]:

  act       y = psum_T(y_i E) Dec   the row-parallel all-reduce runs on the A-wide
                                    code; a linear code sums correctly
  act_grad  h = copy(x E') Dec'     before the column-parallel matmul: the backward
                                    all-reduce runs on the code's gradient, at the
                                    price of a rank-A bottleneck on the input

`ae_out_enc` multiplies a rank-varying partial sum and `ae_in_dec` a
rank-varying copy, so their gradients differ per tensor rank; the step sums
them over tensor with tensor.grad (`varying_over_tensor`). `init=orthogonal`
starts E Dec as a projection (Dec = E^T), `init=normal` draws N(0, 1/D) and
N(0, 1/A) entries; `rest=CODEC` codes the tensor messages outside the blocks
(the embedding sum, the loss's entry).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jcomp.codecs import structured

SUBBLOCKS = ("attn", "mlp")
# The coders' logical axes (jcomp.gpt.model.PARAM_AXES): enc [D, A], dec [A, D];
# "code" is no split axis, so every tensor rank holds them whole.
PARAM_AXES = {(f"{s}_ae_{p}_{w}",): ("embed", "code") if w == "enc" else ("code", "embed")
              for s in SUBBLOCKS for p in ("out", "in") for w in ("enc", "dec")}
Autoencoder, parse = structured.Autoencoder, structured.parse_ae  # the spec, beside the codecs'


def varying_over_tensor(parts) -> tuple:
    """The Block parameters whose gradient differs per tensor rank (see above):
    out's encoder and in's decoder of each sub-block, for the parts ("out",
    "in") in `parts`."""
    return tuple(f"{s}_ae_{p}_{w}" for s in SUBBLOCKS
                 for p, w in (("out", "enc"), ("in", "dec")) if p in parts)


def dims(pol) -> dict:
    """Block sizes a policy asks for: {"out_dim": A or 0, "in_dim": A or 0,
    "init": ...} from policy[tensor, act] and policy[tensor, act_grad]."""
    out, inn = pol["tensor", "act"], pol["tensor", "act_grad"]
    learned = [c for c in (out, inn) if getattr(c, "kind", None) == "learned"]
    if len({c.init for c in learned}) > 1:
        raise ValueError("tensor.act and tensor.act_grad autoencoders must use the same init; "
                         f"got {out} and {inn}")
    return {"out_dim": out.dim if out in learned else 0,
            "in_dim": inn.dim if inn in learned else 0,
            "init": learned[0].init if learned else "orthogonal"}


def coder(part: str, dim: int, init: str):
    """A model coder (jcomp.gpt.model's enter_coder / exit_coder) for part "in"
    (tensor.act_grad, at tp_enter) or "out" (tensor.act, at tp_exit):
    hook(x E) Dec, so the collective in `hook` moves the A-wide code."""

    def code(block, sub, hook, x_BxLxD):
        name = f"{sub}_ae_{part}"
        pair = lambda key: init_pair(key, block.d_model, dim, init)
        enc_DxA = block.param(f"{name}_enc", lambda k: pair(k)[0])
        # An orthogonal pair starts as a projection: the decoder is the encoder's transpose.
        dec_AxD = block.param(f"{name}_dec",
                              lambda k: enc_DxA.T if init == "orthogonal" else pair(k)[1])
        z_BxLxA = x_BxLxD @ enc_DxA.astype(block.dtype)
        return hook(z_BxLxA) @ dec_AxD.astype(block.dtype)

    return code


def coders(pol, only=("out", "in")) -> dict:
    """The model coders a policy's autoencoders need: {"exit": ..., "enter": ...},
    each present where policy[tensor, act] (exit) or [tensor, act_grad] (enter)
    is an autoencoder and its part is in `only`."""
    d = dims(pol)
    return {hook: coder(part, d[f"{part}_dim"], d["init"])
            for hook, part in (("exit", "out"), ("enter", "in"))
            if d[f"{part}_dim"] and part in only}


def init_pair(key, d_model: int, dim: int, init: str):
    """(enc [D, A], dec [A, D]) float32."""
    if dim > d_model:
        raise ValueError(f"ae dim={dim} must not exceed model.d_model={d_model}: it would "
                         "send more than the activations it codes")
    if init == "orthogonal":
        enc_DxA = jax.nn.initializers.orthogonal()(key, (d_model, dim), jnp.float32)
        return enc_DxA, enc_DxA.T
    k1, k2 = jax.random.split(key)
    enc_DxA = jax.random.normal(k1, (d_model, dim), jnp.float32) / jnp.sqrt(d_model)
    dec_AxD = jax.random.normal(k2, (dim, d_model), jnp.float32) / jnp.sqrt(dim)
    return enc_DxA, dec_AxD
