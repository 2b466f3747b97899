"""The model's own sharding constraints inside `cc.value_and_grad`'s per-rank map.

The map is manual over the batch axes, where JAX refuses a constraint that
names them; MaxText's activation rules and flax's boxed parameters name them.
While the per-rank program is traced, `batch_constraints` drops the manual
axes from each constraint, so the rest of it holds as written."""
from __future__ import annotations

import contextlib
import threading

import jax
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jcomp.collectives.jit import specs as jitspecs

_state = threading.local()


@contextlib.contextmanager
def batch_constraints(data_axes, specs):
    """While the per-rank program is traced, `jax.lax.with_sharding_constraint`
    drops the batch axes (manual there) from each constraint, so a model's own
    constraints (MaxText's activation rules, flax's boxes) hold as written for
    the other axes. Raises where a constraint splits the batch dimension over an
    automatic axis that also splits parameters: FSDP left to XLA inside the map,
    a layout XLA's partitioner aborts on (an embedding gather), so it is named
    before compiling."""
    param_axes = set().union(*map(jitspecs.axes_in, specs)) if specs else set()
    prev = getattr(_state, "axes", None)
    # Flax applies a box's or a logical constraint only where a mesh context is
    # set (it checks; its constraints are bare PartitionSpecs), and the map sets
    # one: without the caller's own context, such a constraint never ran in the
    # plain program, so it does not run here either.
    had_context = not jax.sharding.get_abstract_mesh().empty
    _state.axes = (frozenset(data_axes), param_axes, had_context)
    # Installed for the trace only. Other threads see a pass-through (the state
    # is per thread); code that bound the function under another name before
    # this call keeps lax's and raises JAX's own error on a batch axis.
    installed = jax.lax.with_sharding_constraint
    jax.lax.with_sharding_constraint = _constrain
    try:
        yield
    finally:
        jax.lax.with_sharding_constraint = installed
        _state.axes = prev


def _strip(spec, axes):
    parts = []
    for part in spec:
        if part is None or part is P.UNCONSTRAINED:
            parts.append(part)
            continue
        names = part if isinstance(part, tuple) else (part,)
        kept = tuple(a for a in names if a not in axes)
        parts.append(None if not kept else kept if len(kept) > 1 else kept[0])
    return P(*parts)


def _constrain(x, shardings):
    state = getattr(_state, "axes", None)
    manual = set(jax.sharding.get_abstract_mesh().manual_axes)
    if state is None or not manual & state[0]:
        return _lax_constraint(x, shardings)
    data_axes, param_axes, had_context = state
    bare = jax.tree.leaves(shardings, is_leaf=lambda s: isinstance(s, P))
    if not had_context and all(isinstance(s, P) for s in bare):
        return x  # as in the plain program, which ran without a mesh context

    def fix(s):
        spec = s.spec if isinstance(s, NamedSharding) else s
        if not isinstance(spec, P):
            return s
        first = spec[0] if len(spec) else None
        first = () if first is None or first is P.UNCONSTRAINED else (
            first if isinstance(first, tuple) else (first,))
        auto_fsdp = [a for a in first if a not in data_axes and a in param_axes]
        if auto_fsdp:
            raise ValueError(
                f"a sharding constraint {spec} splits the batch over {auto_fsdp}, which "
                f"param_specs also split parameters over (FSDP over a batch axis): pass "
                f"data_axes={tuple(data_axes) + tuple(auto_fsdp)!r} to cc.value_and_grad, so "
                "those parameters are gathered and their gradients reduce-scattered by jcomp "
                "(XLA's partitioner aborts on an embedding gather left to it in this layout)")
        return _strip(spec, manual)

    return _lax_constraint(x, jax.tree.map(fix, shardings,
                                           is_leaf=lambda s: isinstance(s, (NamedSharding, P))))


_lax_constraint = lax.with_sharding_constraint
