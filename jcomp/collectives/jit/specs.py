"""Parameter specs for `cc.value_and_grad` and `cc.gather_params`: reading them
(PartitionSpecs, logical names with rules, or flax's boxed parameters as they
come), checking them against the mesh, and the layouts derived from them.

A leaf's spec may split it over the batch axes (`data_axes`: FSDP as nanoDO
writes it over "data", or MaxText's "fsdp"); those dimensions are gathered at
the start of the step and their gradients reduce-scattered back. A dimension
may not mix batch axes with other axes in one entry: the order of the pieces
would then interleave the two.

Flax's boxes (`nn.Partitioned`, `nn.LogicallyPartitioned`) are read by duck
typing (`unbox`, `get_partition_spec`), and so are Flax NNX's Variables
(`nnx.Param` with `nnx.with_partitioning`: `get_metadata()`, its `out_sharding`),
so this module needs only jax. Plain arrays (Equinox's, or a dict of arrays)
give their own `NamedSharding`'s spec where it can be read: outside `jax.jit`,
or inside it on Explicit axes; traced on Auto axes they are taken as
replicated, with a warning.
"""
from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jcomp.collectives import arguments


def is_box(x) -> bool:
    """A flax metadata box (nn.Partitioned and kin): one array inside, names beside.
    Asked of the type, not the instance: a container whose `__getattr__` reads its
    keys (an attribute dict) raises KeyError, not AttributeError, for a missing one."""
    return hasattr(type(x), "unbox") and hasattr(type(x), "get_partition_spec")


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


# NNX Variables (nnx.Param and kin) keep their partition names in their metadata,
# under the first of these keys (flax 0.12: out_sharding; newer: sharding_metadata;
# older: sharding_names, sharding).
NNX_SHARDING_KEYS = ("out_sharding", "sharding_metadata", "sharding_names", "sharding")


def is_nnx_variable(x) -> bool:
    """A flax NNX Variable (nnx.Param and kin; older flax's VariableState): a pytree
    node around one array, its partition names in `get_metadata()`. Asked of the
    type, as `is_box`, and a linen box is not one."""
    return hasattr(type(x), "get_metadata") and not is_box(x)


def nnx_names(var):
    """The partition names an NNX Variable's metadata gives (a tuple), or None."""
    meta = var.get_metadata()
    if not isinstance(meta, dict):
        raise TypeError(f"an NNX Variable's get_metadata() gave {type(meta).__name__}, "
                        "not a dict; pass param_specs=nnx.get_partition_spec(params)")
    for key in NNX_SHARDING_KEYS:
        names = meta.get(key)
        if names is not None:
            break
    if not names:  # as flax's get_var_pspec: no names (or empty ones) is replicated
        return None
    if not isinstance(names, (tuple, list)):  # a PartitionSpec is a tuple
        raise TypeError(f"an NNX Variable's {key}={names!r}: a tuple of mesh or logical "
                        "axis names was expected; pass param_specs= to say the spec")
    return tuple(names)


def nnx_spec(var, rules):
    """An NNX Variable's mesh PartitionSpec, as `nnx.get_partition_spec` gives it:
    its names, logical ones mapped through `rules` (the ones `nnx.logical_axis_rules`
    would set) together with the Variable's own `sharding_rules` metadata, each
    name looked up on its own and kept as it is where no rule names it (flax's
    `from_sharding_rules`, not linen's `logical_to_mesh`)."""
    names = nnx_names(var)
    if names is None:
        return P()
    # As flax's composite_rules: within one source the last rule of a name wins;
    # the two sources may not disagree.
    table = dict(rules or ())
    for logical, mesh_axes in dict(var.get_metadata().get("sharding_rules") or ()).items():
        if logical in table and table[logical] != mesh_axes:
            raise ValueError(f"inconsistent logical axis rules for {logical!r}: "
                             f"{table[logical]!r} (rules=) vs {mesh_axes!r} (the "
                             "Variable's sharding_rules)")
        table[logical] = mesh_axes
    if not table:
        return P(*names)
    return P(*(table[n] if isinstance(n, str) and n in table else n for n in names))


def leaf_specs(params, param_specs, rules, mesh=None, data_axes=()):
    """One mesh PartitionSpec per array leaf of `params`, in `jax.tree.leaves`
    order (boxes and NNX Variables flattened to their one array).
    `param_specs`: a tree of PartitionSpecs with the parameters' structure (linen
    boxes as leaves; for NNX, `nnx.get_partition_spec(params)`), or None to read
    them from flax's linen boxes and NNX Variables' metadata; `rules`: logical
    axis rules, where the specs (given or read) name logical axes. Leaves that
    carry no partition names are replicated (P()), as flax's get_partition_spec
    reads them; plain arrays on `mesh` give their own sharding's spec
    (`array_spec`)."""
    box_def = jax.tree.structure(params, is_leaf=is_box)
    boxes = box_def.flatten_up_to(params)
    if param_specs is None:
        return _read_specs(params, rules, mesh, data_axes)
    try:
        specs = box_def.flatten_up_to(param_specs)
    except (TypeError, ValueError):
        raise ValueError("param_specs must have the parameters' tree structure (flax "
                         "boxes count as leaves; for NNX parameters, "
                         "nnx.get_partition_spec(params)), one PartitionSpec per "
                         "leaf") from None
    if rules is not None:
        specs = [logical_to_mesh(s, rules) if isinstance(s, P) else s for s in specs]
    for b in boxes:
        _one_array(b, "a parameter box")
    return specs


def _one_array(node, what, allow_none=False):
    n = len(jax.tree.leaves(node))
    if n != 1 and not (allow_none and n == 0):
        raise ValueError(f"{what} holds {n} arrays; value_and_grad takes one array per "
                         f"{what.split()[-1]}")
    return n


def _same_mesh(a, b) -> bool:
    return (tuple(a.axis_names) == tuple(b.axis_names) and a.devices.shape == b.devices.shape
            and [d.id for d in a.devices.flat] == [d.id for d in b.devices.flat])


def array_spec(x, mesh):
    """The spec of a plain array's own layout on `mesh` (a jax.Array's or a
    ShapeDtypeStruct's NamedSharding; P() for one replicated, or a numpy
    array), or None where it cannot be read: a value traced inside `jax.jit`
    carries in its type only the Explicit axes of its sharding, so on a mesh
    with an Auto axis of size > 1 its layout is not known there."""
    if isinstance(x, jax.core.Tracer):
        sharding = jax.typeof(x).sharding
        hidden = [a for a, t, n in zip(mesh.axis_names, mesh.axis_types, mesh.devices.shape)
                  if n > 1 and t != AxisType.Explicit]
        return None if hidden or not isinstance(sharding, NamedSharding) else sharding.spec
    sharding = getattr(x, "sharding", None)
    if sharding is None:
        return P()
    if isinstance(sharding, NamedSharding) and _same_mesh(sharding.mesh, mesh):
        return sharding.spec
    return P() if getattr(sharding, "is_fully_replicated", False) else None


def _read_specs(params, rules, mesh=None, data_axes=()):
    """leaf_specs without param_specs: linen boxes' names (logical ones through
    `rules`, or the boxes' own rules, by linen's logical_to_mesh), NNX Variables'
    metadata (through `rules` and their sharding_rules, as NNX maps them), plain
    arrays' own shardings on `mesh` (`array_spec`), P() for the rest."""
    nodes = jax.tree.leaves(params, is_leaf=lambda x: is_box(x) or is_nnx_variable(x))
    boxes = [b for b in nodes if is_box(b)]
    box_rules = rules if rules is not None else next(
        (b.rules for b in boxes if getattr(b, "rules", None)), None)
    if box_rules is None and any(hasattr(b, "rules") for b in boxes):
        raise ValueError("the parameters carry logical axis names "
                         "(nn.LogicallyPartitioned): pass rules=, as given to "
                         "nn.logical_axis_rules")
    flax = any(is_box(n) or is_nnx_variable(n) for n in nodes)
    out, unread = [], 0
    for node in nodes:
        if is_box(node):
            _one_array(node, "a parameter box")
            spec = node.get_partition_spec()
            out.append(logical_to_mesh(spec, box_rules) if box_rules is not None else spec)
        elif is_nnx_variable(node):
            # An empty Variable has no leaf in jax.tree.leaves(params), so no spec.
            out.extend([nnx_spec(node, rules)] * _one_array(node, "an NNX Variable",
                                                              allow_none=True))
        else:
            spec = None if mesh is None else array_spec(node, mesh)
            unread += spec is None
            out.append(P() if spec is None else spec)
    # A flax tree's unboxed leaves are replicated by the model's own say; plain
    # arrays traced on a mesh they could be split over would otherwise come
    # back replicated without a word. A warning, not an error: a small
    # replicated parameter (a probe, a bias) is a fair thing to pass this way.
    other = [a for a, n in zip(mesh.axis_names, mesh.devices.shape)
             if n > 1 and a not in data_axes] if mesh is not None else []
    if unread and not flax and other:
        warnings.warn(
            f"param_specs=None reads flax boxes, NNX Variables, or a plain array's own "
            f"NamedSharding, which {unread} parameter(s) traced inside jax.jit do not "
            f"carry on the Auto axes {other}: they are taken as replicated, and so are "
            "their gradients. Pass param_specs= (outside jit: jax.tree.map(lambda x: "
            "x.sharding.spec, params); all replicated: jax.tree.map(lambda x: P(), "
            "params))", UserWarning, stacklevel=arguments.caller_level())
    return out


def check(mesh, data_axes, params, param_specs, rules=None):
    """-> one mesh PartitionSpec per array leaf, checked against the mesh and the
    leaves' ranks; a dimension may not mix the batch axes with others."""
    named = jax.tree_util.tree_flatten_with_path(params)[0]
    specs = leaf_specs(params, param_specs, rules, mesh, data_axes)
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
    data_axes = arguments.axes_of(data_axes)
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
