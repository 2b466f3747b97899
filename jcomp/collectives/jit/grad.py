"""Compressed gradient reduction for `jax.jit` programs (MaxText, nanoDO, Levanter).

Such a program has no `shard_map`: parameters carry `NamedSharding`s over
automatic mesh axes, the batch is split over the batch axes ("data", and
MaxText's "fsdp"), and XLA inserts the gradient reduction itself, in full
precision, before any user code sees the gradients (so `cc.pmean` on finished
gradients compresses nothing: they are already summed). This module takes that
reduction over, in one call in place of `jax.value_and_grad`:

    grads_of = cc.value_and_grad(loss_fn, mesh=mesh, param_specs=specs,
                                 mean_over="examples", codec="int8")
    loss, grads = grads_of(params, batch)          # inside the user's jax.jit

How. A `shard_map` manual over the batch axes only (`data_axes`) runs
`loss_fn` on each rank's share of the batch; the other axes stay automatic, so
the model's tensor parallelism is XLA's as written. Parameters split over a
batch axis (FSDP) are all-gathered at the start with `param_codec` and their
gradients reduce-scattered back with `codec`; the rest are all-reduced with
`codec` (with "none", the fully replicated leaves leave the map per rank and
XLA sums them, so it lays the sums out as in the plain program). Both run in a
second `shard_map` nested in the first, manual over the
parameters' own axes, so no leaf is gathered over an automatic axis; leaves of
one dtype and layout share flat buckets on block boundaries (`rows="flat"`),
so one collective carries many leaves and no leaf's scale is set by another.

What changes with the per-rank view, and how the program stays the plain one:
- The loss is normalised per rank. `mean_over` (required) says how the global
  loss is made of the ranks': "examples" (a mean over the batch's examples,
  `jnp.mean`), a function `count(batch)` (a sum over the batch divided by
  `count(batch)`, e.g. the non-padding tokens: the global loss divides by the
  global count), or "sum". Each rank's loss is scaled by its share before the
  backward pass, so the gradient is the plain step's.
- `aux` (required with `has_aux`) says per leaf how ranks combine: "sum"
  (in the leaf's dtype: an int count stays an int), "mean", "weighted" (as the
  loss), "max", "min".
- Sharding constraints in the model that name the batch axes lose those names
  inside the map (each rank holds its share); the rest of each constraint holds.

With `codec="none"` the reductions are lax's; the bytes per axis are the plain
program's or fewer, and the values agree to rounding: XLA compiles the per-rank
forward and backward on their own and orders float operations its own way.
"""
from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from jcomp.collectives import arguments, ops
from jcomp.collectives.jit import auxvalues as aux_lib, bytecheck, specs as jitspecs, unreduced
from jcomp.collectives.jit.constraints import batch_constraints
from jcomp.collectives.jit.reduce import gather, reduce
from jcomp.collectives.jit.specs import scatter_specs  # noqa: F401  (public)

__all__ = ["value_and_grad", "scatter_specs", "gather_params"]

def _check_mesh(mesh, data_axes):
    if not isinstance(mesh, jax.sharding.Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh; got {type(mesh).__name__}")
    for a in data_axes:
        if a not in mesh.axis_names:
            raise ValueError(f"data_axes: {a!r} is not an axis of the mesh {mesh.axis_names}")


def _check_mean_over(mean_over):
    if callable(mean_over) or mean_over in ("examples", "sum"):
        return
    raise ValueError(f"mean_over must be 'examples', 'sum' or a function count(batch) -> "
                     f"the number of items the loss is a mean over; got {mean_over!r}")


def value_and_grad(loss_fn, *, mesh, mean_over=None, param_specs=None, rules=None,
                   data_axes="data", codec="none", param_codec="none", batch_spec=None,
                   microbatches=1, scatter=False, has_aux=False, aux=None, rows="flat",
                   bucket_bytes=None, check_bytes=True):
    """`jax.value_and_grad(loss_fn)` with the reduction over the batch axes sent with
    `codec`. -> fn(params, batch, key=None) -> (loss, grads), or ((loss, aux),
    grads) with `has_aux`; inside `jax.jit`, or eagerly (then jitted).

    loss_fn(params, batch) -> scalar (with `has_aux`, (scalar, aux)), written
    for the whole batch as for `jax.value_and_grad`; the batch is an argument
    (not closed over), its leaves split over `data_axes` along `batch_spec`
    (default: their first dimension).
    mean_over: "examples" | "sum" | count(batch) -> scalar; see the module doc.
    param_specs: the parameters' mesh PartitionSpecs (a tree with the
    parameters' structure, flax's boxes as leaves), logical ones with `rules`,
    or None to read them from flax's boxed parameters. A spec may split a leaf
    over `data_axes` (FSDP): it is gathered with `param_codec` and its gradient
    comes back reduce-scattered, with the parameter's own spec.
    data_axes: every mesh axis the batch is split over (MaxText: ("data", "fsdp")).
    codec: the gradients' codec, or a codec per batch axis ({"dcn": "int4:rot"}:
    coded across that hop only, the others raw; see `hops`); "none" is lax's
    reduction. key: for codecs that draw (`:sr`, randk). microbatches=k: k
    gradients accumulated in float32, one reduction. scatter=True: each comes back
    reduce-scattered over the data axes it does not use (`scatter_specs`), for
    an optimizer state sharded over them (`gather_params` brings them back).
    The loss is float32; the gradients have the parameters' dtypes and boxes.
    check_bytes: compile the plain gradient program beside this one the first
    time a signature is traced, and warn (`ExtraBytesWarning`) naming each mesh
    axis on which this one sends more (`bytecheck`; two more compiles).

    On a mesh whose batch axes are Explicit the loss runs as written, in the
    global view (`unreduced`): `mean_over`, `aux`, `param_specs` and
    `batch_spec` are not needed there (the parameters' and the batch's types
    carry their shardings; given, param_specs must agree with them)."""
    data_axes = arguments.axes_of(data_axes)
    _check_mesh(mesh, data_axes)
    arguments.check_bool("check_bytes", check_bytes)
    explicit = _explicit(mesh, data_axes)
    if mean_over is None and not explicit:
        raise TypeError("value_and_grad() needs mean_over= on a mesh of Auto batch axes: "
                        "how the global loss is made of the ranks' ('examples', 'sum' or "
                        "count(batch)); see the module doc")
    if mean_over is not None:
        _check_mean_over(mean_over)
    aux_rules = None if explicit and aux is None else aux_lib.rules(aux, has_aux)
    codec, param_codec = (_read(name, c, data_axes) for name, c in
                          (("codec", codec), ("param_codec", param_codec)))
    if not isinstance(microbatches, int) or isinstance(microbatches, bool) or microbatches < 1:
        raise ValueError(f"microbatches must be a positive int; got {microbatches!r}")
    arguments.check_rows(rows)
    bucket = {} if bucket_bytes is None else {"bucket_bytes": bucket_bytes}
    if explicit:
        if microbatches != 1:
            raise ValueError("microbatches: value_and_grad accumulates microbatches on meshes "
                             "of Auto batch axes only; with Explicit ones, accumulate the "
                             "unreduced gradients in your step (see docs/collectives.md)")
        if _coded(param_codec):
            raise ValueError("param_codec: on Explicit batch axes the program gathers the "
                             "parameters split over them itself, as written; leave it 'none'")
        fn = unreduced.value_and_grad(loss_fn, mesh, data_axes, has_aux, codec, scatter,
                                      rows, bucket, param_specs, rules)
        return arguments.traced_or_jitted(
            bytecheck.checked(fn, loss_fn, has_aux, mesh, unreduced.typed_specs)
            if check_bytes else fn)
    rest = tuple(a for a in mesh.axis_names if a not in data_axes)
    data_spec = data_axes if len(data_axes) > 1 else data_axes[0]
    value_of = loss_fn if has_aux else lambda p, b: (loss_fn(p, b), ())

    def fn(params, batch, key=None):
        if not jax.tree.leaves(batch):
            raise ValueError(
                "value_and_grad: the batch has no arrays; pass it as loss_fn's second "
                "argument (loss_fn(params, batch)) so each rank gets its share. A loss that "
                "closes over its batch (nanoDO's get_loss_fn(in_BxL, ...)) would run on the "
                "whole batch on every rank: wrap it, lambda p, b: get_loss_fn(b, ...)(p)")
        specs = jitspecs.check(mesh, data_axes, params, param_specs, rules)
        leaves, treedef = jax.tree.flatten(params)
        outs = [jitspecs.scatter_spec(s, jnp.shape(x), data_axes, mesh.shape) if scatter else s
                for x, s in zip(leaves, specs)]
        b_spec = (jax.tree.map(lambda _: P(data_spec), batch) if batch_spec is None
                  else batch_spec)

        # "none" leaves replicated leaves' sums to XLA (each rank's gradient leaves
        # the map on a new leading axis): XLA lays a sum out as the plain program
        # does, e.g. each tensor rank reducing half of a LayerNorm scale; inside the
        # map it would be all-reduced whole, more bytes over data than plain.
        to_xla = [not _coded(codec) and not jitspecs.axes_in(o) for o in outs]
        ours = [i for i, x in enumerate(to_xla) if not x]

        def local(shards, batch, k):
            k = None if key is None else k
            gk, rk = (None, None) if k is None else jax.random.split(k)
            full = _nested(rest, specs, specs, lambda ls, kk: gather(
                ls, specs, data_axes, param_codec, kk, rows, bucket), shards, gk)
            p_var = treedef.unflatten(ops.vary(full, data_axes))  # no automatic psum
            (loss, aux_v), grads = _accumulate(value_of, p_var, batch, microbatches,
                                               data_axes, mean_over, aux_rules)
            grads = [g[None] if x else g for g, x in zip(jax.tree.leaves(grads), to_xla)]
            mine = [outs[i] for i in ours]
            reduced = _nested(rest, [specs[i] for i in ours], mine, lambda gs, kk: reduce(
                gs, mine, data_axes, codec, kk, rows, bucket), [grads[i] for i in ours], rk)
            for i, g in zip(ours, reduced):
                grads[i] = g
            return ((loss, aux_v) if has_aux else loss), grads

        k = jnp.zeros((), jnp.uint32) if key is None else key
        outer = jax.shard_map(
            local, mesh=mesh,
            in_specs=([jitspecs.only(s, data_axes) for s in specs], b_spec, P()),
            out_specs=(P(), [P(data_spec) if x else jitspecs.only(o, data_axes)
                             for o, x in zip(outs, to_xla)]),
            axis_names=frozenset(data_axes))
        with batch_constraints(data_axes, specs):
            value, grads = outer(leaves, batch, k)
        grads = [g.sum(0) if x else g for g, x in zip(grads, to_xla)]
        return value, treedef.unflatten(grads)

    def shardings_of(params, batch):
        b_spec = P(data_spec) if batch_spec is None else batch_spec
        per_leaf = jax.tree.map(lambda s, sub: jax.tree.map(lambda _: s, sub), b_spec, batch,
                                is_leaf=lambda s: isinstance(s, P))
        return jitspecs.check(mesh, data_axes, params, param_specs, rules), per_leaf

    return arguments.traced_or_jitted(
        bytecheck.checked(fn, loss_fn, has_aux, mesh, shardings_of) if check_bytes else fn)


def _read(name, codec, data_axes):
    """`codec` (a spec, a codec, or {batch axis: either}) read once, at the door:
    everything below takes codec objects."""
    out = {}
    for axis, one in (codec.items() if isinstance(codec, Mapping) else [(None, codec)]):
        where = name if axis is None else f"{name}[{axis!r}]"
        if axis is not None and axis not in data_axes:
            raise ValueError(f"{name} names the axis {axis!r}, not one of data_axes "
                             f"{data_axes} (axes not named travel raw)")
        try:
            out[axis] = arguments.parse(one)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
        if out[axis].kind not in ("identity", "dense", "sparse"):
            raise ValueError(f"{where} {one!r}: value_and_grad takes a byte codec (none, "
                             "bf16, fp16, fp8, int8/int4/int2, topk, randk)")
    return out if isinstance(codec, Mapping) else out[None]


def _coded(codec) -> bool:
    """Whether a read codec (or any of a dict's) codes anything."""
    return any(c.kind != "identity" for c in (codec.values() if isinstance(codec, Mapping)
                                                else [codec]))


def _explicit(mesh, data_axes) -> bool:
    """True where every batch axis is Explicit (the unreduced route), False where
    every one is Auto (the per-rank map); a mix is refused."""
    kinds = dict(zip(mesh.axis_names, mesh.axis_types))
    explicit = [a for a in data_axes if kinds[a] == AxisType.Explicit]
    if explicit and len(explicit) != len(data_axes):
        raise ValueError(f"data_axes {data_axes}: {explicit} are Explicit mesh axes and the "
                         "others are not; make the batch axes all Explicit or all Auto")
    return bool(explicit)


def _nested(rest, in_specs, out_specs, body, leaves, key):
    """body(leaves, key) in a map manual over the other axes too, so that each
    device codes its own shards and nothing is gathered over an automatic axis.
    The key (or None) enters as an argument: a value closed over from the outer
    map lives on another mesh."""
    if not rest:
        return body(leaves, key)
    keys = () if key is None else (key,)
    return jax.shard_map(
        lambda ls, *k: body(ls, k[0] if k else None), mesh=jax.sharding.get_abstract_mesh(),
        in_specs=([jitspecs.only(s, rest) for s in in_specs],) + (P(),) * len(keys),
        out_specs=[jitspecs.only(s, rest) for s in out_specs],
        axis_names=frozenset(rest))(leaves, *keys)


def _scales(batch, k, axes, mean_over):
    """Each microbatch's share of the global loss: [k] float32, invariant of params."""
    if mean_over == "sum":
        return jnp.ones((k,), jnp.float32)
    if mean_over == "examples":
        return jnp.full((k,), 1.0 / (k * lax.axis_size(axes)), jnp.float32)
    counts = jnp.stack([jnp.asarray(mean_over(mb), jnp.float32) for mb in batch])
    return counts / lax.psum(jnp.sum(counts), axes)


def _accumulate(value_of, params, batch, k, axes, mean_over, aux_rules):
    """((loss, aux), this rank's gradients) of its share of the global loss: each
    microbatch's loss scaled by its share before the backward pass, gradients
    summed in float32 over k > 1 microbatches (lax.scan) and cast back."""
    if k > 1:
        for x in jax.tree.leaves(batch):
            if x.shape[0] % k:
                raise ValueError(f"microbatches={k} must divide each data rank's batch; a "
                                 f"batch leaf has {x.shape[0]} rows per rank")
    micro = jax.tree.map(lambda x: x.reshape((k, x.shape[0] // k) + x.shape[1:]), batch)
    scale_K = _scales([jax.tree.map(lambda x: x[i], micro) for i in range(k)], k, axes,
                      mean_over)

    def scaled(p, mb, s):
        loss, aux = value_of(p, mb)
        # Python scalars in aux (MaxText's moe_lb_loss = 0.0) become arrays, as a
        # jit's outputs do in the plain step.
        return s * jnp.asarray(loss, jnp.float32), jax.tree.map(jnp.asarray, aux)

    grad_of = jax.value_and_grad(scaled, has_aux=True)
    if k == 1:
        (loss, aux), grads = grad_of(params, batch, scale_K[0])
        aux = aux_lib.local(aux_rules, [aux], scale_K)
    else:
        f32 = lambda tree: jax.tree.map(lambda v: v.astype(jnp.float32), tree)
        first = jax.tree.map(lambda x: x[0], micro)
        shapes = jax.eval_shape(lambda: f32(grad_of(params, first, scale_K[0])[1]))
        zeros = jax.tree.map(lambda s: arguments.vary(jnp.zeros(s.shape, s.dtype), axes), shapes)

        def body(acc, xs):
            mb, s = xs
            (loss, aux), g = grad_of(params, mb, s)
            return jax.tree.map(jnp.add, acc, f32(g)), (loss, aux)

        total, (loss_K, aux_K) = lax.scan(body, zeros, (micro, scale_K))
        loss = jnp.sum(loss_K)
        grads = jax.tree.map(lambda g, p: g.astype(p.dtype), total, params)
        aux = aux_lib.local(aux_rules, [jax.tree.map(lambda a: a[i], aux_K) for i in range(k)],
                         scale_K)
    return aux_lib.combine(loss, aux, aux_rules, axes, k), grads


def gather_params(shards, *, mesh, param_specs=None, rules=None, data_axes="data",
                  codec="none", rows="flat", bucket_bytes=None, key=None):
    """ZeRO's parameter all-gather for a jit program: parameter shards laid out as
    `scatter_specs(params, param_specs, mesh)` (the optimizer's update of the
    shards `value_and_grad(..., scatter=True)` returns) -> parameters with
    `param_specs`, gathered over the data axes they do not use, with `codec`.
    Keep the shards as the master copy: a lossy codec's gathered parameters are
    the decoded ones."""
    data_axes = arguments.axes_of(data_axes)
    _check_mesh(mesh, data_axes)
    codec = _read("codec", codec, data_axes)
    bucket = {} if bucket_bytes is None else {"bucket_bytes": bucket_bytes}
    specs = jitspecs.check(mesh, data_axes, shards, param_specs, rules)
    leaves, treedef = jax.tree.flatten(shards)
    ins = [jitspecs.scatter_spec(s, jnp.shape(x), data_axes, mesh.shape)
           for x, s in zip(leaves, specs)]
    # Gather only what scatter added: the spec's own data-axis splits stay.
    added = [jitspecs.only(i, set(jitspecs.axes_in(i)) - set(jitspecs.axes_in(s)))
             for i, s in zip(ins, specs)]
    moved_axes = tuple(data_axes)

    def body(ls, kk):
        k = None if key is None else kk
        return gather(ls, added, moved_axes, codec, k, rows, bucket)

    k = jnp.zeros((), jnp.uint32) if key is None else key
    run = jax.shard_map(body, mesh=mesh, in_specs=(ins, P()), out_specs=list(specs))
    return treedef.unflatten(run(leaves, k))
