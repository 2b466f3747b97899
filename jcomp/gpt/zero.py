"""ZeRO: the optimizer step on the sharded state, with compressed gradient
reduction and compressed parameter gathers (optax does the update). The state
and its layout over the data axes are jcomp.gpt.zerostate's (re-exported here).

    layout = zero.for_plan(plan, stage=1)   # once per run, from the state's plan
    state = zero.init_state(params, param_specs, mesh, tx, layout)
    params, state, stats = zero.apply_updates(grads, params, state, tx=tx, plan=plan,
                                              layout=layout, param_specs=param_specs)

Data rank r owns elements [r*c, (r+1)*c) of each leaf's local block, flattened
and zero-padded to d*c (`zerostate`).

With a PowerSGD gradient codec, step 1 below is instead `powersgd.reduce_shards`
of each leaf's local block (stage 1 only: its factors are all-reduced, so
every rank gets the whole rank-R mean, of which it keeps slice r); its
residual lives in the first S entries of the leaf's "ef" buffer.

One step, inside the train step's `shard_map` (`apply_updates`):
  1. reduce the local gradients over 'data': reduce-scatter the padded [d*c]
     buffers (`hops.reduce_scatter_hops`, all leaves bucketed into a few
     messages) so rank r receives slice r, at stage 1 and 2 alike (an
     all-reduce would send twice the bytes for the same update); with the
     plan's grad_reduce codec and error feedback when the layout keeps
     residuals; divide by d (each rank's loss is the mean over its own rows,
     so the global mean is the mean of the d);
  2. clip by the global norm: each leaf's squares are summed over 'data' and
     the axes its spec splits it over, so a replicated leaf counts once
     (optax.clip_by_global_norm would see only the local shard);
  3. optax update of the (1, 1, 1, c) shards, applied to the float32 master;
  4. all-gather the master over 'data' with the plan's param_gather codec
     (`hops.all_gather_hops`), un-pad and cast: the new working params,
     invariant over 'data'. With a lossy param codec they are the decoded
     master (ZeRO++ qwZ); the float32 master itself never passes through a
     codec.

Two hops. On a mesh whose data axis is split (mesh.dcn_data > 1,
`Layout.data_axes` = ('dcn', 'data'), d = |dcn| x |data|, data rank r =
dcn_index * |data| + data_index) steps 1 and 4 go hop by hop through the same
two functions of jcomp.collectives.hops, each hop under its own message of the
plan (`Plan.data_hops`, `_data_hops` here): the reduce-scatter over the fast
'data' factor first (on the buffer as [data, dcn, c]), then over 'dcn' on the
[dcn, c] piece it leaves, which so carries 1/|data| of the buffer; the gather
over 'dcn' first, on the [c] shard, then over 'data'. Each hop sends its own
codec, or lax's op where it is "none", hierarchically also where both share
one. With |data| = 1 the fast hop sends nothing: lax's op over one device,
whatever its codec. Error feedback keeps one residual, that of the one lossy
hop: the fast hop's over the whole buffer as that hop sends it ([data, dcn,
c]), the slow hop's over its [dcn, c] piece, kept in the buffer's first
entries; a plan with both hops lossy and error feedback is refused
(`for_plan`).

The optimizer (`jcomp.gpt.hyperparams.make_tx`) must be elementwise: it sees
flat shards, not parameter shapes.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from jax import lax

from jcomp import collectives as cc
from jcomp.collectives import hops, powersgd
from jcomp.collectives.arguments import NONE
from jcomp.meter.scope import message_scope
from jcomp.gpt import hyperparams
from jcomp.gpt.zerostate import (  # noqa: F401  (the state, re-exported)
    SHARD_AXES, Layout, _local_shape, _own_slice, _spec_axes, abstract_state, for_plan,
    init_state, shard_len, state_specs, step_count, zero_spec, zero_specs)


def _norm_global(xs, axes_per_leaf):
    """sqrt(sum of squares) over the whole mesh: leaf i is summed over its axes
    only, so a leaf replicated over an axis counts once."""
    buckets: dict = {}
    for x, axes in zip(xs, axes_per_leaf):
        buckets[axes] = buckets.get(axes, 0.0) + jnp.sum(jnp.square(x.astype(jnp.float32)))
    return jnp.sqrt(sum(lax.psum(v, axes) for axes, v in buckets.items()))


def _check_grad(name, g, axes, data_axes=("data",), islands=()):
    varying = jax.typeof(g).mat.varying
    if not set(data_axes) <= set(varying):
        over = " and ".join(repr(a) for a in data_axes)
        raise ValueError(
            f"grads{name}: must be the local gradient, varying over {over}; cast the params "
            f"with lax.pcast(p, {tuple(data_axes)!r}, to='varying') before differentiating so "
            "that no automatic full-precision psum runs")
    extra = set(varying) - {*data_axes, *axes, *islands}
    if extra:
        raise ValueError(f"grads{name}: varies over {sorted(extra)} but its param spec only "
                         f"splits it over {axes}; reduce those partial sums first")


def _padded_grads(grads, p_leaves, masters, axes, multiple, data_axes=("data",), islands=()):
    """Local gradients -> zero-padded flat [D*c] buffers, after checking their
    varying axes and that the state fits the layout."""
    named = jax.tree_util.tree_flatten_with_path(grads)[0]
    d, flats = lax.axis_size(data_axes), []
    for (path, g), p, m, ax in zip(named, p_leaves, masters, axes):
        name = jax.tree_util.keystr(path)
        _check_grad(name, g, ax, data_axes, islands)
        c = shard_len(p.size, d, multiple)
        if g.shape != p.shape or m.shape != (1, 1, 1, c):
            raise ValueError(f"grads{name}: shape {g.shape}, param {p.shape} and master shard "
                             f"{m.shape} do not fit the layout (expected (1, 1, 1, {c}))")
        flats.append(jnp.pad(g.reshape(-1), (0, d * c - g.size)))
    return flats


def _fast_hop(plan) -> bool:
    """Whether the plan has a fast hop over 'data': not where |data| = 1."""
    return any(axis == "data" for axis, _, _ in plan.data_hops())


def _data_hops(plan, key, grad: bool):
    """The plan's data hops as `hops.Hop`s in the reduce-scatter's order: 'data'
    with the grad_reduce (or param_gather) message and `key`, then, with two
    hops, 'dcn' with its *_dcn message and fold_in(key, 1). Without a fast hop
    'data' sends lax's op over its one device, whatever its codec: nothing, the
    result only marked invariant there."""
    fast = plan.grad_reduce if grad else plan.param_gather
    out = [hops.Hop("data", fast.codec if _fast_hop(plan) else NONE, key=key,
                    message=fast.name)]
    if "dcn" in plan.data_axes:
        slow = plan.grad_reduce_dcn if grad else plan.param_gather_dcn
        out.append(hops.Hop("dcn", slow.codec, key=_fold(key, 1), message=slow.name))
    return out


def _fold(key, i):
    return None if key is None else jax.random.fold_in(key, i)


def _reduce_scatter(flats, res, plan, key, bucket_bytes):
    """The [D*c] buffers summed over the data axes -> (this rank's [c] slices, new
    [D*c] residuals or None): `hops.reduce_scatter_hops` over 'data', then 'dcn',
    on the buffers as [data, dcn, c] (see the module doc)."""
    hs = _data_hops(plan, key, grad=True)
    if len(hs) == 2:  # [dcn, data, c] -> [data, dcn, c]: the fast hop scatters data
        k, d = lax.axis_size("dcn"), lax.axis_size("data")
        flats = [f.reshape(k, d, -1).swapaxes(0, 1).reshape(-1) for f in flats]
    # the residual goes with the lossy hop, or where there is no fast hop, the slow one
    slow = len(hs) == 2 and res is not None and (
        hs[1].codec.kind != "identity" or not _fast_hop(plan))
    full = res
    if slow:  # the slow hop's residual [|dcn|*c] sits in the buffer's first entries
        res = [r[:r.shape[0] // lax.axis_size("data")] for r in res]
    own, new = hops.reduce_scatter_hops(flats, hs, residual=res, ef_hop=None if res is None
                                        else int(slow), rows="flat", bucket_bytes=bucket_bytes)
    if slow:
        new = [jnp.pad(n, (0, r.shape[0] - n.shape[0])) for n, r in zip(new, full)]
    return own, new


def _gather_params(master_leaves, p_leaves, plan, key, bucket_bytes):
    """(1, 1, 1, c) master shards -> working params: gathered over the data axes
    (invariant there; `hops.all_gather_hops` over 'dcn', then 'data'),
    un-padded, reshaped to the local param shapes and cast to their dtypes."""
    hs = _data_hops(plan, key, grad=False)[::-1]
    got = hops.all_gather_hops([m.reshape(-1) for m in master_leaves], hs, to="invarying",
                               rows="flat", bucket_bytes=bucket_bytes)
    if len(hs) == 2:  # [data, dcn, c] -> [dcn, data, c]: r = dcn_index * |data| + data_index
        k, d = lax.axis_size("dcn"), lax.axis_size("data")
        got = [g.reshape(d, k, -1).swapaxes(0, 1).reshape(-1) for g in got]
    return [x[:p.size].reshape(p.shape).astype(p.dtype) for x, p in zip(got, p_leaves)]


def _check_plan(plan, layout: Layout):
    """A phase's plan fits the layout: it may drop PowerSGD but not bring in
    another one (Q's shape is the layout's); parameter gathers send byte codecs."""
    g, p = plan.grad_reduce.codec, plan.param_gather.codec
    if g.kind == "lowrank" and g != layout.powersgd:
        raise ValueError(f"grad_reduce={g} needs the PowerSGD state of that codec; "
                         f"the layout has powersgd={layout.powersgd}")
    if tuple(plan.data_axes) != tuple(layout.data_axes):
        raise ValueError(f"the plan's data axes {plan.data_axes} are not the layout's "
                         f"{layout.data_axes}")
    for _, gm, pm in plan.data_hops():
        if pm.codec.kind in ("lowrank", "learned"):
            raise ValueError(f"{pm.name}={pm.codec}: parameter gathers take a byte codec")
    lossy = [gm for _, gm, _ in plan.data_hops() if gm.codec.kind != "identity"]
    if layout.error_feedback and len(lossy) > 1:
        raise ValueError(f"error feedback with both hops lossy ({lossy[0].name}, "
                         f"{lossy[1].name}): the layout keeps one hop's residual")


def apply_updates(grads, params, zstate, *, tx, plan, layout: Layout, param_specs,
                  clip_norm=0.0, step=None, key=None, bucket_bytes=cc.DEFAULT_BUCKET_BYTES,
                  islands=None):
    """One ZeRO step inside shard_map over ('data', 'tensor', 'pipeline') (and 'dcn'
    with two hops: `layout.data_axes`).

    grads:   local gradients, local param shapes, varying over 'data' (this rank's
             mean loss over its own rows) and over the axes of each param's spec.
    params:  local working params (shapes and dtypes of the result).
    zstate:  local blocks of the state dict (see the module docstring), built
             for `layout`.
    plan:    the phase's jcomp.gpt.messages.Plan: its grad_reduce and
             param_gather say what the gradient reduction and the parameter
             gather send, under their names. Residuals pass a lossless codec
             exactly; a gradient codec other than the layout's PowerSGD leaves
             Q as it was.
    `key` (folded with `step` when given) feeds codecs that draw randomness.
    bucket_bytes: the gradient reduction and the parameter gather send the leaves
             in flat buffers of at most this many bytes (`jcomp.collectives`).
    islands: a mesh axis whose indices are islands of their own (an outer loop's,
             jcomp.gpt.step): everything may vary over it, nothing is reduced over it.
    -> (new params invariant over 'data', new zstate,
        {"grad_norm": global pre-clip norm of the mean gradient,
         "ef_norm": global norm of the new residuals (each rank's, in summed-
                    gradient units, before the /D), when error feedback is on}).
    A non-finite gradient gives a non-finite grad_norm and update, never a finite one.
    """
    hyperparams.check_clip_norm(clip_norm)
    _check_plan(plan, layout)
    ef_on, psgd = layout.error_feedback, layout.powersgd
    for name, on in (("ef", ef_on), ("psgd_q", psgd is not None)):
        if on != (name in zstate):
            raise ValueError(f"zstate[{name!r}] must be {'present' if on else 'absent'} for "
                             f"{layout}; build the state with init_state for this layout")
    if key is not None and step is not None:
        key = jax.random.fold_in(key, step)
    k_grad, k_param = (None, None) if key is None else tuple(jax.random.split(key))

    treedef = jax.tree.structure(grads)
    axes = [_spec_axes(s) for s in treedef.flatten_up_to(param_specs)]
    p_leaves = treedef.flatten_up_to(params)
    masters = treedef.flatten_up_to(zstate["master"])
    data_axes = tuple(layout.data_axes)
    flats = _padded_grads(grads, p_leaves, masters, axes, layout.multiple, data_axes,
                          () if islands is None else (islands,))
    res_leaves = treedef.flatten_up_to(zstate["ef"]) if ef_on else None
    res = [r.reshape(-1) for r in res_leaves] if ef_on else None
    new_qs = None
    if isinstance(plan.grad_reduce.codec, powersgd.PowerSGD):
        q_leaves = treedef.flatten_up_to(zstate["psgd_q"])
        with message_scope(plan.grad_reduce.name):
            own, new_qs, new_res = powersgd.reduce_shards(flats, p_leaves, q_leaves, res, psgd,
                                                          k_grad)
    else:
        own, new_res = _reduce_scatter(flats, res, plan, k_grad, bucket_bytes)
        d = lax.axis_size(data_axes)
        own = [o.astype(jnp.float32) / d for o in own]
    g_shards = [o.reshape(m.shape) for o, m in zip(own, masters)]
    norm_axes = [data_axes + ax for ax in axes]
    grad_norm = _norm_global(g_shards, norm_axes)
    if clip_norm > 0:
        # NaN norm -> NaN scale: a bad step stays visible to the caller's guard.
        g_shards = [g * jnp.minimum(1.0, clip_norm / grad_norm) for g in g_shards]

    master_tree = jax.tree.unflatten(treedef, masters)
    updates, new_opt = tx.update(jax.tree.unflatten(treedef, g_shards), zstate["opt"], master_tree)
    new_master = optax.apply_updates(master_tree, updates)
    new_params = _gather_params(treedef.flatten_up_to(new_master), p_leaves, plan, k_param,
                                bucket_bytes)

    new_state = {"master": new_master, "opt": new_opt}
    if psgd is not None:
        new_state["psgd_q"] = (zstate["psgd_q"] if new_qs is None
                               else jax.tree.unflatten(treedef, new_qs))
    stats = {"grad_norm": grad_norm}
    if ef_on:
        new_state["ef"] = jax.tree.unflatten(
            treedef, [n.reshape(r.shape) for n, r in zip(new_res, res_leaves)])
        stats["ef_norm"] = _norm_global(new_res, norm_axes)
    return jax.tree.unflatten(treedef, new_params), new_state, stats
