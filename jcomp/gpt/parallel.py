"""The GPT laid out over the ('data', 'tensor', 'pipeline') mesh.

Everything below runs inside one `jax.shard_map` over all three axes, and
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
            all-reduces uncompressed (`_stage_runner`).
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
  data      The batch is split. Parameters enter the loss cast to 'varying'
            over data, so JAX adds no implicit float32 gradient psum; the
            gradient reduction over data is done explicitly, compressed with
            policy[data, grad], by the ZeRO optimizer.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jcomp.gpt import autoencoder
from jcomp import collectives as cc
from jcomp.gpt import model as gpt
from jcomp.collectives.scope import message_scope

DATA, TENSOR, PIPE = "data", "tensor", "pipeline"
BATCH_SPEC = P(DATA)  # tokens [B, L+1]: rows split over data, replicated elsewhere


# Logical axis (jcomp.gpt.model.PARAM_AXES) -> the mesh axis it is split over; the
# others are replicated. Stacked layers lead with "layers".
AXIS_RULES = {"layers": PIPE, **{a: TENSOR for a in gpt.TENSOR_SPLIT}}
_PARAM_AXES = {**gpt.PARAM_AXES, **autoencoder.PARAM_AXES}


# ------------------------------------------------------------ layout checks

def check_layout(cfg: gpt.ModelConfig, mesh_shape: dict, global_batch: int, microbatches: int):
    """Raises ValueError naming the field when the model or batch does not divide."""
    d, t, p = mesh_shape[DATA], mesh_shape[TENSOR], mesh_shape[PIPE]
    rules = [
        ("model.n_heads", cfg.n_heads, "mesh.tensor", t),
        ("model.d_ff", cfg.d_ff, "mesh.tensor", t),
        ("model.vocab_size", cfg.vocab_size, "mesh.tensor", t),
        ("model.n_layers", cfg.n_layers, "mesh.pipeline", p),
    ]
    for field, value, axis, size in rules:
        if value % size:
            raise ValueError(f"{field}={value} is not divisible by {axis}={size}")
    if microbatches < 1:
        raise ValueError(f"microbatches={microbatches} must be >= 1")
    if global_batch % (d * microbatches):
        raise ValueError(f"batch_size={global_batch} is not divisible by mesh.data x "
                         f"microbatches = {d} x {microbatches} = {d * microbatches}")


# --------------------------------------------------------- partition specs

def spec_of(logical_axes) -> P:
    """("layers", "embed", "mlp") -> P("pipeline", None, "tensor")."""
    return P(*(AXIS_RULES.get(a) for a in logical_axes))


def _layer_spec(path, leaf) -> P:
    """Stacked layer leaf [N, ...]: layers over pipeline, the Megatron dim over tensor."""
    key = tuple(getattr(k, "key", getattr(k, "name", k)) for k in path)
    axes = ("layers",) + _PARAM_AXES[key]
    if len(axes) != leaf.ndim:
        raise ValueError(f"layer parameter {'/'.join(map(str, key))} has shape {leaf.shape}; "
                         f"its logical axes are {axes}")
    return spec_of(axes)


def param_specs(params) -> dict:
    """PartitionSpecs of the global parameter tree (see the module docstring)."""
    specs = {
        "embed": spec_of(gpt.EMBED_AXES),
        "layers": jax.tree_util.tree_map_with_path(_layer_spec, params["layers"]),
        "final_ln": jax.tree.map(lambda _: P(), params["final_ln"]),
    }
    if "head" in params:
        specs["head"] = spec_of(gpt.EMBED_AXES)
    return specs


def shard_params(params, mesh):
    """Places a global parameter tree on the mesh."""
    specs = param_specs(params)
    return jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), params, specs)


# ------------------------------------------------------ pieces of the model

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


def _tp_hooks(exit_codec, enter_codec, block_exit, block_entry_grad):
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


def _one_of(stage, stages):
    """stage in `stages`, as comparisons of the stage index (no lookup table), so
    that the byte meter can tell which devices take which branch."""
    return functools.reduce(jnp.logical_or, [stage == s for s in stages])


def _stage_runner(layers, cfg, block_exit, block_entry_grad, remat):
    """fn(x) running this stage's layers, each layer's tensor-parallel all-reduces
    with its own codecs (messages.Message block_exit, block_entry_grad).

    Stage s holds global layers s*Lp .. s*Lp+Lp-1. Runs of local layers whose
    codecs are the same on every stage run as one scan. Where stages differ, a
    `lax.cond` on the stage index picks the variant: each device runs (and
    sends) only its own, and every tensor group lies within one stage.
    """
    n_stages, stage = lax.axis_size(PIPE), lax.axis_index(PIPE)
    n_local = jax.tree.leaves(layers)[0].shape[0]
    at = lambda s, j: (block_exit.at(s * n_local + j), block_entry_grad.at(s * n_local + j))
    choice = [tuple(at(s, j) for s in range(n_stages)) for j in range(n_local)]

    def run(variant, seg_layers, x):
        enter, leave, coders = _tp_hooks(*variant, block_exit, block_entry_grad)
        return gpt.apply_layers(seg_layers, x, cfg=cfg, tp_enter=enter, tp_exit=leave,
                                remat=remat, coders=coders)

    segments = []  # [(first local layer, end, per-stage variants)]
    for j, c in enumerate(choice):
        if segments and segments[-1][2] == c:
            segments[-1][1] = j + 1
        else:
            segments.append([j, j + 1, c])

    def run_stage(x):
        for j0, j1, per_stage in segments:
            seg = layers if (j0, j1) == (0, n_local) else jax.tree.map(lambda a: a[j0:j1], layers)
            variants = list(dict.fromkeys(per_stage))
            if len(variants) == 1:
                x = run(variants[0], seg, x)
                continue
            branches = [functools.partial(run, v) for v in variants]
            pick = sum(jnp.where(_one_of(stage, [s for s, v in enumerate(per_stage) if v == w]),
                                 i, 0) for i, w in enumerate(variants) if i)
            x = lax.switch(pick, branches, seg, x)
        return x

    return run_stage


def _send(state_bxLxD, stage_send, stage_send_grad, n_stages, stage):
    """Stage s -> s+1 forward (stage_send.at(s)), backward s+1 -> s
    (stage_send_grad.at(s+1)). Pairs with different codecs travel in separate
    ppermutes; each device keeps the one it receives."""
    by_codecs = {}
    for s in range(n_stages - 1):
        fwd_bwd = (stage_send.at(s), stage_send_grad.at(s + 1))
        by_codecs.setdefault(fwd_bwd, []).append((s, s + 1))
    if not by_codecs:  # one stage: nothing moves (zeros, as lax.ppermute gives)
        return lax.ppermute(state_bxLxD, PIPE, [])
    out = None
    for (fwd, bwd), pairs in by_codecs.items():
        with message_scope(stage_send.name, stage_send_grad.name):
            moved = cc.ppermute(state_bxLxD, PIPE, pairs, codec=fwd, bwd_codec=bwd,
                                rows=stage_send.rows)
        out = moved if out is None else jnp.where(_one_of(stage, [d for _, d in pairs]),
                                                  moved, out)
    return out


def pipeline_forward(layers, x0_MxbxLxD, cfg, plan, remat):
    """GPipe over the pipeline axis. x0 holds the M microbatches (used on stage 0).

    -> outputs_MxbxLxD of the last stage, all-reduced over pipeline so that
    every stage holds them (invariant over pipeline): plan.last_stage_sum
    forward; x0's gradient comes back with plan.first_stage_grad.
    """
    n_stages = lax.axis_size(PIPE)
    stage = lax.axis_index(PIPE)
    n_micro = x0_MxbxLxD.shape[0]
    run_stage = _stage_runner(layers, cfg, plan.block_exit, plan.block_entry_grad, remat)
    with message_scope(backward=plan.first_stage_grad.name):
        x0_MxbxLxD = cc.copy_to_parallel(x0_MxbxLxD, PIPE, bwd_codec=plan.first_stage_grad.codec,
                                         rows=plan.first_stage_grad.rows)

    def tick(t, state_bxLxD, out_MxbxLxD):
        feed = lax.dynamic_index_in_dim(x0_MxbxLxD, jnp.minimum(t, n_micro - 1), 0, False)
        state_bxLxD = run_stage(jnp.where(stage == 0, feed, state_bxLxD))
        done = t - (n_stages - 1)  # microbatch leaving the last stage at tick t
        slot = jnp.clip(done, 0, n_micro - 1)
        keep = (stage == n_stages - 1) & (done >= 0)
        old = lax.dynamic_index_in_dim(out_MxbxLxD, slot, 0, False)
        out_MxbxLxD = lax.dynamic_update_index_in_dim(
            out_MxbxLxD, jnp.where(keep, state_bxLxD, old), slot, 0)
        return state_bxLxD, out_MxbxLxD

    def body(carry, t):
        state, out = carry
        return tick(t, _send(state, plan.stage_send, plan.stage_send_grad, n_stages, stage),
                    out), None

    out = jnp.zeros_like(x0_MxbxLxD)
    state, out = tick(0, jnp.zeros_like(x0_MxbxLxD[0]), out)
    n_ticks = n_micro + n_stages - 1
    (state, out), _ = lax.scan(body, (state, out), jnp.arange(1, n_ticks))
    last = jnp.where(stage == n_stages - 1, out, jnp.zeros_like(out))
    with message_scope(plan.last_stage_sum.name):
        return cc.psum(last, PIPE, codec=plan.last_stage_sum.codec,
                       rows=plan.last_stage_sum.rows)


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
    """-> (this rank's loss, this rank's gradients). Gradients vary over 'data':
    no reduction over data has happened yet."""
    params_v = jax.tree.map(lambda x: cc.vary(x, (DATA,)), params)
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


def predicted_bubble(n_stages: int, microbatches: int) -> float:
    """GPipe's idle fraction (P - 1) / (M + P - 1)."""
    return (n_stages - 1) / (microbatches + n_stages - 1)
