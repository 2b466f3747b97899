"""Compressed gradient reduction for `jax.jit` programs (MaxText / Levanter style).

Such a program has no `shard_map`: parameters carry `NamedSharding`s over
automatic mesh axes ("model", "fsdp"), the batch is split over "data", and XLA
inserts the gradient all-reduce over "data" itself, in full precision, before
any user code sees the gradients (so `cc.pmean` on finished gradients
compresses nothing: they are already summed). This module takes that one
reduction over:

    grad_fn = cc.value_and_grad(loss_fn, mesh=mesh, param_specs=specs, codec="int8")
    loss, grads = grad_fn(params, batch)          # inside the user's jax.jit

Inside, a `shard_map` manual over the data axes only computes each data
rank's local gradient (the other axes stay automatic, so the model's own
tensor-parallel collectives are XLA's, unchanged), and a second `shard_map`
nested in it, manual over the parameters' own axes, reduces each device's
shard of each gradient with `jcomp.collectives`: no leaf is gathered over an
automatic axis, and leaves share flat buckets only on block boundaries
(`rows="flat"`: no leaf's scale is set by another). With `codec="none"` the
reduction is `lax.pmean`, the all-reduce XLA would have inserted, and the
bytes per axis are the plain program's; the values agree to the last bits
only, since XLA compiles the per-rank forward and backward inside the map on
their own and may fuse and order their float operations differently.

`microbatches=k` accumulates the k microbatches' gradients in float32 with a
`lax.scan` and reduces once per call, where XLA reduces inside the loop, once
per microbatch. `scatter=True` gives ZeRO's form: each gradient
reduce-scattered over data (`scatter_specs` says along which dimension), for
an optimizer state sharded over data; `gather_params` brings updated
parameter shards back with a codec of its own.

JAX's `unreduced`/`reduced` partition specs (an unreduced gradient with one
reduction left to the program) exist in this JAX only for Explicit mesh axes;
programs on Auto meshes, as MaxText's, get the same through the partial-manual
`shard_map` here.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from jcomp.collectives import kernels, ops

__all__ = ["value_and_grad", "scatter_specs", "gather_params"]


def _axes_in(spec) -> set:
    out = set()
    for part in (spec or ()):
        if part is None:
            continue
        out.update(part if isinstance(part, tuple) else (part,))
    return out


def _check_mesh(mesh, data_axes):
    if not isinstance(mesh, jax.sharding.Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh; got {type(mesh).__name__}")
    for a in data_axes:
        if a not in mesh.axis_names:
            raise ValueError(f"data_axes: {a!r} is not an axis of the mesh {mesh.axis_names}")


def _check(mesh, data_axes, param_specs, params):
    _check_mesh(mesh, data_axes)
    named = jax.tree_util.tree_flatten_with_path(params)[0]
    try:
        specs = jax.tree.structure(params).flatten_up_to(param_specs)
    except (TypeError, ValueError):
        raise ValueError("param_specs must have the parameters' tree structure, one "
                         "PartitionSpec per leaf") from None
    for (path, leaf), spec in zip(named, specs):
        if not isinstance(spec, P):
            raise TypeError(f"param_specs{jax.tree_util.keystr(path)}: a PartitionSpec; got "
                            f"{spec!r}")
        used = _axes_in(spec)
        if used & set(data_axes):
            raise ValueError(
                f"param_specs{jax.tree_util.keystr(path)}: {spec} splits the parameter over "
                f"the data axes {sorted(used & set(data_axes))}; value_and_grad reduces over "
                "them, so parameters must be replicated there (keep FSDP on its own axis)")
        unknown = used - set(mesh.axis_names)
        if unknown:
            raise ValueError(f"param_specs{jax.tree_util.keystr(path)}: {spec} names axes "
                             f"{sorted(unknown)} that the mesh {mesh.axis_names} lacks")
        if len(spec) > jnp.ndim(leaf):
            raise ValueError(f"param_specs{jax.tree_util.keystr(path)}: {spec} has more "
                             f"entries than the parameter's {jnp.ndim(leaf)} dimensions")
    return specs


def scatter_specs(params, param_specs, mesh, data_axes=("data",)):
    """The partition spec each gradient leaf has after `scatter=True`: its spec with
    the data axes added on the first dimension that is not split yet and that the
    data axes' size divides; a leaf with no such dimension stays whole,
    all-reduced (its spec unchanged)."""
    data_axes = kernels.axes_of(data_axes)
    d = 1
    for a in data_axes:
        d *= mesh.shape[a]
    specs = _check(mesh, data_axes, param_specs, params)
    leaves, treedef = jax.tree.flatten(params)
    out = []
    for leaf, spec in zip(leaves, specs):
        parts = list(spec) + [None] * (jnp.ndim(leaf) - len(spec))
        for dim, part in enumerate(parts):
            if part is None and jnp.shape(leaf)[dim] % d == 0:
                parts[dim] = data_axes if len(data_axes) > 1 else data_axes[0]
                break
        out.append(P(*parts))
    return jax.tree.unflatten(treedef, out)


def value_and_grad(loss_fn, *, mesh, param_specs, data_axes="data", codec="none",
                   batch_spec=None, microbatches=1, scatter=False, has_aux=False,
                   rows="flat", bucket_bytes=None):
    """`jax.value_and_grad(loss_fn)` with the gradients' reduction over the data axes
    sent with `codec`. -> fn(params, batch, key=None) -> (loss, grads), or
    ((loss, aux), grads) with `has_aux`; call it inside `jax.jit`.

    loss_fn(params, batch) -> scalar: the mean loss over the batch it is given
    (with `has_aux`, (loss, aux)). `param_specs`: the parameters'
    PartitionSpecs, as the program's shardings use them, over axes other than
    `data_axes` (they stay automatic). `batch_spec`: how the batch leaves split
    over the data axes (default: their first dimension). `codec`: "none" (lax's
    all-reduce, the one XLA inserts), "int8", "int4:rot", ... `key`: for codecs
    that draw (`:sr`, randk). The loss (and each aux leaf, as float32) is the
    mean over the whole batch; the gradients have the parameters' dtypes.
    `scatter=True`: the gradients come back reduce-scattered over the data
    axes, as `scatter_specs` lays them out."""
    data_axes = kernels.axes_of(data_axes)
    _check_mesh(mesh, data_axes)
    parsed = kernels.parse(codec)
    if parsed.kind not in ("identity", "dense", "sparse"):
        raise ValueError(f"codec {str(parsed)!r}: value_and_grad takes a byte codec "
                         "(none, bf16, fp16, fp8, int8/int4/int2, topk, randk)")
    if not isinstance(microbatches, int) or isinstance(microbatches, bool) or microbatches < 1:
        raise ValueError(f"microbatches must be a positive int; got {microbatches!r}")
    kernels.check_rows(rows)
    reduce_kw = dict(codec=codec, rows=rows,
                     **({} if bucket_bytes is None else {"bucket_bytes": bucket_bytes}))
    rest = frozenset(a for a in mesh.axis_names if a not in data_axes)
    data_spec = data_axes if len(data_axes) > 1 else data_axes[0]
    value_of = loss_fn if has_aux else lambda p, b: (loss_fn(p, b), ())

    def fn(params, batch, key=None):
        specs = _check(mesh, data_axes, param_specs, params)
        treedef = jax.tree.structure(params)
        in_specs = jax.tree.unflatten(treedef, specs)
        out_specs = scatter_specs(params, param_specs, mesh, data_axes) if scatter else in_specs
        b_spec = (jax.tree.map(lambda _: P(data_spec), batch) if batch_spec is None
                  else batch_spec)

        def reduce(grads, k):  # manual over every axis: each device reduces its own shards
            if scatter:
                return _scatter(grads, specs, out_specs, data_axes, k, reduce_kw)
            return ops.pmean(grads, data_axes, key=k, **reduce_kw)

        def local(params, batch, k):
            p_var = ops.vary(params, data_axes)  # this rank's gradients: no automatic psum
            (loss, aux), grads = _accumulate(value_of, p_var, batch, microbatches, data_axes)
            if rest:  # nested: the parameters' own axes manual too, so no leaf is gathered
                grads = jax.shard_map(reduce, mesh=jax.sharding.get_abstract_mesh(),
                                      in_specs=(in_specs, P()), out_specs=in_specs,
                                      axis_names=rest)(grads, k)
            else:
                grads = reduce(grads, k)
            loss, aux = jax.tree.map(lambda v: lax.pmean(v, data_axes), (loss, aux))
            return ((loss, aux) if has_aux else loss), grads

        k = jnp.zeros((), jnp.uint32) if key is None else key
        outer = jax.shard_map(
            lambda p, b, kk: local(p, b, None if key is None else kk),
            mesh=mesh, in_specs=(P(), b_spec, P()),
            out_specs=(P(), jax.tree.map(lambda s: _only(s, data_axes), out_specs)),
            axis_names=frozenset(data_axes))
        return outer(params, batch, k)

    return fn


def _only(spec, axes):
    """The spec as the outer (data-manual) map sees it: only the data axes."""
    parts = []
    for part in spec:
        names = part if isinstance(part, tuple) else (part,)
        kept = tuple(a for a in names if a in axes)
        parts.append(None if not kept else kept if len(kept) > 1 else kept[0])
    return P(*parts)


def _accumulate(value_of, params, batch, k, axes):
    """((loss, aux), grads) of the batch: one value_and_grad, or with k > 1 the mean
    over k microbatches (lax.scan; loss, aux and gradients summed in float32,
    the gradients cast back to the parameters' dtypes)."""
    grad_of = jax.value_and_grad(value_of, has_aux=True)
    if k == 1:
        return grad_of(params, batch)
    for x in jax.tree.leaves(batch):
        if x.shape[0] % k:
            raise ValueError(f"microbatches={k} must divide each data rank's batch; a batch "
                             f"leaf has {x.shape[0]} rows per rank")
    micro = jax.tree.map(lambda x: x.reshape((k, x.shape[0] // k) + x.shape[1:]), batch)
    f32 = lambda tree: jax.tree.map(lambda v: jnp.asarray(v, jnp.float32), tree)
    first = jax.tree.map(lambda x: x[0], micro)
    shapes = jax.eval_shape(lambda: f32(grad_of(params, first)))
    zeros = jax.tree.map(lambda s: kernels.vary(jnp.zeros(s.shape, s.dtype), axes), shapes)

    def body(acc, mb):
        return jax.tree.map(jnp.add, acc, f32(grad_of(params, mb))), None

    total, _ = lax.scan(body, zeros, micro)
    (loss, aux), grads = jax.tree.map(lambda v: v / k, total)
    return (loss, aux), jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)


def _scatter_dim(spec, scattered) -> int | None:
    """The dimension `scatter_specs` put the data axes on (`scattered` is its spec
    for the leaf of `spec`), or None where the leaf stays whole."""
    parts = tuple(spec) + (None,) * (len(scattered) - len(spec))
    return next((dim for dim, (a, b) in enumerate(zip(parts, scattered)) if a != b), None)


def _per_dim(leaves, dims, key, send):
    """The leaves sent one call per distinct dimension in `dims` (so leaves of one
    dimension still share buckets): send(part, dim, key) -> results of `part`;
    each call's key folded with its index. -> every leaf's result."""
    out = list(leaves)
    for i, dim in enumerate(sorted(set(dims), key=lambda x: -1 if x is None else x)):
        idx = [j for j, x in enumerate(dims) if x == dim]
        k = None if key is None else jax.random.fold_in(key, i)
        for j, g in zip(idx, send([leaves[j] for j in idx], dim, k)):
            out[j] = g
    return out


def _scatter(grads, specs, out_specs, data_axes, key, reduce_kw):
    """Each leaf's mean over the data axes, reduce-scattered along its scatter
    dimension (one call per dimension, so leaves still share buckets), or
    all-reduced where it has none."""
    leaves, treedef = jax.tree.flatten(grads)
    dims = [_scatter_dim(s, o) for s, o in zip(specs, treedef.flatten_up_to(out_specs))]
    d = lax.axis_size(data_axes)

    def send(part, dim, k):
        if dim is None:
            return ops.pmean(part, data_axes, key=k, **reduce_kw)
        got = ops.psum_scatter(part, data_axes, scatter_dimension=dim, tiled=True, key=k,
                               **reduce_kw)
        return [g / d for g in got]

    return jax.tree.unflatten(treedef, _per_dim(leaves, dims, key, send))


def gather_params(shards, *, mesh, param_specs, data_axes="data", codec="none",
                  rows="flat", bucket_bytes=None, key=None):
    """ZeRO's parameter all-gather for a jit program: parameter shards laid out as
    `scatter_specs(params, param_specs, mesh)` (the optimizer's update of the
    shards `value_and_grad(..., scatter=True)` returns) -> whole parameters with
    `param_specs`, gathered over the data axes with `codec`. Keep the shards as
    the master copy: a lossy codec's gathered parameters are the decoded ones."""
    data_axes = kernels.axes_of(data_axes)
    kernels.parse(codec)
    bucket = {} if bucket_bytes is None else {"bucket_bytes": bucket_bytes}
    specs = _check(mesh, data_axes, param_specs, shards)
    treedef = jax.tree.structure(shards)
    in_specs = scatter_specs(shards, param_specs, mesh, data_axes)
    dims = [_scatter_dim(s, o) for s, o in zip(specs, treedef.flatten_up_to(in_specs))]

    def gather(leaves, k):  # leaves that stayed whole are whole already
        moved = [j for j, dim in enumerate(dims) if dim is not None]
        got = _per_dim([leaves[j] for j in moved], [dims[j] for j in moved], k,
                       lambda part, dim, kk: ops.all_gather(
                           part, data_axes, axis=dim, tiled=True, to="invarying", codec=codec,
                           key=kk, rows=rows, **bucket))
        out = list(leaves)
        for j, g in zip(moved, got):
            out[j] = g
        return out

    leaves = jax.tree.leaves(shards)
    in_leaves = treedef.flatten_up_to(in_specs)
    k = jnp.zeros((), jnp.uint32) if key is None else key
    run = jax.shard_map(lambda ls, kk: gather(ls, None if key is None else kk), mesh=mesh,
                        in_specs=(in_leaves, P()), out_specs=list(specs))
    return jax.tree.unflatten(treedef, run(leaves, k))
