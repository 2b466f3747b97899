"""The jitted train and eval steps: one shard_map over the whole mesh.

    train_step(state, batch) -> (state, metrics)
    state = {"params": working params (param_specs), "zero": ZeRO state
             (zero.state_specs), "skipped": int32 count of dropped updates}

Inside the step: loss and local gradients (`parallel.local_value_and_grad`),
then the ZeRO update (`zero.apply_updates`), which reduces gradients over
the data axes and gathers parameters with the plan's grad_reduce and
param_gather (hop by hop on a mesh with a 'dcn' axis: `Plan.data_hops`).
A non-finite loss or gradient norm drops the whole update (state unchanged,
`skipped` + 1); the loop decides whether to go on or stop.

Islands (`islands="dcn"`, the outer loop of jcomp.train.outer.islands): every state
leaf carries a leading island dimension I split over that mesh axis
(`island_specs`), squeezed inside the body, and the step runs as the step of
one island whose data axes are the others (`plan.data_axes`, ('data',)):
gradients are reduced and parameters gathered inside an island only, nothing
crosses the island axis, and the metrics come out per island ([I], split over
it).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jcomp import collectives as cc
from jcomp.gpt import parallel, sharding, zero

def state_specs(param_specs, tx, layout: zero.Layout):
    return {"params": param_specs, "zero": zero.state_specs(param_specs, tx, layout),
            "skipped": P()}


def island_specs(specs, axis):
    """`specs` (a tree of one island's PartitionSpecs) with the island axis leading."""
    return jax.tree.map(lambda s: P(axis, *s), specs, is_leaf=lambda x: isinstance(x, P))


def init_state(params, mesh, tx, layout: zero.Layout):
    """Train state from global float32 params (placed on the mesh here)."""
    specs = sharding.param_specs(params)
    placed = sharding.shard_params(params, mesh)
    return {"params": placed, "zero": zero.init_state(placed, specs, mesh, tx, layout),
            "skipped": jax.device_put(jnp.zeros((), jnp.int32), NamedSharding(mesh, P()))}


def abstract_state(params_shapes, mesh, tx, layout: zero.Layout):
    """ShapeDtypeStructs with shardings of the train state (checkpoint restore target)."""
    specs = sharding.param_specs(params_shapes)
    sds = lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, s))
    return {"params": jax.tree.map(sds, params_shapes, specs),
            "zero": zero.abstract_state(params_shapes, specs, mesh, tx, layout),
            "skipped": sds(jax.ShapeDtypeStruct((), jnp.int32), P())}


def _metric_specs(layout: zero.Layout):
    names = ["loss", "grad_norm", "finite"] + (["ef_norm"] if layout.error_feedback else [])
    return {n: P() for n in names}


def _draws_randomness(plan) -> bool:
    """Whether the optimizer's messages (gradient reduction, parameter gather) need a key."""
    return any(m.codec.needs_key for _, g, p in plan.data_hops() for m in (g, p))


def _data_axes(mesh, plan, islands=None) -> tuple:
    """The mesh's data axes inside an island (all of them without islands), which
    the plan must have been made for."""
    axes = tuple(a for a in sharding.data_axes(mesh) if a != islands)
    if tuple(plan.data_axes) != axes:
        raise ValueError(f"the plan was made for data axes {plan.data_axes}, the mesh has "
                         f"{axes}; make it with the mesh's sizes (messages.plan)")
    return axes


def make_train_step(model_cfg, mesh, plan, tx, params_shapes, *, layout: zero.Layout,
                    microbatches, clip_norm, remat=False, seed=0,
                    bucket_bytes=cc.DEFAULT_BUCKET_BYTES, islands=None):
    """A jitted fn(state, batch [B, L+1] int32) -> (state, metrics).

    `layout` (zero.for_plan of the plan the state is laid out for) lays out the
    state; `plan` (jcomp.gpt.messages.plan, that plan or one of a phase of a
    compression schedule) says what every collective sends. Codecs that draw random numbers (stochastic rounding, rand-k) in the
    gradient reduction or the parameter gather get the key fold_in(key(seed),
    optimizer step), folded with each device's index by the collectives: a pure
    function of the state, so a resumed run draws what the uninterrupted one
    would. `bucket_bytes` bounds the flat buffers those two send. `islands`: a
    mesh axis whose every index is an island of its own (see the module doc).
    """
    specs = sharding.param_specs(params_shapes)
    sspecs = state_specs(specs, tx, layout)
    keyed = _draws_randomness(plan)
    data_axes = _data_axes(mesh, plan, islands)
    batch_spec = sharding.batch_spec(sharding.data_axes(mesh))

    def body(state, batch):
        params = state["params"]
        loss, grads = parallel.local_value_and_grad(params, batch, model_cfg, plan,
                                                    microbatches, remat)
        count = zero.step_count(state["zero"]) if keyed else None
        new_params, new_zero, stats = zero.apply_updates(
            grads, params, state["zero"], tx=tx, plan=plan, layout=layout, param_specs=specs,
            clip_norm=clip_norm, step=count, key=jax.random.key(seed) if keyed else None,
            bucket_bytes=bucket_bytes, islands=islands)
        loss = lax.pmean(loss, data_axes)
        finite = jnp.isfinite(loss) & jnp.isfinite(stats["grad_norm"])
        keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)
        new_state = {"params": keep(new_params, params), "zero": keep(new_zero, state["zero"]),
                     "skipped": state["skipped"] + (~finite).astype(jnp.int32)}
        metrics = {"loss": loss, "grad_norm": stats["grad_norm"], "finite": finite}
        if "ef_norm" in stats:
            metrics["ef_norm"] = stats["ef_norm"]
        return new_state, metrics

    if islands is None:
        fn = jax.shard_map(body, mesh=mesh, in_specs=(sspecs, batch_spec),
                           out_specs=(sspecs, _metric_specs(layout)), check_vma=True)
        return jax.jit(fn, donate_argnums=0)

    def island_body(state_I, batch):
        state, metrics = body(jax.tree.map(lambda x: x[0], state_I), batch)
        return jax.tree.map(lambda x: x[None], (state, metrics))

    ispecs = island_specs(sspecs, islands)
    fn = jax.shard_map(island_body, mesh=mesh, in_specs=(ispecs, batch_spec),
                       out_specs=(ispecs, island_specs(_metric_specs(layout), islands)),
                       check_vma=True)
    return jax.jit(fn, donate_argnums=0)


def make_eval_step(model_cfg, mesh, plan, params_shapes, *, microbatches, islands=None):
    """A jitted fn(params, batch) -> mean loss over the batch, sending the
    forward messages of `plan` (the same compression as training). With
    `islands`: params [I, ...] (one copy per island) -> [I] losses, island i's
    over its share of the batch's rows (nothing crosses the island axis)."""
    specs = sharding.param_specs(params_shapes)
    data_axes = _data_axes(mesh, plan, islands)
    batch_spec = sharding.batch_spec(sharding.data_axes(mesh))

    def body(params, batch):
        return lax.pmean(parallel.local_loss(params, batch, model_cfg, plan, microbatches),
                         data_axes)

    if islands is None:
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(specs, batch_spec),
                                     out_specs=P(), check_vma=True))
    island_body = lambda params_I, batch: body(jax.tree.map(lambda x: x[0], params_I), batch)[None]
    return jax.jit(jax.shard_map(island_body, mesh=mesh,
                                 in_specs=(island_specs(specs, islands), batch_spec),
                                 out_specs=P(islands), check_vma=True))


def device_bytes(tree) -> int:
    """Bytes this tree occupies on the first local device (measured from the arrays)."""
    dev = jax.local_devices()[0]
    total = 0
    for x in jax.tree.leaves(tree):
        total += sum(s.data.nbytes for s in x.addressable_shards if s.device == dev)
    return total
