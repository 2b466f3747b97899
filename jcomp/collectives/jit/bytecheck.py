"""`cc.value_and_grad`'s promise checked on the user's own program: no mesh axis
carries more bytes than `jax.value_and_grad` of the same loss.

The first time a gradient function is traced for a set of shapes and
shardings, both gradient programs (the plain `jax.value_and_grad(loss_fn)` and
jcomp's) are compiled on their own, with the parameters' and the batch's
shardings, and metered (`jcomp.meter.compare`); an axis on which jcomp's sends
more gets an `ExtraBytesWarning` naming it and the leaves whose shapes its
extra collectives carry. The cost: two more compiles of the gradient program
per new trace (`check_bytes=False` skips them).
"""
from __future__ import annotations

import math
import threading
import warnings

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jcomp.meter import compare
from jcomp.meter.compare import ExtraBytesWarning  # noqa: F401  (public: cc.ExtraBytesWarning)

_state = threading.local()


def checked(fn, loss_fn, has_aux, mesh, shardings_of):
    """fn(params, batch, key=None), checked against the plain gradient program
    once per new signature. `shardings_of(params, batch)` -> (params' specs as
    a list over jax.tree.leaves(params), the batch's specs as a tree of P)."""
    plain = jax.value_and_grad(loss_fn, has_aux=has_aux)
    done = set()

    def run(params, batch, key=None):
        out = fn(params, batch, key)  # the call's own argument errors first
        if not getattr(_state, "inside", False):
            p_specs, b_specs = shardings_of(params, batch)
            p_abs = _abstract(params, p_specs, mesh)
            b_abs = _abstract(batch, jax.tree.leaves(b_specs, is_leaf=_is_spec), mesh)
            sig = (jax.tree.structure(p_abs), jax.tree.structure(b_abs),
                   tuple(map(_sig, jax.tree.leaves(p_abs) + jax.tree.leaves(b_abs))))
            if sig not in done:
                done.add(sig)
                k_abs = None if key is None else jax.ShapeDtypeStruct(jnp.shape(key),
                                                                     jax.typeof(key).dtype)
                _check(plain, fn, params, p_specs, p_abs, b_abs, k_abs, mesh)
        return out

    return run


def _is_spec(x):
    return isinstance(x, P)


def _sig(s):
    return s.shape, str(s.dtype), str(s.sharding.spec)


def _abstract(tree, specs, mesh):
    leaves, treedef = jax.tree.flatten(tree)
    return treedef.unflatten([
        jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x), sharding=NamedSharding(mesh, s))
        for x, s in zip(leaves, specs)])


def _check(plain, fn, params, p_specs, p_abs, b_abs, k_abs, mesh):
    _state.inside = True
    try:
        c = compare.compare(lambda p, b, k: plain(p, b), fn, p_abs, b_abs, k_abs, mesh=mesh)
    except Exception as e:  # noqa: BLE001  (the user's step goes on; the gap is named)
        warnings.warn(ExtraBytesWarning(
            f"cc.value_and_grad could not compile the plain gradient program and its own "
            f"on their own to compare their bytes ({type(e).__name__}: "
            f"{str(e).splitlines()[0]}); compare the steps with jcomp.meter.compare.compare"),
            stacklevel=4)
        return
    finally:
        _state.inside = False
    culprits = {a: _leaves_named(c.added(a), params, p_specs, mesh) for a in c.extra()}
    c.warn("cc.value_and_grad", {a: v for a, v in culprits.items() if v}, stacklevel=4)


def _leaves_named(added, params, specs, mesh):
    """The parameter leaves whose shape, whole or per device, an added collective
    carries: the likely cause of the extra bytes."""
    shapes = {_squeeze(c.shape) for c in added if isinstance(c.shape, tuple)
              and all(isinstance(d, int) for d in c.shape)}
    named = []
    for (path, x), spec in zip(jax.tree_util.tree_flatten_with_path(params)[0], specs):
        if {_squeeze(s) for s in _views(jnp.shape(x), spec, mesh)} & shapes:
            named.append(jax.tree_util.keystr(path))
    if not named:
        return ""
    more = f" and {len(named) - 6} more" if len(named) > 6 else ""
    return f"leaves {', '.join(named[:6])}{more}"


def _views(shape, spec, mesh):
    """The leaf's shape whole, and per device under each subset of its spec's axes
    (all of them, and each axis alone)."""
    parts = list(spec) + [None] * (len(shape) - len(spec))
    names = [() if p is None else p if isinstance(p, tuple) else (p,) for p in parts]
    axes = {a for n in names for a in n}
    out = [tuple(shape)]
    for keep in [axes] + [{a} for a in axes] + [axes - {a} for a in axes]:
        out.append(tuple(d // math.prod(mesh.shape[a] for a in n if a in keep)
                         for d, n in zip(shape, names)))
    return out


def _squeeze(shape):
    return tuple(d for d in shape if d != 1)


__all__ = ["checked", "ExtraBytesWarning"]
