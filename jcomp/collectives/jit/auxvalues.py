"""How the data ranks' aux values combine in `cc.value_and_grad(has_aux=True)`:
each aux leaf by its rule (`aux=`), over a rank's microbatches (`local`) and
then over the ranks, with the loss (`combine`)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

AUX_RULES = ("sum", "mean", "weighted", "max", "min")


def rules(aux, has_aux):
    """`aux` checked against `has_aux`: None without aux, else the rules' tree."""
    if not has_aux:
        if aux is not None:
            raise ValueError("aux= says how the ranks' aux values combine; it needs has_aux=True")
        return None
    if aux is None:
        raise ValueError("has_aux=True needs aux=: how each aux leaf combines over the data "
                         f"ranks, one of {AUX_RULES} (a string for all, or a tree prefix of "
                         "aux with one per subtree)")
    for rule in jax.tree.leaves(aux):
        if rule not in AUX_RULES:
            raise ValueError(f"aux: {rule!r} is not one of {AUX_RULES}")
    return aux


def local(rules, aux_K, scale_K):
    """Each aux leaf combined over this rank's microbatches, by its rule."""
    if rules is None:
        return ()
    k = len(aux_K)

    def one(rule, *vals):
        if rule == "weighted":
            if not jnp.issubdtype(vals[0].dtype, jnp.floating):
                raise TypeError(f"aux rule 'weighted' takes floating-point leaves; got "
                                f"{vals[0].dtype}")
            return sum(scale_K[i] * v.astype(jnp.float32) for i, v in enumerate(vals))
        if rule in ("max", "min"):
            pick = jnp.maximum if rule == "max" else jnp.minimum
            out = vals[0]
            for v in vals[1:]:
                out = pick(out, v)
            return out
        if rule == "mean" and not jnp.issubdtype(vals[0].dtype, jnp.floating):
            raise TypeError(f"aux rule 'mean' takes floating-point leaves; got {vals[0].dtype} "
                            "(a count is a 'sum')")
        return sum(vals[1:], vals[0]) if k > 1 else vals[0]

    return jax.tree.map(lambda rule, *subs: jax.tree.map(lambda *v: one(rule, *v), *subs),
                        rules, *aux_K)


def combine(loss, aux, rules, axes, k):
    """The global loss and aux: one all-reduce for the sums, one each for max/min."""
    if rules is None:
        return lax.psum(loss, axes), ()
    n = lax.axis_size(axes) * k
    flat_rules, flat_aux = [], []
    for rule, sub in zip(jax.tree.leaves(rules), jax.tree.structure(rules).flatten_up_to(aux)):
        for leaf in jax.tree.leaves(sub):
            flat_rules.append(rule)
            flat_aux.append(leaf)
    sums = [i for i, r in enumerate(flat_rules) if r in ("sum", "mean", "weighted")]
    summed = lax.psum([loss] + [flat_aux[i] for i in sums], axes)
    out = list(flat_aux)
    for i, v in zip(sums, summed[1:]):
        out[i] = v / n if flat_rules[i] == "mean" else v
    for rule, red in (("max", lax.pmax), ("min", lax.pmin)):
        idx = [i for i, r in enumerate(flat_rules) if r == rule]
        if idx:
            for i, v in zip(idx, red([flat_aux[i] for i in idx], axes)):
                out[i] = v
    # Back into aux's own structure and dtypes ("weighted" summed in float32).
    orig = jax.tree.leaves(aux)
    out = [v.astype(o.dtype) for v, o in zip(out, orig)]
    return summed[0], jax.tree.unflatten(jax.tree.structure(aux), out)
