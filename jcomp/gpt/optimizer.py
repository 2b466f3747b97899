"""AdamW (optax) with ZeRO-sharded state, compressed gradient reduction and
compressed parameter gathers.

Working parameters are sharded over 'tensor'/'pipeline' as their PartitionSpecs
say and replicated over 'data'. Everything the optimizer keeps is split once
more over 'data' (ZeRO): each leaf's local (tensor/pipeline) block is flattened
to length S and zero-padded to d*c, with

    c = ceil(S / d) rounded up to `layout_multiple(policy)`

(the codecs' row length, so no codec pads again); data rank r owns elements
[r*c, (r+1)*c). Outside `shard_map` the state is a dict of global arrays

    "master"  float32 master-parameter shards  (d, t', p', c)
    "opt"     the optax state of those shards   (d, t', p', c) per moment, scalars P()
    "ef"      error-feedback residuals          (d, t', p', d*c), only when
              `uses_error_feedback(policy)`
    "psgd_q"  PowerSGD right factors Q          (t', p', n, R), only when
              policy["data", "grad"] is a `powersgd.PowerSGD`: float32, one
              per tensor/pipeline block (n = its last dim, R = the rank),
              replicated over 'data'

with t' = t if the leaf is sharded over 'tensor' else 1 (p' likewise; d, t, p:
the mesh's axis sizes), laid out by `zero_spec`: inside `shard_map` a block is
(1, 1, 1, c) ((1, 1, 1, d*c) for "ef"). The residual is per-device state: each data rank keeps what its own full-length contribution
[d*c] still owes the sum, for stage 1 and stage 2 alike. The layout depends on
(d, t, p) and the policy's codecs; a checkpoint restores onto the same layout.

With a PowerSGD gradient policy, step 1 below is instead `powersgd.reduce_shards` of
each leaf's local block (stage 1 only: its factors are all-reduced, so every
rank gets the whole rank-R mean, of which it keeps slice r); its residual
lives in the first S entries of the leaf's "ef" buffer.

One step, inside the train step's `shard_map` (`apply_updates`):
  1. reduce the local gradients over 'data': reduce-scatter the padded [d*c]
     buffers (`cc.psum_scatter`, all leaves bucketed into a few messages) so
     rank r receives slice r, at stage 1 and 2 alike (an all-reduce would send
     twice the bytes for the same update); with the plan's grad_reduce codec
     (`grad_codec`) and error feedback when the policy asks for it; divide by d (each rank's loss
     is the mean over its own rows, so the global mean is the mean of the d);
  2. clip by the global norm: each leaf's squares are summed over 'data' and
     the axes its spec splits it over, so a replicated leaf counts once
     (optax.clip_by_global_norm would see only the local shard);
  3. optax update of the (1, 1, 1, c) shards, applied to the float32 master;
  4. all-gather the master over 'data' with the plan's param_gather codec,
     un-pad and cast: the new working params, invariant over 'data'. With a
     lossy param codec they are the decoded master (ZeRO++ qwZ); the float32
     master itself never passes through a codec.

The optimizer must be elementwise (Adam, decoupled weight decay, schedules):
it sees flat shards, not parameter shapes. The weight-decay mask is computed
from the full parameters beforehand (`decay_mask`).

At about 500 lines this module is one concept on purpose: the ZeRO layout
(shard lengths, specs, initial state) exists for the update that reads it,
and splitting them would put the layout's invariants and their one user in
two places.
"""
from __future__ import annotations

import math
import numbers

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jcomp import codecs
from jcomp import collectives as cc
from jcomp.collectives import powersgd
from jcomp.collectives.scope import message_scope
from jcomp.collectives.buckets import bucketed

# The names of the two messages this update sends in the step's plan
# (jcomp.gpt.messages), under which the byte meter reports them.
GRAD_REDUCE, PARAM_GATHER = "grad_reduce", "param_gather"

SHARD_AXES = ("tensor", "pipeline")  # the axes working params may be split over
NO_DECAY_NAMES = ("bias", "scale")


# ---------------------------------------------------------- hyperparameters

def _number(name, value, *, integer=False):
    kinds = numbers.Integral if integer else numbers.Real
    if isinstance(value, bool) or not isinstance(value, kinds):
        raise TypeError(f"{name} must be {'an int' if integer else 'a number'}; got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite; got {value}")
    return value


def _check(name, value, ok: bool, allowed: str):
    if not ok:
        raise ValueError(f"{name} must be {allowed}; got {value}")


def make_schedule(*, lr, warmup_steps, total_steps, min_lr_ratio=0.0) -> optax.Schedule:
    """Linear warm-up from 0 to `lr` over `warmup_steps`, then cosine decay to
    `min_lr_ratio * lr` at `total_steps` (constant after). ValueError names a bad field."""
    _check("lr", _number("lr", lr), lr > 0, "> 0")
    _number("warmup_steps", warmup_steps, integer=True)
    _number("total_steps", total_steps, integer=True)
    _check("total_steps", total_steps, total_steps > 0, "> 0")
    _check("warmup_steps", warmup_steps, 0 <= warmup_steps < total_steps,
           f">= 0 and < total_steps ({total_steps})")
    _number("min_lr_ratio", min_lr_ratio)
    _check("min_lr_ratio", min_lr_ratio, 0 <= min_lr_ratio <= 1, "in [0, 1]")
    return optax.warmup_cosine_decay_schedule(
        0.0, lr, int(warmup_steps), int(total_steps), end_value=min_lr_ratio * lr)


OPTIMIZERS = ("adamw", "sgd")


def make_tx(*, lr, warmup_steps, total_steps, min_lr_ratio=0.0, b1=0.9, b2=0.95, eps=1e-8,
            weight_decay=0.0, decay_mask=None, name="adamw") -> optax.GradientTransformation:
    """AdamW as optax.chain(scale_by_adam, add_decayed_weights(mask), scale_by_learning_rate);
    name="sgd" puts optax.trace(b1) (heavy-ball momentum; b2 and eps unused) in
    scale_by_adam's place: a linear optimizer, under which error feedback's
    delayed gradient adds up to the gradients it delayed.

    decay_mask: pytree of bools shaped like the params (see `decay_mask`) or None
    (decay every leaf). Clipping is not part of it: under sharding optax would
    only see the local norm; `apply_updates` clips by the global one.
    """
    if name not in OPTIMIZERS:
        raise ValueError(f"name={name!r}; allowed: {', '.join(OPTIMIZERS)}")
    schedule = make_schedule(lr=lr, warmup_steps=warmup_steps, total_steps=total_steps,
                             min_lr_ratio=min_lr_ratio)
    for field, value in (("b1", b1), ("b2", b2)):
        _check(field, _number(field, value), 0 <= value < 1, "in [0, 1)")
    # eps > 0 keeps the zero padding of every shard at exactly 0 (0 / eps), never NaN.
    _check("eps", _number("eps", eps), eps > 0, "> 0")
    _check("weight_decay", _number("weight_decay", weight_decay), weight_decay >= 0, ">= 0")
    return optax.chain(
        optax.scale_by_adam(b1=b1, b2=b2, eps=eps) if name == "adamw" else optax.trace(decay=b1),
        optax.add_decayed_weights(weight_decay, decay_mask),
        optax.scale_by_learning_rate(schedule),
    )


def step_count(zstate):
    """The number of updates applied so far: the optax state's first `count`
    (every optax transformation with a count advances it once per update)."""
    found = optax.tree_utils.tree_get_all_with_path(zstate["opt"], "count")
    if not found:
        raise ValueError("the optimizer state has no 'count' to number the steps by")
    return found[0][1]


def _leaf_name(path) -> str:
    last = path[-1] if path else None
    for attr in ("key", "name", "idx"):
        if hasattr(last, attr):
            return str(getattr(last, attr))
    return ""


def decay_mask(params):
    """True where weight decay applies. No decay for LayerNorm scales and biases:
    leaves whose name is 'bias'/'scale' or ends in '_bias'/'_scale' (this catches
    stacked per-layer vectors of shape [N, D]), and any leaf of ndim <= 1.
    `params` may hold arrays or jax.ShapeDtypeStruct (only shapes are read)."""

    def keep(path, leaf):
        name = _leaf_name(path)
        named = name in NO_DECAY_NAMES or name.endswith(tuple("_" + n for n in NO_DECAY_NAMES))
        return not (named or len(leaf.shape) <= 1)

    return jax.tree_util.tree_map_with_path(keep, params)


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


def zero_spec(spec) -> P:
    """PartitionSpec of a (D, T', P', c) state leaf for a param with `spec`."""
    axes = _spec_axes(spec)
    return P("data", *(a if a in axes else None for a in SHARD_AXES), None)


def zero_specs(param_specs):
    """`zero_spec` of every leaf of `param_specs`."""
    return jax.tree.map(zero_spec, param_specs)


def grad_codec(policy):
    """policy["data", "grad"] as a codec object (codecs.parse passes a
    `powersgd.PowerSGD` through as it is)."""
    return codecs.parse(policy["data", "grad"])


def _powersgd(policy):
    """The PowerSGD gradient codec of `policy`, or None."""
    spec = policy["data", "grad"]
    return spec if isinstance(spec, powersgd.PowerSGD) else None


def layout_multiple(policy) -> int:
    """Shard length multiple: rows of the grad and param codecs code without padding."""
    return math.lcm(grad_codec(policy).row_multiple,
                    codecs.parse(policy["data", "param"]).row_multiple)


def shard_len(n_local: int, n_data: int, multiple: int) -> int:
    """c = ceil(n_local / n_data) rounded up to `multiple` (at least `multiple`)."""
    per_rank = -(-n_local // n_data)
    return max(-(-per_rank // multiple) * multiple, multiple)


def check_stage(policy, stage) -> None:
    """ValueError where the policy's gradient codec cannot run at this ZeRO stage."""
    psgd = _powersgd(policy)
    if psgd is not None and stage != 1:
        raise ValueError("powersgd needs optim.zero_stage=1: its factors are all-reduced, "
                         f"not reduce-scattered; got stage={stage} with data.grad={psgd}")


def uses_error_feedback(policy) -> bool:
    """Whether the state carries residuals: the policy asks and the grad codec is lossy."""
    return bool(policy.error_feedback) and grad_codec(policy).kind != "identity"


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


def _state_leaves(params, param_specs, mesh, policy, width):
    """Per leaf, a float32 ShapeDtypeStruct (D, T', P', width(c, D)) of its state."""
    sizes = dict(mesh.shape)
    d, multiple = sizes["data"], layout_multiple(policy)

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

def state_specs(param_specs, tx, policy):
    """PartitionSpecs of the state dict, for shard_map in/out specs and shardings."""
    zspecs = zero_specs(param_specs)
    dummy = jax.tree.map(lambda _: jax.ShapeDtypeStruct((1, 1, 1, 1), jnp.float32), param_specs)
    opt = optax.tree_map_params(tx, lambda _, s: s, jax.eval_shape(tx.init, dummy), zspecs,
                                transform_non_params=lambda _: P(),
                                is_leaf=lambda x: isinstance(x, P))
    out = {"master": zspecs, "opt": opt}
    if uses_error_feedback(policy):
        out["ef"] = zspecs
    if _powersgd(policy) is not None:
        out["psgd_q"] = jax.tree.map(_q_spec, param_specs)
    return out


def abstract_state(params, param_specs, mesh, tx, policy):
    """The state as jax.ShapeDtypeStruct with shardings (checkpoint restore target).
    `params`: the global working params, arrays or ShapeDtypeStruct."""
    master = _state_leaves(params, param_specs, mesh, policy, lambda c, d: c)
    state = {"master": master, "opt": jax.eval_shape(tx.init, master)}
    if uses_error_feedback(policy):
        state["ef"] = _state_leaves(params, param_specs, mesh, policy, lambda c, d: d * c)
    if _powersgd(policy) is not None:
        state["psgd_q"] = _q_leaves(params, param_specs, mesh, _powersgd(policy).rank)
    specs = state_specs(param_specs, tx, policy)
    return jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, s)),
        state, specs)


def _own_slice(param, multiple):
    """Local block -> this data rank's float32 slice, as (1, 1, 1, c)."""
    d = lax.axis_size("data")
    c = shard_len(param.size, d, multiple)
    flat = jnp.pad(param.reshape(-1).astype(jnp.float32), (0, d * c - param.size))
    own = lax.dynamic_slice_in_dim(flat, lax.axis_index("data") * c, c)
    return own.reshape(1, 1, 1, c)


def init_state(params, param_specs, mesh, tx, policy):
    """The state dict, created in its shardings: master = exact float32 slices of
    `params` (global working params), opt = tx.init(master), ef = zeros,
    psgd_q = standard normal from powersgd.Q_SEED (the same on every data rank)."""
    multiple = layout_multiple(policy)
    specs = state_specs(param_specs, tx, policy)
    slicer = jax.shard_map(lambda p: jax.tree.map(lambda x: _own_slice(x, multiple), p),
                           mesh=mesh, in_specs=(param_specs,), out_specs=specs["master"])
    master = jax.jit(slicer)(params)
    sharding = lambda s: NamedSharding(mesh, s)
    state = {"master": master,
             "opt": jax.jit(tx.init, out_shardings=jax.tree.map(sharding, specs["opt"]))(master)}
    if "ef" in specs:
        shapes = abstract_state(params, param_specs, mesh, tx, policy)["ef"]
        state["ef"] = jax.jit(lambda: jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), shapes),
                              out_shardings=jax.tree.map(lambda a: a.sharding, shapes))()
    if "psgd_q" in specs:
        shapes = abstract_state(params, param_specs, mesh, tx, policy)["psgd_q"]
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


def _check_grad(name, g, axes):
    varying = jax.typeof(g).mat.varying
    if "data" not in varying:
        raise ValueError(
            f"grads{name}: must be the local gradient, varying over 'data'; cast the params "
            "with lax.pcast(p, 'data', to='varying') before differentiating so that no "
            "automatic full-precision psum runs")
    extra = set(varying) - {"data", *axes}
    if extra:
        raise ValueError(f"grads{name}: varies over {sorted(extra)} but its param spec only "
                         f"splits it over {axes}; reduce those partial sums first")


def _padded_grads(grads, p_leaves, masters, axes, multiple):
    """Local gradients -> zero-padded flat [D*c] buffers, after checking their
    varying axes and that the state fits the layout."""
    named = jax.tree_util.tree_flatten_with_path(grads)[0]
    d, flats = lax.axis_size("data"), []
    for (path, g), p, m, ax in zip(named, p_leaves, masters, axes):
        name = jax.tree_util.keystr(path)
        _check_grad(name, g, ax)
        c = shard_len(p.size, d, multiple)
        if g.shape != p.shape or m.shape != (1, 1, 1, c):
            raise ValueError(f"grads{name}: shape {g.shape}, param {p.shape} and master shard "
                             f"{m.shape} do not fit the layout (expected (1, 1, 1, {c}))")
        flats.append(jnp.pad(g.reshape(-1), (0, d * c - g.size)))
    return flats


def _lax_buckets(flats, send, to_rows, from_rows, bucket_bytes):
    """Uncompressed, the ZeRO buffers travel as a few buckets (as DDP's do) rather
    than a message per leaf: jcomp.collectives sends "none" leaf by leaf, as lax
    does, since the order of a sum over a concatenated buffer is the backend's.
    The optimizer asks for the buckets here, where no gradient flows through them."""
    return bucketed(flats, lambda f: (f, ("data",)), to_rows, from_rows,
                    lambda buf, axes, key: send(buf), None, bucket_bytes)


def _gather_params(master_leaves, p_leaves, codec, key, bucket_bytes):
    """(1, 1, 1, c) master shards -> working params: gathered over 'data' (invariant
    there), un-padded, reshaped to the local param shapes and cast to their dtypes."""
    flats = [m.reshape(-1) for m in master_leaves]
    with message_scope(PARAM_GATHER):
        if codecs.parse(codec).kind == "identity":
            d = lax.axis_size("data")
            gathered = _lax_buckets(
                flats, lambda buf: lax.all_gather(buf, "data", axis=0, tiled=True,
                                                  to="invarying"),
                lambda f: f[None], lambda out, f: out.reshape(d * f.shape[0]), bucket_bytes)
        else:
            gathered = cc.all_gather(flats, "data", tiled=True, to="invarying", codec=codec,
                                     key=key, rows="flat", bucket_bytes=bucket_bytes)
    return [x[:p.size].reshape(p.shape).astype(p.dtype) for x, p in zip(gathered, p_leaves)]


def _reduce(flats, res, codec, key, bucket_bytes):
    """Sums the [D*c] buffers over 'data' -> (this rank's [c] slices, new residuals or None).

    A reduce-scatter at either ZeRO stage: each rank keeps only its slice of the sum,
    so an all-reduce would send twice the bytes for the same update."""
    kw = dict(scatter_dimension=0, tiled=True, codec=codec, key=key, rows="flat",
              bucket_bytes=bucket_bytes)
    with message_scope(GRAD_REDUCE):
        if res is None and codecs.parse(codec).kind == "identity":
            d = lax.axis_size("data")
            return _lax_buckets(
                flats, lambda buf: lax.psum_scatter(buf, "data", scatter_dimension=0, tiled=True),
                lambda f: f.reshape(d, -1), lambda out, f: out.reshape(-1), bucket_bytes), None
        if res is not None:
            return cc.psum_scatter_ef(flats, res, "data", **kw)
        return cc.psum_scatter(flats, "data", **kw), None


def _check_args(stage, clip_norm):
    if stage not in (1, 2) or isinstance(stage, bool):
        raise ValueError(f"stage must be 1 or 2; got {stage!r}")
    _check("clip_norm", _number("clip_norm", clip_norm), clip_norm >= 0, ">= 0 (0 disables)")


def _sent(policy, grad_codec, param_codec):
    """The codecs to send (the layout policy's where None). A phase may drop
    PowerSGD but not bring in another one: Q's shape is the layout's."""
    g = codecs.parse(policy["data", "grad"] if grad_codec is None else grad_codec)
    p = codecs.parse(policy["data", "param"] if param_codec is None else param_codec)
    if g.kind == "lowrank" and g != _powersgd(policy):
        raise ValueError(f"grad_codec={g} needs the PowerSGD state of that codec; "
                         f"the layout policy has data.grad={policy['data', 'grad']}")
    if p.kind in ("lowrank", "learned"):
        raise ValueError(f"param_codec={p}: parameter gathers take a byte codec")
    return g, p


def apply_updates(grads, params, zstate, *, tx, policy, param_specs, stage, clip_norm=0.0,
                  grad_codec=None, param_codec=None, step=None, key=None,
                  bucket_bytes=cc.DEFAULT_BUCKET_BYTES):
    """One ZeRO step inside shard_map over ('data', 'tensor', 'pipeline').

    grads:   local gradients, local param shapes, varying over 'data' (this rank's
             mean loss over its own rows) and over the axes of each param's spec.
    params:  local working params (shapes and dtypes of the result).
    zstate:  local blocks of the state dict (see the module docstring).
    stage:   1 or 2 (ZeRO); both reduce-scatter plain gradients; PowerSGD, whose
             factors are all-reduced, needs 1 (ValueError otherwise).
    policy:  decides the state layout (residuals, PowerSGD Q, shard padding).
    grad_codec, param_codec: what the gradient reduction and the parameter
             gather send (the message plan's grad_reduce and param_gather);
             None: `policy`'s data.grad / data.param. Residuals pass a lossless
             codec exactly; a gradient codec other than the layout's PowerSGD
             leaves Q as it was.
    `key` (folded with `step` when given) feeds codecs that draw randomness.
    bucket_bytes: the gradient reduction and the parameter gather send the leaves
             in flat buffers of at most this many bytes (`jcomp.collectives`).
    -> (new params invariant over 'data', new zstate,
        {"grad_norm": global pre-clip norm of the mean gradient,
         "ef_norm": global norm of the new residuals (each rank's, in summed-
                    gradient units, before the /D), when error feedback is on}).
    A non-finite gradient gives a non-finite grad_norm and update, never a finite one.
    """
    _check_args(stage, clip_norm)
    ef_on, psgd = uses_error_feedback(policy), _powersgd(policy)
    for name, on in (("ef", ef_on), ("psgd_q", psgd is not None)):
        if on != (name in zstate):
            raise ValueError(f"zstate[{name!r}] must be {'present' if on else 'absent'} for "
                             f"policy {policy}; build the state with init_state for this policy")
    check_stage(policy, stage)
    g_codec, param_codec = _sent(policy, grad_codec, param_codec)
    if key is not None and step is not None:
        key = jax.random.fold_in(key, step)
    k_grad, k_param = (None, None) if key is None else tuple(jax.random.split(key))

    treedef = jax.tree.structure(grads)
    axes = [_spec_axes(s) for s in treedef.flatten_up_to(param_specs)]
    p_leaves = treedef.flatten_up_to(params)
    masters = treedef.flatten_up_to(zstate["master"])
    flats = _padded_grads(grads, p_leaves, masters, axes, layout_multiple(policy))
    res_leaves = treedef.flatten_up_to(zstate["ef"]) if ef_on else None
    res = [r.reshape(-1) for r in res_leaves] if ef_on else None
    new_qs = None
    if isinstance(g_codec, powersgd.PowerSGD):
        q_leaves = treedef.flatten_up_to(zstate["psgd_q"])
        with message_scope(GRAD_REDUCE):
            own, new_qs, new_res = powersgd.reduce_shards(flats, p_leaves, q_leaves, res, psgd,
                                                          k_grad)
    else:
        own, new_res = _reduce(flats, res, g_codec, k_grad, bucket_bytes)
        d = lax.axis_size("data")
        own = [o.astype(jnp.float32) / d for o in own]
    g_shards = [o.reshape(m.shape) for o, m in zip(own, masters)]
    norm_axes = [("data",) + ax for ax in axes]
    grad_norm = _norm_global(g_shards, norm_axes)
    if clip_norm > 0:
        # NaN norm -> NaN scale: a bad step stays visible to the caller's guard.
        g_shards = [g * jnp.minimum(1.0, clip_norm / grad_norm) for g in g_shards]

    master_tree = jax.tree.unflatten(treedef, masters)
    updates, new_opt = tx.update(jax.tree.unflatten(treedef, g_shards), zstate["opt"], master_tree)
    new_master = optax.apply_updates(master_tree, updates)
    new_params = _gather_params(treedef.flatten_up_to(new_master), p_leaves, param_codec, k_param,
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
