"""Bucketing: the leaves of a pytree sent as a few flat buffers.

Leaves that agree in what one message needs (dtype, varying axes, rows per
leaf) are concatenated in leaf order into buffers of at most `bucket_bytes` (a
larger leaf travels alone): on a real network every message costs a latency,
which is why DDP and ZeRO++ bucket too. At 32 MiB by default a model's biases
and norms share a message with its matrices while one bucket's copy stays
small next to device memory (DDP picks 25 MiB).
"""
from __future__ import annotations

import itertools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from jcomp.collectives.arguments import last_row

DEFAULT_BUCKET_BYTES = 32 * 2**20


class RowView(NamedTuple):
    """How an op lays a leaf out as buffer rows [R, C] (R = 1, or G: one row per
    device along the axes) and reads the leaf's result back from what comes out."""

    to_rows: Callable    # leaf -> [R, C]
    from_rows: Callable  # (result rows, or a tuple of them; leaf) -> the leaf's result
    row_of: Callable = last_row  # leaf -> the row length a row-local codec codes


def _check(bucket_bytes):
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be a positive int; got {bucket_bytes!r}")


def groups(rows, keys, bucket_bytes):
    """Indices of `rows` ([R, m] arrays) in buckets: same key, in order, at most
    `bucket_bytes` each (a larger row alone)."""
    open_, out = {}, []
    for i, (r, k) in enumerate(zip(rows, keys)):
        size = r.size * r.dtype.itemsize
        bucket = open_.get(k)
        if bucket is None or bucket[1] + size > bucket_bytes:
            bucket = open_[k] = [[], 0]
            out.append(bucket[0])
        bucket[0].append(i)
        bucket[1] += size
    return out


def bucketed(x, prepare, view: RowView, send, key, bucket_bytes):
    """Runs `send` once per bucket of the leaves of `x`.

    prepare(leaf) -> (leaf, group): `group` (hashable) is passed to `send`; a
    falsy group means the leaf is already its own result. send(buf_RxC, group,
    key) -> an array or a tuple of arrays whose last axis is C; `view` turns a
    leaf into rows and its pieces of what `send` returned into its result.
    """
    _check(bucket_bytes)
    leaves, treedef = jax.tree.flatten(x)
    prepared = [prepare(leaf) for leaf in leaves]
    outs = [leaf for leaf, _ in prepared]
    todo = [i for i, (_, g) in enumerate(prepared) if g]
    rows = [view.to_rows(prepared[i][0]) for i in todo]
    keys = [(prepared[i][1], r.dtype, r.shape[0], jax.typeof(r).mat.varying)
            for i, r in zip(todo, rows)]
    for b, members in enumerate(groups(rows, keys, bucket_bytes)):
        parts = [rows[j] for j in members]
        buf = parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=1)
        k = None if key is None else jax.random.fold_in(key, b)
        sent = send(buf, keys[members[0]][0], k)
        single = not isinstance(sent, tuple)
        sent = (sent,) if single else sent
        bounds = list(itertools.accumulate(p.shape[1] for p in parts[:-1]))
        pieces = [jnp.split(s, bounds, axis=1) if bounds else [s] for s in sent]
        for pos, j in enumerate(members):
            i = todo[j]
            got = tuple(p[pos] for p in pieces)
            outs[i] = view.from_rows(got[0] if single else got, prepared[i][0])
    return jax.tree.unflatten(treedef, outs)
