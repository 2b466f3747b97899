"""An outer step for low-communication training (DiLoCo) in a `jax.jit` program.

Islands (groups of data-parallel replicas on either side of a slow link: the
slow hop of the data axis) train alone for H inner steps; then each sends its
pseudo-gradient, anchor - params (the anchor is the parameters at the last
sync), the islands average it with a jcomp codec, an outer optimizer applies
the average to the anchor, and every island restarts from the new anchor.
Inner steps send nothing across islands; a sync sends one coded copy of the
parameters' size.

    tx = optax.sgd(0.7, momentum=0.9, nesterov=True)       # DiLoCo's outer optimizer
    params_IxX, state = cc.outer_init(params, tx, mesh=mesh, axis="dcn")
    for step in range(steps):
        params_IxX, opt_IxX = inner_step(params_IxX, opt_IxX, batch)   # vmap over I
        if (step + 1) % H == 0:
            params_IxX, state = sync(params_IxX, state)    # cc.outer_sync under jit

Every parameter leaf carries a leading island dimension I, split over the mesh
axis `axis` (MaxText's DiLoCo holds its replicas the same way), so the islands'
copies can differ inside one global-view program; the other mesh axes stay
automatic, and XLA places the islands' inner steps (`jax.vmap` over I) as usual.
Only the average crosses `axis`, in a `jax.shard_map` manual over that axis
alone; the outer optimizer runs on the averaged pseudo-gradient, which every
island then holds, so the new anchor is computed alike everywhere and its
broadcast back to the islands sends nothing.

The outer optimizer is the caller's: any object with optax's
`init(params) -> state` and `update(grads, state, params) -> (updates, state)`
(the library imports only jax and numpy). `optax.sgd(lr, momentum=0.9,
nesterov=True)` is DiLoCo's; with `codec="none"`, lr 1 and no momentum the
sync is the plain mean of the islands' parameters, to float32 rounding (the
pseudo-gradient is formed, averaged and subtracted: about 2 ulp of the
largest of anchor and parameters).
"""
from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jcomp.collectives import hops, kernels
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


def outer_init(params, tx, *, mesh, axis: str, error_feedback: bool = False):
    """-> (params_IxX, OuterState): every island's copy of `params` and the outer
    state, whose anchor is `params`.

    params: one copy of the parameters (no island dimension), replicated over
    `axis`. tx: the outer optimizer (optax interface). params_IxX has every
    leaf [I, ...], I = mesh.shape[axis], split over `axis`. error_feedback:
    keep per-island residuals (zeros like params_IxX); `outer_sync` then sends
    with error feedback. Call it under `jax.jit` to keep everything on the
    devices."""
    _check_tx(tx)
    _check_axis(mesh, axis)
    _check_floating(params, "params")
    params_IxX = _restart(params, params, mesh, axis)
    residual = jax.tree.map(jnp.zeros_like, params_IxX) if error_feedback else None
    return params_IxX, OuterState(params, tx.init(params), residual)


def outer_sync(params_IxX, state: OuterState, *, tx, mesh, axis: str, codec="none",
               rows: str = "flat", key=None, bucket_bytes: int = DEFAULT_BUCKET_BYTES):
    """One outer step: -> (params_IxX with every island at the new anchor, new state).

    params_IxX: every leaf [I, ...], I = mesh.shape[axis], split over `axis`
    (the islands), any other mesh axes automatic. state: from `outer_init`.
    tx: the outer optimizer whose state `state.opt_state` is. codec: any jcomp
    codec for the pseudo-gradients that cross `axis`; a codec per hop does not
    apply (one axis). With `state.residual` (error feedback) each island sends
    codec(pseudo-gradient + residual) and keeps what that dropped. rows:
    "flat" (the default: pseudo-gradients are parameter buffers, no row is a
    token, so each leaf codes as one vector and fewer scales travel; leaves
    never share a block) or "independent" (every vector along a leaf's last
    axis on its own). key: for codecs that draw. Call it inside `jax.jit`.
    """
    _check_tx(tx)
    islands = _check_args(params_IxX, state, mesh, axis)
    kernels.check_rows(rows)
    delta_IxX = jax.tree.map(lambda a, p: a[None].astype(p.dtype) - p, state.anchor, params_IxX)
    mean, residual = _average(delta_IxX, state.residual, mesh, axis, islands, codec, rows, key,
                              bucket_bytes)
    updates, opt_state = tx.update(mean, state.opt_state, state.anchor)
    anchor = jax.tree.map(lambda a, u: (a + u).astype(a.dtype), state.anchor, updates)
    return _restart(anchor, params_IxX, mesh, axis), OuterState(anchor, opt_state, residual)


def _restart(anchor, like, mesh, axis):
    """Every island's copy of the anchor (split over `axis`, with `like`'s dtypes).
    The anchor is the same on every island, so this sends nothing."""
    dtypes = jax.tree.map(lambda p: p.dtype, like)
    copies = jax.shard_map(lambda a: jax.tree.map(lambda x: x[None], a), mesh=mesh,
                           in_specs=P(), out_specs=P(axis), axis_names={axis})(anchor)
    return jax.tree.map(lambda c, d: c.astype(d), copies, dtypes)


def _average(delta_IxX, residual_IxX, mesh, axis, islands, codec, rows, key, bucket_bytes):
    """The islands' mean pseudo-gradient (no island dimension, the same on every
    island) and the new residuals (None without error feedback)."""
    kw = dict(codec=codec, rows=rows, key=key, bucket_bytes=bucket_bytes)

    def own(tree_1xX):
        return jax.tree.map(lambda x: x[0], tree_1xX)

    def plain(d_1xX):
        return hops.pmean(own(d_1xX), axis, **kw)

    def fed_back(d_1xX, r_1xX):
        # psum_ef's residual is in the summands' units: average after the sum.
        total, r = hops.psum_ef(own(d_1xX), own(r_1xX), axis, **kw)
        return (jax.tree.map(lambda t: t / islands, total),
                jax.tree.map(lambda x: x[None], r))

    # Manual over the islands' axis only: the parameters' split over the other
    # axes stays XLA's, and only the average crosses `axis`.
    if residual_IxX is None:
        f = jax.shard_map(plain, mesh=mesh, in_specs=P(axis), out_specs=P(),
                          axis_names={axis})
        return f(delta_IxX), None
    f = jax.shard_map(fed_back, mesh=mesh, in_specs=(P(axis), P(axis)),
                      out_specs=(P(), P(axis)), axis_names={axis})
    return f(delta_IxX, residual_IxX)


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
