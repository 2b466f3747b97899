"""Tensor parallelism (Megatron) inside the step's shard_map: the vocab-parallel
embedding and cross-entropy, and the hooks that enter and leave each block's
column- and row-parallel matmuls through jcomp.collectives with their
messages' codecs. See jcomp.gpt.parallel for the whole layout."""
from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax

from jcomp import collectives as cc
from jcomp.meter.scope import message_scope
from jcomp.gpt import autoencoder
from jcomp.gpt import model as gpt
from jcomp.gpt.sharding import TENSOR


def _vocab_range(embed_VtxD):
    """[start, start + V/T) of this tensor rank's vocabulary shard."""
    v_local = embed_VtxD.shape[0]
    return lax.axis_index(TENSOR) * v_local, v_local


def embed_lookup(embed_VtxD, tokens_BxL, dtype, embed_sum):
    """Vocab-parallel lookup: each tensor rank fills its rows, a sum completes them
    (`embed_sum`, a messages.Message)."""
    start, v_local = _vocab_range(embed_VtxD)
    local_BxL = tokens_BxL - start
    mine_BxL = (local_BxL >= 0) & (local_BxL < v_local)
    rows_BxLxD = gpt.embed(embed_VtxD, jnp.where(mine_BxL, local_BxL, 0), jnp.float32)
    part_BxLxD = jnp.where(mine_BxL[..., None], rows_BxLxD, 0.0).astype(dtype)
    with message_scope(embed_sum.name):
        return cc.psum(part_BxLxD, TENSOR, codec=embed_sum.codec, rows=embed_sum.rows)


def vocab_parallel_logits(params, h_BxLxD, cfg, head_entry_grad):
    """Final LayerNorm and this tensor rank's vocabulary shard of the logits ->
    float32 [B, L, V/T]. The head's input enters the tensor ranks with
    `head_entry_grad` backward."""
    final_ln = gpt._final_ln(cfg)
    h_BxLxD = final_ln.apply({"params": params["final_ln"]}, h_BxLxD.astype(jnp.float32))
    with message_scope(backward=head_entry_grad.name):
        h_BxLxD = cc.copy_to_parallel(h_BxLxD.astype(cfg.compute_dtype), TENSOR,
                                      bwd_codec=head_entry_grad.codec, rows=head_entry_grad.rows)
    w_VtxD = params["embed"] if cfg.tie_embeddings else params["head"]
    return jnp.einsum("bld,vd->blv", h_BxLxD, w_VtxD.astype(cfg.compute_dtype),
                      preferred_element_type=jnp.float32)


def vocab_parallel_loss(params, h_BxLxD, targets_BxL, cfg, head_entry_grad):
    """Vocab-parallel logits and exact cross-entropy. -> mean loss (f32)."""
    logits_BxLxVt = vocab_parallel_logits(params, h_BxLxD, cfg, head_entry_grad)
    w_VtxD = params["embed"] if cfg.tie_embeddings else params["head"]
    start, v_local = _vocab_range(w_VtxD)
    max_BxL = lax.pmax(lax.stop_gradient(logits_BxLxVt).max(-1), TENSOR)
    sumexp_BxL = lax.psum(jnp.exp(logits_BxLxVt - max_BxL[..., None]).sum(-1), TENSOR)
    local_BxL = targets_BxL - start
    mine_BxL = (local_BxL >= 0) & (local_BxL < v_local)
    picked_BxL = jnp.take_along_axis(logits_BxLxVt, jnp.clip(local_BxL, 0, v_local - 1)[..., None],
                                     axis=-1)[..., 0]
    target_BxL = lax.psum(jnp.where(mine_BxL, picked_BxL, 0.0), TENSOR)
    # Targets outside [0, V) belong to no rank: make them NaN rather than a silent 0 logit.
    valid_BxL = (targets_BxL >= 0) & (targets_BxL < cfg.vocab_size)
    nll_BxL = jnp.log(sumexp_BxL) + max_BxL - jnp.where(valid_BxL, target_BxL, jnp.nan)
    return nll_BxL.mean()


def _scoped(fn, forward="", backward=""):
    """fn, its collectives attributed to these messages (message_scope)."""
    def call(*args, **kwargs):
        with message_scope(forward, backward):
            return fn(*args, **kwargs)
    return call


def tp_hooks(exit_codec, enter_codec, block_exit, block_entry_grad):
    """(tp_enter, tp_exit, model coders) of one layer, sending its codecs of the
    messages block_exit and block_entry_grad. A learned autoencoder codes the
    message inside the block (jcomp.gpt.autoencoder): its collective moves the code
    as it is."""
    learned = lambda c: c.kind == "learned"
    enter = _scoped(functools.partial(cc.copy_to_parallel, axis_name=TENSOR,
                                      bwd_codec="none" if learned(enter_codec) else enter_codec,
                                      rows=block_entry_grad.rows),
                    backward=block_entry_grad.name)
    leave = _scoped(functools.partial(cc.psum, axis_name=TENSOR,
                                      codec="none" if learned(exit_codec) else exit_codec,
                                      rows=block_exit.rows),
                    forward=block_exit.name)
    coders = {}
    if learned(exit_codec):
        coders["exit"] = autoencoder.coder("out", exit_codec.dim, exit_codec.init)
    if learned(enter_codec):
        coders["enter"] = autoencoder.coder("in", enter_codec.dim, enter_codec.init)
    return enter, leave, coders
