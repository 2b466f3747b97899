"""Parameter specs for `cc.value_and_grad` and `cc.gather_params`: reading them
(PartitionSpecs, logical names with rules, or flax's boxed parameters as they
come), checking them against the mesh, and the layouts derived from them.

A leaf's spec may split it over the batch axes (`data_axes`: FSDP as nanoDO
writes it over "data", or MaxText's "fsdp"); those dimensions are gathered at
the start of the step and their gradients reduce-scattered back. A dimension
may not mix batch axes with other axes in one entry: the order of the pieces
would then interleave the two.

Flax's boxes (`nn.Partitioned`, `nn.LogicallyPartitioned`) are read by duck
typing (`unbox`, `get_partition_spec`), so this module needs only jax.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jcomp.collectives import kernels


def is_box(x) -> bool:
    """A flax metadata box (nn.Partitioned and kin): one array inside, names beside."""
    return hasattr(x, "unbox") and hasattr(x, "get_partition_spec")


def axes_in(spec) -> set:
    out = set()
    for part in (spec or ()):
        if part is None:
            continue
        out.update(part if isinstance(part, tuple) else (part,))
    return out


def only(spec, axes):
    """The spec restricted to `axes` (other names dropped), as a map manual over
    `axes` sees it."""
    parts = []
    for part in spec:
        names = () if part is None else part if isinstance(part, tuple) else (part,)
        kept = tuple(a for a in names if a in axes)
        parts.append(None if not kept else kept if len(kept) > 1 else kept[0])
    return P(*parts)


def logical_to_mesh(spec, rules):
    """Logical axis names -> mesh axes by `rules` ((logical, mesh axes or None),
    ...), as flax's logical_to_mesh does: the first rule of a name whose mesh axes
    this spec has not used yet."""
    used, parts = set(), []
    for name in spec:
        names = () if name is None else name if isinstance(name, tuple) else (name,)
        mapped = []
        for n in names:
            for logical, mesh_axes in rules:
                if logical != n:
                    continue
                cand = () if mesh_axes is None else (
                    tuple(mesh_axes) if isinstance(mesh_axes, (tuple, list)) else (mesh_axes,))
                if not used & set(cand):
                    mapped.extend(cand)
                    used.update(cand)
                    break
        parts.append(None if not mapped else mapped[0] if len(mapped) == 1 else tuple(mapped))
    return P(*parts)


def leaf_specs(params, param_specs, rules):
    """One mesh PartitionSpec per array leaf of `params` (boxes flattened).
    `param_specs`: a tree of PartitionSpecs with the parameters' structure (boxes
    as leaves), or None to read them from flax's boxes; `rules`: logical axis
    rules, where the specs (given or boxed) name logical axes."""
    box_def = jax.tree.structure(params, is_leaf=is_box)
    boxes = box_def.flatten_up_to(params)
    if param_specs is None:  # as nn.get_partition_spec: an unboxed leaf is replicated
        specs = [b.get_partition_spec() if is_box(b) else P() for b in boxes]
        rules = rules if rules is not None else next(
            (b.rules for b in boxes if getattr(b, "rules", None)), None)
        logical = [b for b in boxes if hasattr(b, "rules")]
        if logical and rules is None:
            raise ValueError("the parameters carry logical axis names "
                             "(nn.LogicallyPartitioned): pass rules=, as given to "
                             "nn.logical_axis_rules")
    else:
        try:
            specs = box_def.flatten_up_to(param_specs)
        except (TypeError, ValueError):
            raise ValueError("param_specs must have the parameters' tree structure (flax "
                             "boxes count as leaves), one PartitionSpec per leaf") from None
    if rules is not None:
        specs = [logical_to_mesh(s, rules) if isinstance(s, P) else s for s in specs]
    out = []
    for b, s in zip(boxes, specs):
        n = len(jax.tree.leaves(b))
        if n != 1:
            raise ValueError(f"a parameter box holds {n} arrays; value_and_grad takes one "
                             "array per box")
        out.append(s)
    return out


def check(mesh, data_axes, params, param_specs, rules=None):
    """-> one mesh PartitionSpec per array leaf, checked against the mesh and the
    leaves' ranks; a dimension may not mix the batch axes with others."""
    named = jax.tree_util.tree_flatten_with_path(params)[0]
    specs = leaf_specs(params, param_specs, rules)
    for (path, leaf), spec in zip(named, specs):
        where = f"param_specs{jax.tree_util.keystr(path)}"
        if not isinstance(spec, P):
            raise TypeError(f"{where}: a PartitionSpec; got {spec!r}")
        unknown = axes_in(spec) - set(mesh.axis_names)
        if unknown:
            raise ValueError(f"{where}: {spec} names axes {sorted(unknown)} that the mesh "
                             f"{mesh.axis_names} lacks")
        if len(spec) > jnp.ndim(leaf):
            raise ValueError(f"{where}: {spec} has more entries than the parameter's "
                             f"{jnp.ndim(leaf)} dimensions")
        for part in spec:
            names = () if part is None else part if isinstance(part, tuple) else (part,)
            batch = [a for a in names if a in data_axes]
            if batch and len(batch) != len(names):
                raise ValueError(
                    f"{where}: {spec} splits one dimension over the batch axes {batch} and "
                    f"other axes together; keep them on separate dimensions")
    return specs


def scatter_spec(spec, shape, data_axes, sizes):
    """`spec` with the data axes it does not use yet put on the first dimension
    that is not split and that their size divides (ZeRO's gradient shard); the
    spec unchanged where no dimension fits."""
    free = tuple(a for a in data_axes if a not in axes_in(spec))
    if not free:
        return spec
    d = 1
    for a in free:
        d *= sizes[a]
    parts = list(spec) + [None] * (len(shape) - len(spec))
    for dim, part in enumerate(parts):
        if part is None and shape[dim] % d == 0:
            parts[dim] = free if len(free) > 1 else free[0]
            return P(*parts)
    return spec


def scatter_specs(params, param_specs, mesh, data_axes=("data",), rules=None):
    """The partition spec each gradient leaf has after `scatter=True`: its spec
    with the data axes it does not use yet added on the first dimension that is
    not split and that their size divides; a leaf with no such dimension keeps
    its spec (all-reduced over those axes). Boxed parameters give a tree of
    specs with the boxes' structure."""
    data_axes = kernels.axes_of(data_axes)
    specs = check(mesh, data_axes, params, param_specs, rules)
    out = [scatter_spec(s, jnp.shape(leaf), data_axes, mesh.shape)
           for leaf, s in zip(jax.tree.leaves(params), specs)]
    return jax.tree.structure(params, is_leaf=is_box).unflatten(out)


def split_dims(spec, data_axes) -> tuple:
    """((dim, batch axes on it), ...) for the dimensions `spec` splits over batch axes."""
    out = []
    for dim, part in enumerate(spec):
        names = () if part is None else part if isinstance(part, tuple) else (part,)
        if names and names[0] in data_axes:
            out.append((dim, tuple(names)))
    return tuple(out)
