"""ZeRO: optimizer state sharded over 'data', compressed gradient reduction and
compressed parameter gathers (optax does the update).

    layout = zero.for_plan(plan, stage=1)   # once per run, from the state's plan
    state = zero.init_state(params, param_specs, mesh, tx, layout)
    params, state, stats = zero.apply_updates(grads, params, state, tx=tx, plan=plan,
                                              layout=layout, param_specs=param_specs)

Working parameters are sharded over 'tensor'/'pipeline' as their PartitionSpecs
say and replicated over 'data'. Everything the optimizer keeps is split once
more over 'data': each leaf's local (tensor/pipeline) block is flattened to
length S and zero-padded to d*c, with

    c = ceil(S / d) rounded up to `layout.multiple`

(the codecs' row length, so no codec pads again); data rank r owns elements
[r*c, (r+1)*c). Outside `shard_map` the state is a dict of global arrays

    "master"  float32 master-parameter shards  (d, t', p', c)
    "opt"     the optax state of those shards   (d, t', p', c) per moment, scalars P()
    "ef"      error-feedback residuals          (d, t', p', d*c), only when
              `layout.error_feedback`
    "psgd_q"  PowerSGD right factors Q          (t', p', n, R), only when
              `layout.powersgd`: float32, one per tensor/pipeline block (n = its
              last dim, R = the rank), replicated over 'data'

with t' = t if the leaf is sharded over 'tensor' else 1 (p' likewise; d, t, p:
the mesh's axis sizes), laid out by `zero_spec`: inside `shard_map` a block is
(1, 1, 1, c) ((1, 1, 1, d*c) for "ef"). The residual is per-device state: each
data rank keeps what its own full-length contribution [d*c] still owes the
sum, for stage 1 and stage 2 alike. The layout depends on (d, t, p) and
`Layout`; a checkpoint restores onto the same layout.

With a PowerSGD gradient codec, step 1 below is instead `powersgd.reduce_shards`
of each leaf's local block (stage 1 only: its factors are all-reduced, so
every rank gets the whole rank-R mean, of which it keeps slice r); its
residual lives in the first S entries of the leaf's "ef" buffer.

One step, inside the train step's `shard_map` (`apply_updates`):
  1. reduce the local gradients over 'data' (`datahops.reduce_scatter`):
     reduce-scatter the padded [d*c] buffers (`cc.psum_scatter`, all leaves
     bucketed into a few messages) so
     rank r receives slice r, at stage 1 and 2 alike (an all-reduce would send
     twice the bytes for the same update); with the plan's grad_reduce codec
     and error feedback when the layout keeps residuals; divide by d (each
     rank's loss is the mean over its own rows, so the global mean is the mean
     of the d);
  2. clip by the global norm: each leaf's squares are summed over 'data' and
     the axes its spec splits it over, so a replicated leaf counts once
     (optax.clip_by_global_norm would see only the local shard);
  3. optax update of the (1, 1, 1, c) shards, applied to the float32 master;
  4. all-gather the master over 'data' with the plan's param_gather codec
     (`datahops.gather`), un-pad and cast: the new working params, invariant
     over 'data'. With a
     lossy param codec they are the decoded master (ZeRO++ qwZ); the float32
     master itself never passes through a codec.

Two hops. On a mesh whose data axis is split (mesh.dcn_data > 1,
`Layout.data_axes` = ('dcn', 'data'), d = |dcn| x |data|) the state is laid
out the same way over the tuple of axes (data rank r = dcn_index * |data| +
data_index) and steps 1 and 4 go hop by hop, each hop under its own message
of the plan (`Plan.data_hops`, jcomp.gpt.datahops): the reduce-scatter over
the fast 'data' factor first, then over 'dcn' on the piece it leaves; the
gather over 'dcn' first, on the [c] shard, then over 'data'. Each hop sends
its own codec, or lax's op where it is "none". Error feedback keeps one
residual, that of the one lossy hop; a plan with both hops lossy and error
feedback is refused (`for_plan`).

The optimizer (`jcomp.gpt.hyperparams.make_tx`) must be elementwise: it sees
flat shards, not parameter shapes.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jcomp import collectives as cc
from jcomp.collectives import powersgd
from jcomp.meter.scope import message_scope
from jcomp.gpt import datahops, hyperparams

SHARD_AXES = ("tensor", "pipeline")  # the axes working params may be split over


def step_count(zstate):
    """The number of updates applied so far: the optax state's first `count`
    (every optax transformation with a count advances it once per update)."""
    found = optax.tree_utils.tree_get_all_with_path(zstate["opt"], "count")
    if not found:
        raise ValueError("the optimizer state has no 'count' to number the steps by")
    return found[0][1]


# ------------------------------------------------------------------- layout

def _spec_axes(spec) -> tuple:
    """Mesh axes a working-param spec splits over, in SHARD_AXES order."""
    if not isinstance(spec, P):
        raise TypeError(f"param_specs leaves must be PartitionSpecs; got {spec!r}")
    named = set()
    for entry in spec:
        named.update(entry if isinstance(entry, tuple) else (() if entry is None else (entry,)))
    bad = named - set(SHARD_AXES)
    if bad:
        raise ValueError(f"param_specs: {spec} names {sorted(bad)}; working params may only be "
                         f"split over {SHARD_AXES} (they are replicated over 'data')")
    return tuple(a for a in SHARD_AXES if a in named)


def zero_spec(spec, data_axes=("data",)) -> P:
    """PartitionSpec of a (D, T', P', c) state leaf for a param with `spec`; D is
    split over `data_axes` (see Layout)."""
    axes = _spec_axes(spec)
    lead = data_axes[0] if len(data_axes) == 1 else tuple(data_axes)
    return P(lead, *(a if a in axes else None for a in SHARD_AXES), None)


def zero_specs(param_specs, data_axes=("data",)):
    """`zero_spec` of every leaf of `param_specs`."""
    return jax.tree.map(lambda s: zero_spec(s, data_axes), param_specs)


@dataclasses.dataclass(frozen=True)
class Layout:
    """What the ZeRO state's shapes depend on besides the mesh and the params.
    Decided once per run (`for_plan`); a phase of a compression schedule sends
    other codecs over the same layout."""

    stage: int = 1                # ZeRO stage: 1 or 2
    error_feedback: bool = False  # the state keeps residuals ("ef")
    powersgd: powersgd.PowerSGD | None = None  # the gradient codec whose Q the state keeps
    multiple: int = 1             # shard lengths are multiples of this
    data_axes: tuple = ("data",)  # the data-parallel axes: ('dcn', 'data') with two hops

    def __post_init__(self):
        if self.stage not in (1, 2) or isinstance(self.stage, bool):
            raise ValueError(f"stage must be 1 or 2; got {self.stage!r}")
        if self.powersgd is not None and self.stage != 1:
            raise ValueError("powersgd needs optim.zero_stage=1: its factors are all-reduced, "
                             f"not reduce-scattered; got stage={self.stage} with "
                             f"data.grad={self.powersgd}")
        if not isinstance(self.multiple, int) or self.multiple < 1:
            raise ValueError(f"multiple must be a positive int; got {self.multiple!r}")
        if tuple(self.data_axes) not in (("data",), ("dcn", "data")):
            raise ValueError(f"data_axes must be ('data',) or ('dcn', 'data'); "
                             f"got {self.data_axes!r}")
        if self.powersgd is not None and len(self.data_axes) > 1:
            raise ValueError(f"powersgd does not run over two hops (mesh.dcn_data > 1); "
                             f"got data.grad={self.powersgd}")


def for_plan(plan, stage: int = 1) -> Layout:
    """The layout of a run whose state is laid out for `plan` (a
    jcomp.gpt.messages.Plan): residuals where it asks for error feedback and its
    gradient codec is lossy, PowerSGD's Q where that codec is PowerSGD, and
    shards the gradient and parameter codecs' rows divide (every hop's)."""
    g = plan.grad_reduce.codec
    hops = plan.data_hops()
    lossy = [m.name for _, m, _ in hops if m.codec.kind != "identity"]
    ef = bool(plan.error_feedback) and bool(lossy)
    if ef and len(lossy) > 1:
        raise ValueError(f"error feedback with both hops lossy ({', '.join(lossy)}): it keeps "
                         "the residual of one hop; make one hop lossless or turn it off")
    multiple = math.lcm(*(m.codec.row_multiple for _, gm, pm in hops for m in (gm, pm)))
    return Layout(stage=stage, error_feedback=ef,
                  powersgd=g if isinstance(g, powersgd.PowerSGD) else None,
                  multiple=multiple, data_axes=tuple(plan.data_axes))


def shard_len(n_local: int, n_data: int, multiple: int) -> int:
    """c = ceil(n_local / n_data) rounded up to `multiple` (at least `multiple`)."""
    per_rank = -(-n_local // n_data)
    return max(-(-per_rank // multiple) * multiple, multiple)


def _local_shape(shape, spec, sizes) -> tuple:
    out = list(shape)
    for dim, entry in enumerate(spec):
        axes = entry if isinstance(entry, tuple) else (() if entry is None else (entry,))
        n = math.prod(sizes[a] for a in axes)
        if out[dim] % n:
            raise ValueError(f"param of shape {tuple(shape)}: dim {dim} ({out[dim]}) is not "
                             f"divisible by the {n} devices of {spec}")
        out[dim] //= n
    return tuple(out)


def _state_leaves(params, param_specs, mesh, layout, width):
    """Per leaf, a float32 ShapeDtypeStruct (D, T', P', width(c, D)) of its state."""
    sizes = dict(mesh.shape)
    d, multiple = math.prod(sizes[a] for a in layout.data_axes), layout.multiple

    def one(param, spec):
        c = shard_len(math.prod(_local_shape(param.shape, spec, sizes)), d, multiple)
        axes = _spec_axes(spec)
        shape = (d, *(sizes[a] if a in axes else 1 for a in SHARD_AXES), width(c, d))
        return jax.ShapeDtypeStruct(shape, jnp.float32)

    return jax.tree.map(one, params, param_specs)


def _q_spec(spec) -> P:
    """PartitionSpec of a (T', P', n, R) PowerSGD Q leaf: replicated over 'data'."""
    axes = _spec_axes(spec)
    return P(*(a if a in axes else None for a in SHARD_AXES), None, None)


def _q_leaves(params, param_specs, mesh, rank):
    """Per leaf, a float32 ShapeDtypeStruct (T', P', n, R) of its PowerSGD Q."""
    sizes = dict(mesh.shape)

    def one(param, spec):
        n = powersgd.matrix_shape(_local_shape(param.shape, spec, sizes))[1]
        axes = _spec_axes(spec)
        shape = (*(sizes[a] if a in axes else 1 for a in SHARD_AXES), n, rank)
        return jax.ShapeDtypeStruct(shape, jnp.float32)

    return jax.tree.map(one, params, param_specs)


# -------------------------------------------------------------------- state

def state_specs(param_specs, tx, layout: Layout):
    """PartitionSpecs of the state dict, for shard_map in/out specs and shardings."""
    zspecs = zero_specs(param_specs, layout.data_axes)
    dummy = jax.tree.map(lambda _: jax.ShapeDtypeStruct((1, 1, 1, 1), jnp.float32), param_specs)
    opt = optax.tree_map_params(tx, lambda _, s: s, jax.eval_shape(tx.init, dummy), zspecs,
                                transform_non_params=lambda _: P(),
                                is_leaf=lambda x: isinstance(x, P))
    out = {"master": zspecs, "opt": opt}
    if layout.error_feedback:
        out["ef"] = zspecs
    if layout.powersgd is not None:
        out["psgd_q"] = jax.tree.map(_q_spec, param_specs)
    return out


def abstract_state(params, param_specs, mesh, tx, layout: Layout):
    """The state as jax.ShapeDtypeStruct with shardings (checkpoint restore target).
    `params`: the global working params, arrays or ShapeDtypeStruct."""
    master = _state_leaves(params, param_specs, mesh, layout, lambda c, d: c)
    state = {"master": master, "opt": jax.eval_shape(tx.init, master)}
    if layout.error_feedback:
        state["ef"] = _state_leaves(params, param_specs, mesh, layout, lambda c, d: d * c)
    if layout.powersgd is not None:
        state["psgd_q"] = _q_leaves(params, param_specs, mesh, layout.powersgd.rank)
    specs = state_specs(param_specs, tx, layout)
    return jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, s)),
        state, specs)


def _own_slice(param, multiple, data_axes):
    """Local block -> this data rank's float32 slice, as (1, 1, 1, c)."""
    d = lax.axis_size(data_axes)
    c = shard_len(param.size, d, multiple)
    flat = jnp.pad(param.reshape(-1).astype(jnp.float32), (0, d * c - param.size))
    own = lax.dynamic_slice_in_dim(flat, lax.axis_index(data_axes) * c, c)
    return own.reshape(1, 1, 1, c)


def init_state(params, param_specs, mesh, tx, layout: Layout):
    """The state dict, created in its shardings: master = exact float32 slices of
    `params` (global working params), opt = tx.init(master), ef = zeros,
    psgd_q = standard normal from powersgd.Q_SEED (the same on every data rank)."""
    multiple = layout.multiple
    specs = state_specs(param_specs, tx, layout)
    axes = tuple(layout.data_axes)
    slicer = jax.shard_map(lambda p: jax.tree.map(lambda x: _own_slice(x, multiple, axes), p),
                           mesh=mesh, in_specs=(param_specs,), out_specs=specs["master"])
    master = jax.jit(slicer)(params)
    sharding = lambda s: NamedSharding(mesh, s)
    state = {"master": master,
             "opt": jax.jit(tx.init, out_shardings=jax.tree.map(sharding, specs["opt"]))(master)}
    if "ef" in specs:
        shapes = abstract_state(params, param_specs, mesh, tx, layout)["ef"]
        state["ef"] = jax.jit(lambda: jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), shapes),
                              out_shardings=jax.tree.map(lambda a: a.sharding, shapes))()
    if "psgd_q" in specs:
        shapes = abstract_state(params, param_specs, mesh, tx, layout)["psgd_q"]
        state["psgd_q"] = jax.jit(lambda: powersgd.init_qs(shapes),
                                  out_shardings=jax.tree.map(lambda a: a.sharding, shapes))()
    return state


# --------------------------------------------------------------- the update

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


def _gather_params(master_leaves, p_leaves, plan, key, bucket_bytes):
    """(1, 1, 1, c) master shards -> working params: gathered over the data axes
    (invariant there; `datahops.gather`), un-padded, reshaped to the local param
    shapes and cast to their dtypes."""
    gathered = datahops.gather([m.reshape(-1) for m in master_leaves], plan, key, bucket_bytes)
    return [x[:p.size].reshape(p.shape).astype(p.dtype) for x, p in zip(gathered, p_leaves)]


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
        own, new_res = datahops.reduce_scatter(flats, res, plan, k_grad, bucket_bytes)
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
