"""Pipeline parallelism inside the step's shard_map: GPipe over the 'pipeline'
axis, each stage's layers with their own tensor-parallel codecs, and the
stage-to-stage sends. See jcomp.gpt.parallel for the whole layout."""
from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
from jax import lax

from jcomp import collectives as cc
from jcomp.meter.scope import message_scope
from jcomp.gpt import model as gpt
from jcomp.gpt.sharding import PIPE
from jcomp.gpt.tensor import tp_hooks


def _one_of(stage, stages):
    """stage in `stages`, as comparisons of the stage index (no lookup table), so
    that the byte meter can tell which devices take which branch."""
    return functools.reduce(jnp.logical_or, [stage == s for s in stages])


def _segments(per_layer):
    """Runs of consecutive local layers whose per-stage variants are equal ->
    [(first local layer, end, per-stage variants)]."""
    segments, start = [], 0
    for per_stage, run in itertools.groupby(per_layer):
        end = start + len(list(run))
        segments.append((start, end, per_stage))
        start = end
    return segments


def _branch_index(stage, per_stage, variants):
    """The index in `variants` of this stage's variant (per_stage[stage]), from
    comparisons of the stage index so that the byte meter can evaluate it."""
    index = 0
    for i, variant in enumerate(variants):
        if i:
            stages = [s for s, v in enumerate(per_stage) if v == variant]
            index = index + jnp.where(_one_of(stage, stages), i, 0)
    return index


def _stage_runner(layers, cfg, block_exit, block_entry_grad, remat):
    """fn(x) running this stage's layers, each layer's tensor-parallel all-reduces
    with its own codecs (messages.Message block_exit, block_entry_grad).

    Stage s holds global layers s*Lp .. s*Lp+Lp-1. A layer's variant is its
    (block_exit, block_entry_grad) codecs. Runs of local layers whose variants
    are the same on every stage run as one scan. Where stages differ, a
    `lax.switch` on the stage index picks the variant: each device runs (and
    sends) only its own, and every tensor group lies within one stage.
    """
    n_stages, stage = lax.axis_size(PIPE), lax.axis_index(PIPE)
    n_local = jax.tree.leaves(layers)[0].shape[0]

    def variant(s, j):
        layer = s * n_local + j
        return block_exit.at(layer), block_entry_grad.at(layer)

    per_layer = [tuple(variant(s, j) for s in range(n_stages)) for j in range(n_local)]

    def run(codecs, seg_layers, x):
        enter, leave, coders = tp_hooks(*codecs, block_exit, block_entry_grad)
        return gpt.apply_layers(seg_layers, x, cfg=cfg, tp_enter=enter, tp_exit=leave,
                                remat=remat, coders=coders)

    def run_stage(x):
        for j0, j1, per_stage in _segments(per_layer):
            seg = layers if (j0, j1) == (0, n_local) else jax.tree.map(lambda a: a[j0:j1], layers)
            variants = list(dict.fromkeys(per_stage))
            if len(variants) == 1:
                x = run(variants[0], seg, x)
            else:
                x = lax.switch(_branch_index(stage, per_stage, variants),
                               [functools.partial(run, v) for v in variants], seg, x)
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


def predicted_bubble(n_stages: int, microbatches: int) -> float:
    """GPipe's idle fraction (P - 1) / (M + P - 1)."""
    return (n_stages - 1) / (microbatches + n_stages - 1)
