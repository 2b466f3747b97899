"""What a collective call's arguments mean, read the same way by every op:
its axes, codec (`parse`: the codecs a collective can send with), key (per
device), rows (the rows a codec codes on its own: a leaf's last axis, or
`flat_group`'s blocks in flat buckets) and dimensions (checked, then split
into per-device pieces and stacked back). Also the warning a raw send gives.
"""
from __future__ import annotations

import math
import operator
import sys

import jax
import jax.numpy as jnp
from jax import lax

from jcomp import codecs as _codecs


class RawSendWarning(UserWarning):
    """A compressed collective sends its operand uncompressed: the codec cannot
    send fewer bytes at this size (see `jcomp.collectives.kernels.plan`)."""


def caller_level() -> int:
    """stacklevel of the first frame outside jcomp.collectives and jax."""
    frame, level = sys._getframe(2), 2
    while frame is not None and frame.f_globals.get("__name__", "").startswith(
            ("jcomp.collectives", "jax", "contextlib")):
        frame, level = frame.f_back, level + 1
    return level


def vary(x, axes):
    """`x` marked varying over those of `axes` it does not vary over yet."""
    missing = tuple(a for a in axes if a not in jax.typeof(x).mat.varying)
    return lax.pcast(x, missing, to="varying") if missing else x


def check_floating(x, codec):
    """A lossy codec codes floating-point leaves only: a TypeError for any other
    leaf of `x`, at every size (not only where the codec would run)."""
    for leaf in jax.tree.leaves(x):
        if not jnp.issubdtype(jnp.result_type(leaf), jnp.floating):
            raise TypeError(
                f"codec {codec!r} codes floating-point arrays; got a leaf of dtype "
                f"{jnp.result_type(leaf)} (send integer and boolean leaves with codec='none')")


def check_bool(name: str, value) -> bool:
    """A flag must be a bool: a string such as "False" is truthy and would turn
    the flag on."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False; got {value!r}")
    return value


def traced_or_jitted(fn):
    """fn(*args) as given where any argument is traced (inside the user's jit),
    and compiled with `jax.jit` where all are concrete: a program with partial
    manual `shard_map`s does not run op by op, and `jax.value_and_grad`, which
    such a function stands in for, can be called eagerly."""
    jitted = jax.jit(fn)

    def call(*args, **kwargs):
        if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves((args, kwargs))):
            return fn(*args, **kwargs)
        return jitted(*args, **kwargs)

    return call


def axes_of(axis_name) -> tuple:
    return tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)


NONE = _codecs.parse("none")  # what an axis a codec dict does not name sends


def parse(codec):
    """A codec these collectives can send with; the others are refused loudly
    rather than replaced by an uncompressed collective."""
    c = _codecs.parse(codec)
    if c.kind == "lowrank":
        raise ValueError(f"codec {c} compresses data-parallel gradients through "
                         "jcomp.collectives.powersgd.reduce (or the optimizer), not a collective")
    if c.kind == "learned":
        raise ValueError(f"codec {c} is a learned autoencoder whose weights are model "
                         "parameters; jcomp.gpt.parallel applies it inside the model's blocks")
    return c


def check_key(key, *codecs):
    for c in codecs:
        if c.needs_key and key is None:
            raise ValueError(
                f"codec {str(c)!r} draws random numbers: pass key= (a jax.random key)")


def device_key(key, axes, codec):
    """Per-device randomness: stochastic rounding must not repeat across devices.
    Rand-k keeps one key for all devices so every device picks the same entries."""
    if key is None or codec.name == "randk":
        return key
    return jax.random.fold_in(key, lax.axis_index(axes))


ROWS = ("independent", "flat")


def check_rows(rows):
    if rows not in ROWS:
        raise ValueError(f"rows must be one of {', '.join(map(repr, ROWS))}; got {rows!r}")


def last_row(leaf) -> int:
    """The row a codec codes on its own: a leaf's last axis (1 for a 0-d leaf)."""
    return max(int(leaf.shape[-1]), 1) if leaf.ndim else 1


def flat_group(length: int, codecs) -> tuple:
    """rows="flat": the coded row of a leaf of `length` elements per buffer row,
    the key on which leaves share a bucket -> (row,) or (None,).

    No leaf's scale, rotation or top-k budget is set by another leaf: a block
    codec's leaves whose length is a multiple of its block (jcomp's ZeRO
    shards are) share buckets coded in rows of one block, so each leaf starts
    on a block boundary and fills whole blocks; any other leaf is a row of its
    own (with leaves of its length: a short one gets one block that covers
    it), and so is every leaf of a top-k or rand-k codec, or of a codec with a
    scale per row (nvfp4: one per leaf, its per-tensor scale). Element-wise
    codecs (casts) bucket freely."""
    if any(c.kind == "sparse" or getattr(c, "row_scale", False) for c in codecs):
        return (length,)
    granule = math.lcm(*(c.row_multiple for c in codecs))
    if granule == 1:
        return (None,)
    return (granule,) if length % granule == 0 else (length,)


def row_key(rows: str, leaf, view, codecs) -> tuple:
    """(row,): the coded row of `leaf` and the key it shares buckets on;
    view.row_of(leaf) with rows="independent", `flat_group` of its buffer row
    (view.to_rows(leaf), [R, C]) with rows="flat" (`view`: a buckets.RowView)."""
    if rows == "independent":
        return (view.row_of(leaf),)
    return flat_group(view.to_rows(leaf).shape[1], codecs)


def split_row(leaf, dim: int, n: int, tiled: bool) -> int:
    """The coded row of one of the n pieces `leaf` splits into along `dim`: the last
    axis; a tiled split of the last axis cuts it into rows of C/n; an untiled one
    leaves one element of each row, which is then a row of its own."""
    if dim != leaf.ndim - 1:
        return last_row(leaf)
    return max(int(leaf.shape[-1]) // n, 1) if tiled else 1


def dim_of(value, ndim: int, arg: str, op: str) -> int:
    """`value` (an int; negative counts from the end) as an index into `ndim`
    dimensions. Out of range: ValueError naming `arg`, for every codec (lax
    raises IndexError or a lowering error there, or, for some, wraps around)."""
    try:
        index = operator.index(value)
    except TypeError:
        raise TypeError(f"{op}: {arg} must be an int; got {value!r}") from None
    if not -ndim <= index < ndim:
        raise ValueError(f"{op}: {arg}={index} is out of range for an operand of {ndim} "
                         f"dimensions; allowed: {-ndim} to {ndim - 1}")
    return index % ndim


def dims_of(x, value, arg: str, op: str, extra: int = 0) -> list:
    """`dim_of` for every leaf of the pytree `x` (of ndim + `extra` dimensions)."""
    return [dim_of(value, leaf.ndim + extra, arg, op) for leaf in jax.tree.leaves(x)]


def rows_along(x, n, dim, tiled, what):
    """Splits `x` along `dim` into n pieces (psum_scatter's and all_to_all's split) -> [n, *piece]."""
    if tiled:
        if x.shape[dim] % n:
            raise ValueError(f"{what}: dimension {dim} of size {x.shape[dim]} "
                             f"is not divisible by the axis size {n}")
        x = x.reshape(x.shape[:dim] + (n, x.shape[dim] // n) + x.shape[dim + 1:])
    elif x.shape[dim] != n:
        raise ValueError(f"{what}: dimension {dim} has size {x.shape[dim]}; "
                         f"tiled=False needs the axis size {n}")
    return jnp.moveaxis(x, dim, 0)


def stack_along(rows_N, dim, tiled):
    """Inverse of `rows_along`: [n, *piece] -> the pieces placed along `dim`."""
    placed = jnp.moveaxis(rows_N, 0, dim)
    if not tiled:
        return placed
    shape = list(rows_N.shape[1:])
    shape[dim] *= rows_N.shape[0]
    return placed.reshape(shape)
