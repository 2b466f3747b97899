"""`cc.value_and_grad` on a mesh of Explicit batch axes: JAX's `reduced` and
`unreduced` types leave the gradient's reduction to jcomp, and the loss runs as
written, in the global view."""
from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jcomp.collectives.jit import specs as jitspecs
from jcomp.collectives import ops
from jcomp.collectives.jit.reduce import groups, reduce


def typed_specs(params, batch):
    """The parameters' and the batch's PartitionSpecs, read from their types."""
    spec = lambda x: P(*jax.typeof(x).sharding.spec.partitions)
    return [spec(x) for x in jax.tree.leaves(params)], jax.tree.map(spec, batch)


def value_and_grad(loss_fn, mesh, data_axes, has_aux, codec, scatter, rows, bucket,
                   param_specs=None, rules=None):
    """value_and_grad on a mesh of Explicit batch axes, by JAX's own hook for a
    reduction the program controls: each parameter is marked `reduced` over the
    batch axes its spec does not use, so `jax.value_and_grad` of the loss as
    written (global view: `out_sharding=`, `jax.reshard`, constraints, Python
    containers all as the plain program has them) returns its gradient
    `unreduced` there, each device holding its partial sum; one full-manual
    `shard_map` then sums those with `codec` into the parameter's own spec (or
    the scatter spec). Loss and aux are the plain program's, as computed."""
    value_and_grad_of = jax.value_and_grad(loss_fn, has_aux=has_aux)

    def fn(params, batch, key=None):
        leaves, treedef = jax.tree.flatten(params)
        specs = [jax.typeof(x).sharding.spec for x in leaves]
        if param_specs is not None or rules is not None:
            _agree(mesh, data_axes, params, param_specs, rules, specs)
        wanted = [tuple(a for a in data_axes if a not in jitspecs.axes_in(s.partitions))
                  for s in specs]
        reduce_over, (value, grads) = _grad_of_marked(value_and_grad_of, params, specs,
                                                      wanted, batch)
        g_leaves = jax.tree.leaves(grads)
        outs = [jitspecs.scatter_spec(P(*s.partitions), jnp.shape(x), axes, mesh.shape)
                if scatter and axes else P(*s.partitions)
                for x, s, axes in zip(leaves, specs, reduce_over)]

        def body(gs, k):
            k = None if key is None else k
            out = list(gs)
            for g, (axes, idx) in enumerate(groups(reduce_over)):
                if not axes:  # reduced by JAX already (FSDP, or a leaf left unmarked)
                    continue
                kk = None if k is None else jax.random.fold_in(k, g)
                part = reduce([gs[i] for i in idx], [outs[i] for i in idx], axes, codec,
                               kk, rows, bucket)
                for i, x in zip(idx, part):
                    out[i] = x
            return out

        k = jnp.zeros((), jnp.uint32) if key is None else key
        # check_vma=False: the body's operands are each device's partial sums, which
        # the vma types can only call unreduced, and JAX casts no unreduced value to
        # varying; the reductions here are the only ones.
        reduced = jax.shard_map(
            body, mesh=mesh, in_specs=([jax.typeof(g).sharding.spec for g in g_leaves], P()),
            out_specs=outs, check_vma=False)(g_leaves, k)
        if scatter:  # a leaf JAX reduced whole: its scattered piece is a local slice
            reduced = [jax.reshard(g, jitspecs.scatter_spec(o, g.shape, axes, mesh.shape))
                       if axes and not r else g
                       for g, o, axes, r in zip(reduced, outs, wanted, reduce_over)]
        return value, treedef.unflatten(reduced)

    return fn


def _grad_of_marked(value_and_grad_of, params, specs, wanted, batch):
    """-> (the batch axes each leaf was marked reduced over, value_and_grad's
    result). JAX 0.10.2 refuses an elementwise op between a value reduced over
    an axis and one split over it (a norm scale multiplied into the batch's
    activations, a position table added to them: ShardingTypeError); matmuls
    and gathers take it. One such leaf fails the whole trace, so the leaves
    that can stay unreduced are found by trial: all of them; else every leaf
    of two or more dimensions, the vectors (scales, biases: few bytes) left to
    JAX; else those matrices added group by group, a group that fails split in
    halves down to the single leaves that fail (a few traces per such leaf).
    The leaves left unmarked are reduced by JAX in full precision, as the
    plain program does, and a RawSendWarning names them."""
    leaves, treedef = jax.tree.flatten(params)
    errors = []

    def attempt(marks):
        marked = [jax.reshard(x, P(*s.partitions, reduced=set(axes) | set(s.reduced)))
                  if axes else x for x, s, axes in zip(leaves, specs, marks)]
        try:
            return value_and_grad_of(treedef.unflatten(marked), batch)
        except Exception as e:  # noqa: BLE001  (only JAX's sharding type error is retried)
            if type(e).__name__ != "ShardingTypeError":
                raise
            errors.append(e)
            return None

    def _marks(chosen):
        return [w if i in chosen else () for i, w in enumerate(wanted)]

    every = {i for i, w in enumerate(wanted) if w}
    matrices = {i for i in every if jnp.ndim(leaves[i]) >= 2}
    result = attempt(_marks(every))
    chosen = every
    if result is None and matrices != every:
        chosen = matrices
        result = attempt(_marks(chosen))
    if result is None:
        chosen = set()
        m = sorted(matrices)  # all of them together failed just above: start at the halves
        pending = [m[: len(m) // 2], m[len(m) // 2:]] if len(m) > 1 else []
        while pending:  # grow the set that traces; split a group that does not
            group = pending.pop(0)
            got = attempt(_marks(chosen | set(group)))
            if got is not None:
                chosen |= set(group)
                result = got  # chosen only grows, so the last success is the final set's
            elif len(group) > 1:
                pending[:0] = [group[: len(group) // 2], group[len(group) // 2:]]
        if not chosen:  # nothing marked is the plain program: its errors are the user's
            result = value_and_grad_of(params, batch)
    marks = _marks(chosen)
    if errors:
        paths = [jax.tree_util.keystr(p) for p, _ in
                 jax.tree_util.tree_flatten_with_path(params)[0]]
        raw = [p for i, p in enumerate(paths) if wanted[i] and i not in chosen]
        reason = str(errors[0]).strip().splitlines()[0]
        warnings.warn(ops.RawSendWarning(
            f"cc.value_and_grad: {len(raw)} gradient(s) reduced raw by JAX, as the plain "
            f"program does ({', '.join(raw[:6])}{', ...' if len(raw) > 6 else ''}): "
            f"JAX cannot keep them unreduced where the loss combines them elementwise "
            f"with batch-split values ({reason})"), stacklevel=4)
    return marks, result


def _agree(mesh, data_axes, params, param_specs, rules, specs):
    """param_specs given on an Explicit mesh must say what the types say."""
    given = jitspecs.check(mesh, data_axes, params, param_specs, rules)
    paths = jax.tree_util.tree_flatten_with_path(params)[0]
    for (path, _), g, s in zip(paths, given, specs):
        if _norm(g) != _norm(P(*s.partitions)):
            raise ValueError(f"param_specs{jax.tree_util.keystr(path)}: {g}, but the parameter "
                             f"is typed {P(*s.partitions)} on this Explicit mesh; the types "
                             "decide here, so leave param_specs out or make them agree")


def _norm(spec):
    """A spec's entries, one-name tuples as the name, trailing Nones dropped."""
    parts = [p[0] if isinstance(p, tuple) and len(p) == 1 else p for p in spec]
    while parts and parts[-1] is None:
        parts.pop()
    return tuple(parts)

