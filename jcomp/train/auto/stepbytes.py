"""What the train step sends per message, from shapes alone: no device, no compile.

    per = by_message(run)            # {message name: (wire bytes, collectives, op, dtype)}
    msgs = by_entry(run)             # {(mesh axis, kind): jcomp.tune.Traffic}

`compression.auto` chooses codecs before the step it chooses them for is
compiled, and `python -m jcomp.train.plan` plans models that fit on no machine
at hand (configs/neox20b.py), so the bytes here are counted from the model's
shapes and the run's layout, not read from a compiled program. They follow the
step of jcomp.gpt (pipeline.py, tensor.py, zero.py) and count as
jcomp.meter.wire does: bytes per device per step, averaged over the mesh, an
all-reduce over n devices 2(n-1)/n of its buffer, a reduce-scatter or
all-gather (n-1)/n of the full buffer, a permute its buffer on the (P-1)/P of
devices that send. With b = batch / (data ranks x M) rows per microbatch, M
microbatches, P stages, T = M + P - 1 GPipe ticks (every stage runs each tick)
and L/P layers per stage, one activation is b x seq_len x d_model elements of
model.dtype, and per step:

  tensor.act       block_exit: T x L/P x 2 all-reduces (3 with train.remat: the
                   recomputed forward repeats one), embed_sum: 1 of M activations
  tensor.act_grad  block_entry_grad: T x L/P x 2, head_entry_grad: 1 of M activations
  pipeline.act     stage_send: T - 1 permutes, last_stage_sum: 1 all-reduce of M
  pipeline.act_grad  the same, backward
  data.grad/param  the float32 parameters a device holds, padded as ZeRO shards
                   them, reduce-scattered / gathered once, in buckets of
                   compression.bucket_mib per group of leaves sharded alike
  dcn.grad/param   the same on the slow hop, 1/|data| of the buffer

Against the compiled uncompressed step of configs/tiny.py's shapes on 8 CPU
devices the bytes agree within 2% per (axis, kind) (tests/train/test_auto.py).
What it leaves out: the exact scalars (loss, norms, cross-entropy's
reductions: no codec is meant for them), and XLA's merging of collectives,
which changes counts (latencies), never bytes.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jcomp import tune
from jcomp.gpt import autoencoder, sharding, zero
from jcomp.gpt import model as gpt

FLAT_ROW = tune.traffic.DEFAULT_ROW  # gradients and parameters travel in long flat buckets
_F32 = 4  # the optimizer sends float32 gradients and masters


def _local_elements(shape, spec, sizes) -> int:
    n = math.prod(shape)
    for entry in spec:
        axes = entry if isinstance(entry, tuple) else (() if entry is None else (entry,))
        n //= math.prod(sizes.get(a, 1) for a in axes)
    return n


def _param_shapes(run):
    return jax.eval_shape(lambda: gpt.init_params(run.model, jax.random.key(0),
                                                  coders=autoencoder.coders(run.policy)))


def param_groups(run) -> dict:
    """{mesh axes a leaf is split over: float32 bytes per device, padded as ZeRO
    shards them over the data axes}: the groups the optimizer buckets apart."""
    shapes = _param_shapes(run)
    specs = sharding.param_specs(shapes)
    sizes = run.plan_sizes()
    d = math.prod(sizes.get(a, 1) for a in ("dcn", "data"))
    groups: dict = {}
    for leaf, spec in zip(jax.tree.leaves(shapes), jax.tree.leaves(
            specs, is_leaf=lambda s: isinstance(s, jax.sharding.PartitionSpec))):
        axes = tuple(sorted({a for e in spec if e is not None
                             for a in (e if isinstance(e, tuple) else (e,))}))
        padded = zero.shard_len(_local_elements(leaf.shape, spec, sizes), d, 1) * d
        groups[axes] = groups.get(axes, 0) + padded * _F32
    return groups


def by_message(run) -> dict:
    """{message name: (wire bytes, collectives, op, dtype)} per device per step of
    the uncompressed step of `run` (a RunSpec): see the module doc. Messages over
    axes of size 1 are left out: they send nothing."""
    sizes, plan = run.plan_sizes(), run.plan(run.phases[-1][1])
    ranks = math.prod(n for a, n in run.mesh_sizes().items() if a in ("dcn", "data"))
    m, t, p = run.train.microbatches, sizes["tensor"], sizes["pipeline"]
    act_dtype = jnp.dtype(run.model.dtype)
    act = run.train.batch_size // (ranks * m) * run.data.seq_len * run.model.d_model \
        * act_dtype.itemsize
    ticks, per_stage = m + p - 1, run.model.n_layers // p
    reduce = lambda n: 2 * (n - 1) / n  # an all-reduce's share of its buffer
    sent = (p - 1) / p  # the devices of a stage that sends
    exit_per_tick = 2 + (1 if run.train.remat else 0)
    acts = {
        "block_exit": (ticks * per_stage * exit_per_tick * act * reduce(t),
                       ticks * per_stage * exit_per_tick, "all-reduce"),
        "block_entry_grad": (ticks * per_stage * 2 * act * reduce(t), ticks * per_stage * 2,
                             "all-reduce"),
        "embed_sum": (m * act * reduce(t), 1, "all-reduce"),
        "head_entry_grad": (m * act * reduce(t), 1, "all-reduce"),
        "stage_send": ((ticks - 1) * sent * act, (ticks - 1) * sent, "permute"),
        "stage_send_grad": ((ticks - 1) * sent * act, (ticks - 1) * sent, "permute"),
        "last_stage_sum": (m * act * reduce(p), 1, "all-reduce"),
        "first_stage_grad": (m * act * reduce(p), 1, "all-reduce"),
    }
    out = {name: (b, c, op, act_dtype.name) for name, (b, c, op) in acts.items()}
    groups = param_groups(run)
    buffer = sum(groups.values())
    buckets = sum(math.ceil(g / run.bucket_bytes) for g in groups.values() if g)
    d, k = sizes["data"], sizes.get("dcn", 1)
    for name, op, n, share in (("grad_reduce", plan.grad_reduce.op, d, 1.0),
                               ("param_gather", "all-gather", d, 1.0),
                               ("grad_reduce_dcn", "reduce-scatter", k, 1.0 / d),
                               ("param_gather_dcn", "all-gather", k, 1.0 / d)):
        out[name] = (buffer * share * (n - 1) / n, buckets, op, "float32")
    exist = {msg.name: msg for msg in plan.messages()}
    return {name: v for name, v in out.items() if name in exist}


def by_entry(run) -> dict:
    """{(mesh axis, kind): tune.Traffic} of the uncompressed step of `run`: its
    messages summed per policy entry, each entry's collective the op carrying
    most bytes (as tune.messages_from does), rows of d_model for activations and
    long flat buckets for gradients and parameters."""
    plan = run.plan(run.phases[-1][1])
    entry = {msg.name: msg.entry for msg in plan.messages()}
    sums: dict = {}
    for name, (nbytes, count, op, dtype) in by_message(run).items():
        axis, _, kind = entry[name].partition(".")
        s = sums.setdefault((axis, kind), {"bytes": 0.0, "n": 0.0, "heavy": (-1.0, op, dtype)})
        s["bytes"] += nbytes
        s["n"] += count
        if nbytes > s["heavy"][0]:
            s["heavy"] = (nbytes, op, dtype)
    sizes = run.plan_sizes()
    out = {}
    for (axis, kind), s in sums.items():
        _, op, dtype = s["heavy"]
        row = run.model.d_model if kind in ("act", "act_grad") else FLAT_ROW
        out[axis, kind] = tune.Traffic(raw_bytes=float(s["bytes"]), collectives=float(s["n"]),
                                       dtype=dtype, op=op, row=int(row),
                                       n=max(int(sizes.get(axis, 2)), 2))
    return out


def outer_sync(run) -> tune.Traffic:
    """An outer loop's sync across islands as a per-step message of the slow hop
    ('dcn'), from shapes: each device's ZeRO shard of the float32 masters (the
    parameters a device holds, padded, over its island's data ranks) all-reduced
    over the islands once every outer.every steps, one collective per leaf. The
    bytes are the uncompressed sync's (outer.codec "none"); a codec's follow from
    tune.Traffic as for any flat message. The compiled sync's agree within 2%
    (tests/train/test_auto.py)."""
    if run.outer is None:
        raise ValueError("outer_sync needs a run with an outer loop (outer.every > 0)")
    k, h = run.islands, run.outer.every
    d = run.plan_sizes()["data"]
    shard = sum(param_groups(run).values()) / d
    leaves = len(jax.tree.leaves(_param_shapes(run)))
    return tune.Traffic(raw_bytes=2 * (k - 1) / k * shard / h, collectives=leaves / h,
                        dtype="float32", op="all-reduce", row=FLAT_ROW, n=max(k, 2))
