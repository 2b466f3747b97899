"""The ZeRO state: what the optimizer keeps, laid out over the data axes
(jcomp.gpt.zero runs the step on it; zero re-exports every name here).

    layout = zero.for_plan(plan, stage=1)   # once per run, from the state's plan
    state = zero.init_state(params, param_specs, mesh, tx, layout)

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
`Layout`; a checkpoint restores onto the same layout. On a mesh whose data
axis is split (mesh.dcn_data > 1) d = |dcn| x |data| and the state is laid out
the same way over ('dcn', 'data'): data rank r = dcn_index * |data| + data_index.
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

from jcomp.collectives import powersgd

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
