"""The GPT laid out over the ('data', 'tensor', 'pipeline') mesh.

Everything below runs inside one `jax.shard_map` over all three axes, and
every collective that carries model data goes through `jcomp.collectives`
with the codec the policy names for its axis and kind of message.

Layout:
  tensor    Megatron: attention heads and MLP hidden units are split; the
            residual stream is replicated. `cc.copy_to_parallel` enters each
            column-parallel matmul (backward all-reduce: policy[tensor,
            act_grad]); `cc.psum` leaves each row-parallel matmul (forward
            all-reduce: policy[tensor, act]). The embedding and the output
            head are split over the vocabulary (vocab-parallel lookup and
            cross-entropy); the cross-entropy exchanges only per-token max,
            sum-exp and target logit, 1/d_model of the activations, exactly.
            With `ae:dim=A` (jcomp.autoencoder) the blocks code those
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
            policy[data, grad] (`reduce_grads` here, or the ZeRO optimizer).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jcomp import autoencoder
from jcomp import collectives as cc
from jcomp import model as gpt

DATA, TENSOR, PIPE = "data", "tensor", "pipeline"
BATCH_SPEC = P(DATA)  # tokens [B, L+1]: rows split over data, replicated elsewhere


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

def _layer_spec(path, leaf) -> P:
    """Stacked layer leaf [N, ...]: layers over pipeline, the Megatron dim over tensor."""
    key = tuple(getattr(k, "key", getattr(k, "name", k)) for k in path)
    dim = gpt.TENSOR_SHARDED_DIMS[key]
    spec = [PIPE] + [None] * (leaf.ndim - 1)
    if dim is not None:
        spec[dim + 1] = TENSOR
    return P(*spec)


def param_specs(params) -> dict:
    """PartitionSpecs of the global parameter tree (see the module docstring)."""
    specs = {
        "embed": P(TENSOR, None),
        "layers": jax.tree_util.tree_map_with_path(_layer_spec, params["layers"]),
        "final_ln": jax.tree.map(lambda _: P(), params["final_ln"]),
    }
    if "head" in params:
        specs["head"] = P(TENSOR, None)
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


def embed_lookup(embed_VtxD, tokens_BxL, dtype, pol):
    """Vocab-parallel lookup: each tensor rank fills its rows, a sum completes them."""
    start, v_local = _vocab_range(embed_VtxD)
    local_BxL = tokens_BxL - start
    mine_BxL = (local_BxL >= 0) & (local_BxL < v_local)
    rows_BxLxD = gpt.embed(embed_VtxD, jnp.where(mine_BxL, local_BxL, 0), jnp.float32)
    part_BxLxD = jnp.where(mine_BxL[..., None], rows_BxLxD, 0.0).astype(dtype)
    return cc.psum(part_BxLxD, TENSOR, codec=autoencoder.rest_codec(pol[TENSOR, "act"]))


def vocab_parallel_loss(params, h_BxLxD, targets_BxL, cfg, pol):
    """Final LayerNorm, vocab-parallel logits and exact cross-entropy. -> mean loss (f32)."""
    final_ln = gpt._final_ln(cfg)
    h_BxLxD = final_ln.apply({"params": params["final_ln"]}, h_BxLxD.astype(jnp.float32))
    h_BxLxD = cc.copy_to_parallel(h_BxLxD.astype(cfg.compute_dtype), TENSOR,
                                  bwd_codec=autoencoder.rest_codec(pol[TENSOR, "act_grad"]))
    w_VtxD = params["embed"] if cfg.tie_embeddings else params["head"]
    logits_BxLxVt = jnp.einsum("bld,vd->blv", h_BxLxD, w_VtxD.astype(cfg.compute_dtype),
                               preferred_element_type=jnp.float32)
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


def _tp_hooks(pol, act_on=True, grad_on=True):
    # With a learned autoencoder the Block codes the message itself (jcomp.autoencoder)
    # and the collective moves the code as it is.
    plain = lambda c: "none" if getattr(c, "kind", None) == "learned" else c
    enter = functools.partial(cc.copy_to_parallel, axis_name=TENSOR,
                              bwd_codec=plain(pol[TENSOR, "act_grad"]) if grad_on else "none")
    leave = functools.partial(cc.psum, axis_name=TENSOR,
                              codec=plain(pol[TENSOR, "act"]) if act_on else "none")
    return enter, leave


def _one_of(stage, stages):
    """stage in `stages`, as comparisons of the stage index (no lookup table), so
    that the byte meter can tell which devices take which branch."""
    return functools.reduce(jnp.logical_or, [stage == s for s in stages])


def _stage_runner(layers, cfg, pol, remat):
    """fn(x) running this stage's layers, with tensor-parallel compression only in
    the layers that policy.where(tensor, act | act_grad) selects.

    Stage s holds global layers s*Lp .. s*Lp+Lp-1. Runs of local layers whose
    choice is the same on every stage run as one scan. Where stages differ, a
    `lax.cond` on the stage index picks the variant: each device runs (and
    sends) only its own, and every tensor group lies within one stage.
    """
    n_stages, stage = lax.axis_size(PIPE), lax.axis_index(PIPE)
    n_local = jax.tree.leaves(layers)[0].shape[0]
    on = lambda kind, s, j: pol.compresses(TENSOR, kind, layer=s * n_local + j)
    choice = [tuple((on("act", s, j), on("act_grad", s, j)) for s in range(n_stages))
              for j in range(n_local)]
    ae = autoencoder.parts(pol)

    def run(variant, seg_layers, x):
        act_on, grad_on = variant
        enter, leave = _tp_hooks(pol, act_on, grad_on)
        use_ae = tuple(p for p, on_ in (("out", act_on), ("in", grad_on)) if p in ae and on_)
        return gpt.apply_layers(seg_layers, x, cfg=cfg, tp_enter=enter, tp_exit=leave,
                                remat=remat, use_ae=use_ae)

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


def _send(state_bxLxD, pol, n_stages, stage):
    """Stage s -> s+1 forward (policy[pipeline, act] where stage s compresses),
    backward s+1 -> s (policy[pipeline, act_grad] where stage s+1 does). Pairs
    with different codecs travel in separate ppermutes; each device keeps the one
    it receives."""
    by_codecs = {}
    for s in range(n_stages - 1):
        fwd_bwd = (pol.codec_at(PIPE, "act", stage=s), pol.codec_at(PIPE, "act_grad", stage=s + 1))
        by_codecs.setdefault(fwd_bwd, []).append((s, s + 1))
    if not by_codecs:  # one stage: nothing moves (zeros, as lax.ppermute gives)
        return lax.ppermute(state_bxLxD, PIPE, [])
    out = None
    for (fwd, bwd), pairs in by_codecs.items():
        moved = cc.ppermute(state_bxLxD, PIPE, pairs, codec=fwd, bwd_codec=bwd)
        out = moved if out is None else jnp.where(_one_of(stage, [d for _, d in pairs]),
                                                  moved, out)
    return out


def pipeline_forward(layers, x0_MxbxLxD, cfg, pol, remat):
    """GPipe over the pipeline axis. x0 holds the M microbatches (used on stage 0).

    -> outputs_MxbxLxD of the last stage, all-reduced over pipeline so that
    every stage holds them (invariant over pipeline). The all-reduce carries the
    last stage's output and the backward all-reduce of x0's gradient stage 0's
    input gradient: they compress where those stages do.
    """
    n_stages = lax.axis_size(PIPE)
    stage = lax.axis_index(PIPE)
    n_micro = x0_MxbxLxD.shape[0]
    pol.check_places(jax.tree.leaves(layers)[0].shape[0] * n_stages, n_stages)
    run_stage = _stage_runner(layers, cfg, pol, remat)
    x0_MxbxLxD = cc.copy_to_parallel(x0_MxbxLxD, PIPE,
                                     bwd_codec=pol.codec_at(PIPE, "act_grad", stage=0))

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
        return tick(t, _send(state, pol, n_stages, stage), out), None

    out = jnp.zeros_like(x0_MxbxLxD)
    state, out = tick(0, jnp.zeros_like(x0_MxbxLxD[0]), out)
    n_ticks = n_micro + n_stages - 1
    (state, out), _ = lax.scan(body, (state, out), jnp.arange(1, n_ticks))
    last = jnp.where(stage == n_stages - 1, out, jnp.zeros_like(out))
    return cc.psum(last, PIPE, codec=pol.codec_at(PIPE, "act", stage=n_stages - 1))


def local_loss(params, batch_bxL1, cfg, pol, microbatches: int, remat: bool = False):
    """Mean next-token loss of this data rank's rows. Runs inside the shard_map."""
    tokens_bxL, targets_bxL = batch_bxL1[:, :-1], batch_bxL1[:, 1:]
    b, L = tokens_bxL.shape
    if L > cfg.max_seq_len:
        raise ValueError(f"sequence length {L} exceeds model.max_seq_len={cfg.max_seq_len}")
    x0_bxLxD = embed_lookup(params["embed"], tokens_bxL, cfg.compute_dtype, pol)
    x0_MxbxLxD = x0_bxLxD.reshape(microbatches, b // microbatches, L, cfg.d_model)
    h_MxbxLxD = pipeline_forward(params["layers"], x0_MxbxLxD, cfg, pol, remat)
    return vocab_parallel_loss(params, h_MxbxLxD.reshape(b, L, cfg.d_model), targets_bxL, cfg, pol)


def local_value_and_grad(params, batch_bxL1, cfg, pol, microbatches, remat=False):
    """-> (this rank's loss, this rank's gradients). Gradients vary over 'data':
    no reduction over data has happened yet."""
    params_v = jax.tree.map(lambda x: cc.vary(x, (DATA,)), params)
    # Autoencoder weights that multiply rank-varying values are marked varying over
    # tensor here, so their gradients come out per rank and are summed once per step
    # below (policy[tensor, grad]) instead of by an implicit float32 psum per use.
    in_use = [f"_ae_{part}_" for part in autoencoder.parts(pol)]
    ae_names = [n for n in autoencoder.VARYING_OVER_TENSOR
                if n in params["layers"] and any(u in n for u in in_use)]
    layers = dict(params_v["layers"])
    for n in ae_names:
        layers[n] = cc.vary(layers[n], (TENSOR,))
    params_v = {**params_v, "layers": layers}
    loss, grads = jax.value_and_grad(local_loss)(params_v, batch_bxL1, cfg, pol, microbatches,
                                                 remat)
    if ae_names:
        summed = cc.psum([grads["layers"][n] for n in ae_names], TENSOR, codec=pol[TENSOR, "grad"])
        grads = {**grads, "layers": {**grads["layers"], **dict(zip(ae_names, summed))}}
    return loss, grads


def reduce_grads(grads, pol, key=None):
    """Mean of the gradients over data with policy[data, grad] (no error feedback)."""
    n = lax.axis_size(DATA)
    summed = cc.psum(grads, DATA, codec=pol[DATA, "grad"], key=key)
    return jax.tree.map(lambda g: g / n, summed)


def predicted_bubble(n_stages: int, microbatches: int) -> float:
    """GPipe's idle fraction (P - 1) / (M + P - 1)."""
    return (n_stages - 1) / (microbatches + n_stages - 1)


def make_loss_and_grad(cfg, mesh, pol, microbatches: int, remat: bool = False):
    """A jitted fn(params, batch) -> (mean loss, data-mean gradients) over the mesh.

    `params` carry `param_specs` shardings; `batch` is [B, L+1] int32 split over
    data. The returned gradients have the parameters' shardings.
    """

    def step(params, batch):
        specs = param_specs(params)

        def body(params, batch):
            loss, grads = local_value_and_grad(params, batch, cfg, pol, microbatches, remat)
            return lax.pmean(loss, DATA), reduce_grads(grads, pol)

        fn = jax.shard_map(body, mesh=mesh, in_specs=(specs, BATCH_SPEC),
                           out_specs=(P(), specs), check_vma=True)
        return fn(params, batch)

    return jax.jit(step)
