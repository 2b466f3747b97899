"""An outer step for low-communication training (DiLoCo) in a `jax.jit` program.

Islands (groups of data-parallel replicas on either side of a slow link: the
slow hop of the data axis) train alone for H inner steps; then each sends its
pseudo-gradient, anchor - params (the anchor is the parameters at the last
sync), the islands average it with a jcomp codec, an outer optimizer applies
the average to the anchor, and every island restarts from the new anchor.
Inner steps send nothing across islands; a sync sends each island's
pseudo-gradient across once, coded.

    tx = optax.sgd(0.7, momentum=0.9, nesterov=True)       # DiLoCo's outer optimizer
    params_IxX, state = cc.outer_init(params, tx, mesh=mesh, axis="dcn")
    for step in range(steps):
        params_IxX, opt_IxX = inner_step(params_IxX, opt_IxX, batch)   # vmap over I
        if (step + 1) % H == 0:
            params_IxX, state = sync(params_IxX, state)    # cc.outer_sync under jit

Every parameter leaf carries a leading island dimension I, split over the mesh
axis `axis` (MaxText's DiLoCo holds its replicas the same way), so the islands'
copies can differ inside one global-view program, and XLA places the islands'
inner steps (`jax.vmap` over I, the other axes automatic) as usual.

The average runs in a `jax.shard_map` manual over every mesh axis, each leaf
taken as the caller's `param_specs` split it inside an island: with the other
axes automatic, XLA would gather a leaf split over them (FSDP, tensor
parallelism) before coding it, and the slow link would carry the whole leaf
from every device. Here a device codes the shard it holds, and the devices
that hold the same copy of a leaf each send a 1/n piece of it, then gather
the averaged pieces raw over their own (fast) axes: per device, the slow link
carries 1/(devices per island) of the pseudo-gradient. The outer optimizer then
runs on the average, which every island holds, so the new anchor is computed
alike everywhere and its broadcast back to the islands sends nothing.

The outer optimizer is the caller's: any object with optax's
`init(params) -> state` and `update(grads, state, params) -> (updates, state)`
(the library imports only jax and numpy). `optax.sgd(lr, momentum=0.9,
nesterov=True)` is DiLoCo's; with `codec="none"`, lr 1 and no momentum the
sync is the plain mean of the islands' parameters, to float32 rounding: the
pseudo-gradient is formed, averaged and subtracted, three roundings of half
an ulp of the largest of anchor and parameters (exact division by a
power-of-two number of islands; tested to 2 ulp).
"""
from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jcomp.collectives import arguments, hops, rowlayout
from jcomp.collectives.outer import sparseloco
from jcomp.collectives.jit.specs import axes_in
from jcomp.collectives.buckets import DEFAULT_BUCKET_BYTES

__all__ = ["OuterState", "outer_init", "outer_sync"]


class OuterState(NamedTuple):
    """What the outer loop keeps between syncs.

    anchor: the parameters at the last sync, one copy (no island dimension).
    opt_state: the outer optimizer's state for `anchor`.
    residual: error feedback's residuals, one per island (leading dimension I,
        split over the islands' axis like the parameters): what each island's
        coded pseudo-gradient left unsent, added to its next one. None without
        error feedback.
    """
    anchor: Any
    opt_state: Any
    residual: Any = None


def outer_init(params, tx, *, mesh, axis: str, param_specs=None, error_feedback: bool = False):
    """-> (params_IxX, OuterState): every island's copy of `params` and the outer
    state, whose anchor is `params`.

    params: one copy of the parameters (no island dimension), not split over
    `axis`. tx: the outer optimizer (optax interface). params_IxX has every
    leaf [I, ...], I = mesh.shape[axis], split over `axis` and then as
    `param_specs` say (see `outer_sync`). error_feedback:
    keep per-island residuals (zeros like params_IxX); `outer_sync` then sends
    with error feedback. Call it under `jax.jit` to keep everything on the
    devices."""
    _check_tx(tx)
    _check_axis(mesh, axis)
    _check_floating(params, "params")
    specs = _check_specs(param_specs, params, "params", 0, mesh, axis)
    # The anchor split as the syncs will leave it, so that they compile once.
    anchor = jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), params, specs)
    params_IxX = _restart(anchor, anchor, specs, mesh, axis)
    residual = jax.tree.map(jnp.zeros_like, params_IxX) if error_feedback else None
    return params_IxX, OuterState(anchor, tx.init(anchor), residual)


def outer_sync(params_IxX, state: OuterState, *, tx, mesh, axis: str, codec="none",
               param_specs=None, rows: str = "flat", key=None,
               bucket_bytes: int = DEFAULT_BUCKET_BYTES):
    """One outer step: -> (params_IxX with every island at the new anchor, new state).

    params_IxX: every leaf [I, ...], I = mesh.shape[axis], split over `axis`
    (the islands). param_specs: one island's PartitionSpecs over the other
    mesh axes (a tree like one island's parameters, or one spec for all), as
    the inner step splits them (FSDP, tensor parallelism); None: replicated
    inside an island. Each leaf is coded where it lies, and the devices that
    hold the same copy of a leaf send a piece each. state: from `outer_init`.
    tx: the outer optimizer whose state `state.opt_state` is. codec: any jcomp
    codec for the pseudo-gradients (in the parameters' dtype) that cross
    `axis`, or a `cc.SparseLoCo` (chunked top-k, 2-bit values, a decaying
    residual: `state.residual` required). With `state.residual` (error
    feedback) each island sends codec(pseudo-gradient + residual) and keeps
    what that dropped. rows:
    "flat" (the default: pseudo-gradients are parameter buffers, where no row
    is a token, so each leaf's piece codes as one vector and fewer scales
    travel; leaves never share a block) or "independent" (every vector along a
    leaf's last axis on its own, pieces made of whole rows). key: a
    jax.random key, required by codecs that draw (stochastic rounding ":sr",
    randk): a new one for each sync (e.g. jax.random.fold_in of a run's key
    with the sync's step), else every sync draws alike. A leaf of size 0 sends
    nothing and stays empty. Call it inside `jax.jit`.
    """
    _check_tx(tx)
    _check_args(params_IxX, state, mesh, axis)
    specs = _check_specs(param_specs, params_IxX, "params_IxX", 1, mesh, axis)
    arguments.check_rows(rows)
    if isinstance(codec, sparseloco.SparseLoCo):
        if state.residual is None:
            raise ValueError("codec SparseLoCo keeps a residual per island: make the state "
                             "with cc.outer_init(..., error_feedback=True)")
    else:
        _check_key(arguments.parse(codec), key)
    delta_IxX = jax.tree.map(lambda a, p: a[None].astype(p.dtype) - p, state.anchor, params_IxX)
    mean, residual = _average(delta_IxX, state.residual, specs, mesh, axis, codec, rows, key,
                              bucket_bytes)
    updates, opt_state = tx.update(mean, state.opt_state, state.anchor)
    anchor = jax.tree.map(lambda a, u: (a + u).astype(a.dtype), state.anchor, updates)
    return (_restart(anchor, params_IxX, specs, mesh, axis),
            OuterState(anchor, opt_state, residual))


def _restart(anchor, like, specs, mesh, axis):
    """Every island's copy of the anchor (split over `axis`, with `like`'s dtypes).
    The anchor is the same on every island, so this sends nothing."""
    leaves, treedef = jax.tree.flatten(anchor)
    specs = treedef.flatten_up_to(specs)
    copies = jax.shard_map(lambda xs: [x[None] for x in xs], mesh=mesh, in_specs=(specs,),
                           out_specs=[P(axis, *s) for s in specs])(leaves)
    dtypes = treedef.flatten_up_to(jax.tree.map(lambda p: p.dtype, like))
    return jax.tree.unflatten(treedef, [c.astype(d) for c, d in zip(copies, dtypes)])


def _average(delta_IxX, residual_IxX, specs, mesh, axis, codec, rows, key, bucket_bytes):
    """The islands' mean pseudo-gradient (no island dimension, the same on every
    island, split as `specs` say) and the new residuals (None without error
    feedback).

    Manual over every mesh axis, so that a leaf split inside an island (FSDP,
    tensor parallelism) is coded shard by shard where it lies; with the other
    axes automatic, XLA gathers it before coding. The devices of an island that
    hold the same copy of a leaf (the axes its spec leaves out) each send a
    1/n piece of it across `axis`, and gather the averaged pieces over those
    fast axes: the slow link carries each island's pseudo-gradient once, not
    once per copy."""
    all_leaves, treedef = jax.tree.flatten(delta_IxX)
    all_specs = treedef.flatten_up_to(specs)
    fed = residual_IxX is not None
    all_res = treedef.flatten_up_to(residual_IxX) if fed else [None] * len(all_leaves)
    # An empty leaf (size 0) has nothing to send: its mean is empty, its residual
    # stays as it is. The others are averaged below.
    sent = [i for i, x in enumerate(all_leaves) if x.size]
    leaves, specs = [all_leaves[i] for i in sent], [all_specs[i] for i in sent]
    res_leaves = [all_res[i] for i in sent]
    copies = [tuple(a for a in mesh.axis_names if a != axis and a not in axes_in(s)
                    and mesh.shape[a] > 1) for s in specs]
    kw = dict(codec=codec, rows=rows, key=key, bucket_bytes=bucket_bytes)

    def body(d_leaves, r_leaves=None):
        r_leaves = r_leaves or [None] * len(d_leaves)
        pieces, res_pieces, layouts = [], [], []
        for d, r, rep in zip(d_leaves, r_leaves, copies):
            d, r = d[0], (None if r is None else r[0])
            layouts.append((d.shape, d.dtype))
            if rep:  # this device's piece: whole rows ("independent") or a 1/n cut ("flat")
                d, r = (None if x is None else _piece(x, rep, rows) for x in (d, r))
            pieces.append(d)
            res_pieces.append(r)
        if isinstance(codec, sparseloco.SparseLoCo):
            means, lost = zip(*(sparseloco.average(p, r, axis, codec)
                                for p, r in zip(pieces, res_pieces)))
        elif fed:
            # psum_ef's residual is in the summands' units: average after the sum.
            totals, lost = hops.psum_ef(pieces, res_pieces, axis, **kw)
            means = [t / mesh.shape[axis] for t in totals]
        else:
            means, lost = hops.pmean(pieces, axis, **kw), [None] * len(pieces)
        out_means, out_res = [], []
        for m, miss, rep, (shape, dtype) in zip(means, lost, copies, layouts):
            if rep:
                m = _whole(m, rep, shape, dtype)
                miss = None if miss is None else _whole(miss, rep, shape, dtype)
            out_means.append(m)
            out_res.append(None if miss is None else miss[None])
        return out_means, (out_res if fed else None)

    means = [jnp.zeros(x.shape[1:], x.dtype) for x in all_leaves]
    res = list(all_res)
    if sent:
        island_specs = [P(axis, *s) for s in specs]
        f = jax.shard_map(body, mesh=mesh, in_specs=(island_specs,) * (1 + fed),
                          out_specs=(list(specs), island_specs if fed else None))
        got, got_res = f(*((leaves, res_leaves) if fed else (leaves,)))
        for j, i in enumerate(sent):
            means[i] = got[j]
            if fed:
                res[i] = got_res[j]
    return (jax.tree.unflatten(treedef, means),
            jax.tree.unflatten(treedef, res) if fed else None)


def _piece(x, rep, rows):
    """This device's share of `x` among the devices of `rep`, which hold equal copies."""
    n = lax.axis_size(rep)
    x_RxC = rowlayout.whole_rows(x, n, rows)
    x_NxRxC = x_RxC.reshape(n, -1, x_RxC.shape[-1])
    return lax.dynamic_index_in_dim(x_NxRxC, lax.axis_index(rep), 0, keepdims=False)


def _whole(piece_RxC, rep, shape, dtype):
    """The pieces of `rep`'s devices put back together (a raw gather over fast axes)."""
    full = lax.all_gather(piece_RxC, rep, axis=0, tiled=True, to="invarying")
    return rowlayout.from_whole_rows(full, shape, dtype)


def _check_key(codec, key):
    # Raised here, before tracing, so that the message names outer_sync's argument.
    if codec.needs_key and key is None:
        raise ValueError(f"codec {str(codec)!r} draws random numbers: pass key= to "
                         "cc.outer_sync (a jax.random key, a new one for each sync, e.g. "
                         "jax.random.fold_in(key, step))")


def _check_tx(tx):
    if not (callable(getattr(tx, "init", None)) and callable(getattr(tx, "update", None))):
        raise TypeError(f"tx must be an outer optimizer with optax's init and update "
                        f"(e.g. optax.sgd(0.7, momentum=0.9, nesterov=True)); got {tx!r}")


def _check_floating(tree, name):
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if not jnp.issubdtype(jnp.result_type(leaf), jnp.floating):
            # An outer optimizer on integers rounds its update away, and a lossy
            # codec cannot send them: refuse them whatever the codec.
            raise TypeError(f"{name}{jax.tree_util.keystr(path)} has dtype "
                            f"{jnp.result_type(leaf)}; the outer loop averages floating-point "
                            f"parameters only (keep integer state out of {name})")


def _check_axis(mesh, axis) -> int:
    if not isinstance(axis, str) or axis not in mesh.axis_names:
        raise ValueError(f"axis {axis!r} is not one mesh axis of {tuple(mesh.axis_names)}")
    return mesh.shape[axis]


def _check_specs(param_specs, tree, name, lead, mesh, axis) -> list:
    """-> a PartitionSpec per leaf of `tree` (one island's, past `lead` island
    dimensions); a ValueError naming param_specs where one cannot apply."""
    leaves, treedef = jax.tree.flatten(tree)
    if param_specs is None:
        return jax.tree.unflatten(treedef, [P()] * len(leaves))
    if isinstance(param_specs, P):
        param_specs = jax.tree.unflatten(treedef, [param_specs] * len(leaves))
    try:
        specs = treedef.flatten_up_to(param_specs)
    except (TypeError, ValueError):
        raise ValueError(f"param_specs has the tree structure {jax.tree.structure(param_specs)}"
                         f"; {name} has {treedef}") from None
    named = jax.tree_util.tree_flatten_with_path(tree)[0]
    for (path, leaf), spec in zip(named, specs):
        where = f"param_specs{jax.tree_util.keystr(path)}"
        if not isinstance(spec, P):
            raise TypeError(f"{where} must be a PartitionSpec; got {spec!r}")
        if axis in axes_in(spec):
            raise ValueError(f"{where} = {spec} splits over the islands' axis {axis!r}; "
                             "give one island's split (the island dimension adds it)")
        unknown = axes_in(spec) - set(mesh.axis_names)
        if unknown:
            raise ValueError(f"{where} = {spec} names {sorted(unknown)}, not axes of the mesh "
                             f"{tuple(mesh.axis_names)}")
        if len(spec) > leaf.ndim - lead:
            raise ValueError(f"{where} = {spec} has more entries than the leaf's "
                             f"{leaf.ndim - lead} dimensions")
        shape = tuple(leaf.shape[lead:])
        for dim, part in enumerate(spec):
            names = () if part is None else part if isinstance(part, tuple) else (part,)
            n = math.prod(mesh.shape[a] for a in names)
            if shape[dim] % n:
                raise ValueError(
                    f"{where} = {spec} splits dimension {dim} of the leaf's shape {shape} "
                    f"(one island's) over {' x '.join(names)} = {n} devices, which does not "
                    f"divide {shape[dim]} (mesh axis sizes {dict(mesh.shape)}); give a split "
                    "whose axes' sizes divide each dimension they split")
    return jax.tree.unflatten(treedef, specs)


def _check_args(params_IxX, state, mesh, axis) -> int:
    """-> the number of islands; a ValueError or TypeError naming the bad argument."""
    if not isinstance(state, OuterState):
        raise TypeError(f"state must be the OuterState of cc.outer_init; got {type(state)}")
    islands = _check_axis(mesh, axis)
    _check_floating(params_IxX, "params_IxX")
    named, treedef = jax.tree_util.tree_flatten_with_path(params_IxX)
    try:
        anchors = treedef.flatten_up_to(state.anchor)
    except (TypeError, ValueError):
        raise ValueError(f"state.anchor has the tree structure {jax.tree.structure(state.anchor)}"
                         f"; params_IxX has {treedef}") from None
    residuals = None
    if state.residual is not None:
        try:
            residuals = treedef.flatten_up_to(state.residual)
        except (TypeError, ValueError):
            raise ValueError(f"state.residual has the tree structure "
                             f"{jax.tree.structure(state.residual)}; params_IxX has {treedef}"
                             ) from None
    for i, (path, leaf) in enumerate(named):
        name = jax.tree_util.keystr(path)
        if leaf.ndim == 0 or leaf.shape[0] != islands:
            raise ValueError(f"params_IxX{name} has shape {leaf.shape}; its leading dimension "
                             f"must be the {islands} islands of mesh axis {axis!r}")
        if jnp.shape(anchors[i]) != leaf.shape[1:]:
            raise ValueError(f"state.anchor{name} has shape {jnp.shape(anchors[i])}; expected "
                             f"{leaf.shape[1:]} (params_IxX{name} without its island dimension)")
        if residuals is not None and jnp.shape(residuals[i]) != leaf.shape:
            raise ValueError(f"state.residual{name} has shape {jnp.shape(residuals[i])}; "
                             f"expected params_IxX{name}'s {leaf.shape}")
    return islands
