"""The GPT laid out over the ('data', 'tensor', 'pipeline') mesh: the loss and
local gradients of one data rank, composed from jcomp.gpt.sharding (where the
arrays live), jcomp.gpt.tensor (Megatron blocks, vocab-parallel embedding and
cross-entropy) and jcomp.gpt.pipeline (GPipe and the stage sends).

Everything here runs inside one `jax.shard_map` over all three axes, and
every collective that carries model data goes through `jcomp.collectives`
with the codec of its message in the plan (`jcomp.gpt.messages`); each function
receives only the messages it sends.

Layout:
  tensor    Megatron: attention heads and MLP hidden units are split; the
            residual stream is replicated. `cc.copy_to_parallel` enters each
            column-parallel matmul (backward all-reduce: policy[tensor,
            act_grad]); `cc.psum` leaves each row-parallel matmul (forward
            all-reduce: policy[tensor, act]). The embedding and the output
            head are split over the vocabulary (vocab-parallel lookup and
            cross-entropy); the cross-entropy exchanges only per-token max,
            sum-exp and target logit, 1/d_model of the activations, exactly.
            With `ae:dim=A` (jcomp.gpt.autoencoder) the blocks code those
            all-reduces themselves; the autoencoder weights whose gradients
            differ per tensor rank are summed once per step over tensor with
            policy[tensor, grad]. `Policy.restrict` may leave some layers'
            all-reduces uncompressed (`pipeline._stage_runner`).
  pipeline  Layers are split into contiguous stages. A GPipe schedule runs
            M microbatches through the stages in M + P - 1 ticks; activations
            move stage to stage with `cc.ppermute` (policy[pipeline, act]
            forward, policy[pipeline, act_grad] backward), or raw where the
            sending stage is not among those `Policy.restrict` selects.
            Embedding and head are replicated over pipeline: every stage looks
            up the embedding (only stage 0 feeds it in; its gradient comes
            back with a compressed all-reduce of activation gradients), and the
            last stage's output is all-reduced over pipeline (policy[pipeline,
            act]) so every stage computes the same loss. This moves
            activations instead of all-reducing [V, D] embedding gradients
            between the first and last stage, and keeps all parameters'
            gradients free of implicit full-precision reductions. The price is
            the head's matmul computed on every stage.
  data      The batch is split (over ('dcn', 'data') on a mesh with two hops,
            `plan.data_axes`). Parameters enter the loss cast to 'varying'
            over data, so JAX adds no implicit float32 gradient psum; the
            gradient reduction over data is done explicitly, compressed with
            policy[data, grad], by the ZeRO optimizer.
"""
from __future__ import annotations

import jax

from jcomp import collectives as cc
from jcomp.meter.scope import message_scope
from jcomp.gpt import autoencoder
from jcomp.gpt.pipeline import pipeline_forward
from jcomp.gpt.sharding import TENSOR
from jcomp.gpt.tensor import embed_lookup, vocab_parallel_logits, vocab_parallel_loss


def _last_hidden(params, tokens_bxL, cfg, plan, microbatches: int, remat: bool):
    """Embedding, the pipelined layers -> the last stage's hidden states [b, L, D],
    on every stage."""
    b, L = tokens_bxL.shape
    if L > cfg.max_seq_len:
        raise ValueError(f"sequence length {L} exceeds model.max_seq_len={cfg.max_seq_len}")
    x0_bxLxD = embed_lookup(params["embed"], tokens_bxL, cfg.compute_dtype, plan.embed_sum)
    x0_MxbxLxD = x0_bxLxD.reshape(microbatches, b // microbatches, L, cfg.d_model)
    h_MxbxLxD = pipeline_forward(params["layers"], x0_MxbxLxD, cfg, plan, remat)
    return h_MxbxLxD.reshape(b, L, cfg.d_model)


def local_logits(params, tokens_bxL, cfg, plan, microbatches: int):
    """This data rank's logits, this tensor rank's vocabulary shard: float32
    [b, L, V/T], sending what `plan` says (the forward a causality check reads)."""
    h_bxLxD = _last_hidden(params, tokens_bxL, cfg, plan, microbatches, False)
    return vocab_parallel_logits(params, h_bxLxD, cfg, plan.head_entry_grad)


def local_loss(params, batch_bxL1, cfg, plan, microbatches: int, remat: bool = False):
    """Mean next-token loss of this data rank's rows, sending what `plan` (a
    messages.Plan) says. Runs inside the shard_map."""
    tokens_bxL, targets_bxL = batch_bxL1[:, :-1], batch_bxL1[:, 1:]
    h_bxLxD = _last_hidden(params, tokens_bxL, cfg, plan, microbatches, remat)
    return vocab_parallel_loss(params, h_bxLxD, targets_bxL, cfg, plan.head_entry_grad)


def local_value_and_grad(params, batch_bxL1, cfg, plan, microbatches, remat=False):
    """-> (this rank's loss, this rank's gradients). Gradients vary over the data
    axes (`plan.data_axes`): no reduction over data has happened yet."""
    params_v = jax.tree.map(lambda x: cc.vary(x, tuple(plan.data_axes)), params)
    # Autoencoder weights that multiply rank-varying values are marked varying over
    # tensor here, so their gradients come out per rank and are summed once per step
    # below (plan.ae_grad_sum) instead of by an implicit float32 psum per use.
    in_use = [part for part, msg in (("out", plan.block_exit), ("in", plan.block_entry_grad))
              if any(c.kind == "learned" for c in msg.codecs)]
    ae_names = [n for n in autoencoder.varying_over_tensor(in_use) if n in params["layers"]]
    layers = dict(params_v["layers"])
    for n in ae_names:
        layers[n] = cc.vary(layers[n], (TENSOR,))
    params_v = {**params_v, "layers": layers}
    loss, grads = jax.value_and_grad(local_loss)(params_v, batch_bxL1, cfg, plan, microbatches,
                                                 remat)
    if ae_names:
        with message_scope(plan.ae_grad_sum.name):
            summed = cc.psum([grads["layers"][n] for n in ae_names], TENSOR,
                             codec=plan.ae_grad_sum.codec, rows=plan.ae_grad_sum.rows)
        grads = {**grads, "layers": {**grads["layers"], **dict(zip(ae_names, summed))}}
    return loss, grads
