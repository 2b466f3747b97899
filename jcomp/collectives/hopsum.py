"""The all-reduce with a codec per mesh axis: `cc.psum`, `cc.pmean` and
`cc.psum_ef` given a dict of codecs (jcomp.collectives.hops re-exports them
beside its reduce-scatter and all-gather hop by hop): raw over the fast hops,
coded over the slow one.

A cluster has a fast link inside a node or slice (NVLink, ICI) and a slow one
between them (InfiniBand, Ethernet, DCN). With the mesh axes split along that
boundary, say ("dcn", "ici"),

    cc.psum(x, ("dcn", "ici"), codec={"dcn": "int4:rot"})

codes only what crosses "dcn"; axes the dict does not name travel raw. It runs
hierarchically, as ZeRO++'s hierarchical gradient reduction and SDP4Bit do by
hand: a reduce-scatter over the raw axes (lax's), the coded all-reduce over the
coded axes on 1/n_raw of the data, an all-gather over the raw axes (lax's).
The slow hop carries 1/n_raw of what a flat coded all-reduce over both axes
would; the fast hops carry what an uncoded all-reduce over them does.

Rows stay apart: psum and psum_ef lay a leaf out as rows
(`rows="independent"`: its R vectors of C elements along the last axis;
`"flat"`: the leaf as one row) and the reduce-scatter hands each device whole
rows or whole pieces of rows (`rowlayout`). Where n_raw does not divide R, each
row is cut along its length into s <= n_raw pieces of ceil(C/s) elements (C
zero-padded to a multiple of s), each a row of its own, s chosen for the fewest padded
elements (n_raw / gcd(R, n_raw) where that divides C, no padding; zero rows
instead where that pads less, as for a few short rows; "flat": s = n_raw). The
fast hops then carry what lax.psum over them carries plus fewer than n_raw
padded elements per row on average: one flat gradient buffer per device (R =
1) moves 1.0x, where padding R up to n_raw rows moved n_raw times that, on
both hops. A piece lies inside one row, so every block, scale and rotation of
the coded step lies inside one row, as for every op. Where n_raw divides R
nothing is cut. (hops' psum_scatter and all_gather keep lax's blocks and lay
out no rows.) With every codec "none" the call is `lax.psum` itself. A plain
string codec means every axis and is `ops.psum` unchanged. The backward moves
nothing under `check_vma` (as `lax.psum`'s); without it, it is the same
hierarchical reduction with `bwd_codec`.
"""
from __future__ import annotations

import functools
from collections.abc import Mapping

import jax
import jax.numpy as jnp
from jax import lax

from jcomp.collectives import arguments, cpu, ops, rowlayout
from jcomp.collectives.buckets import DEFAULT_BUCKET_BYTES
from jcomp.collectives.feedback import _check_residual as check_residual

__all__ = ["psum", "pmean", "psum_ef", "per_axis"]


def per_axis(codec, axes) -> dict | None:
    """{axis: parsed codec} for a dict codec over `axes` (axes it does not name:
    "none"), or None for a single codec. Names outside `axes` are refused."""
    if not isinstance(codec, Mapping):
        return None
    unknown = [a for a in codec if a not in axes]
    if unknown:
        raise ValueError(f"codec names axes {unknown} that the reduction over {axes} does not "
                         "cover; name only its axes (axes not named travel raw)")
    out = {}
    for a in axes:
        try:
            out[a] = arguments.parse(codec.get(a, arguments.NONE))
        except ValueError as e:
            raise ValueError(f"codec[{a!r}]: {e}") from None
    return out


def psum(x, axis_name, *, codec="none", bwd_codec=None, key=None, rows="independent",
         bucket_bytes=DEFAULT_BUCKET_BYTES, axis_index_groups=None):
    """`jax.lax.psum` with a codec per axis (a dict) or one for all (a string, as
    `ops.psum`). See the module doc for the dict form."""
    axes = arguments.axes_of(axis_name)
    fwd = per_axis(codec, axes)
    if fwd is None and not isinstance(bwd_codec, Mapping):
        return ops.psum(x, axis_name, codec=codec, bwd_codec=bwd_codec, key=key, rows=rows,
                        bucket_bytes=bucket_bytes, axis_index_groups=axis_index_groups)
    fwd = fwd or {a: arguments.parse(codec) for a in axes}
    bwd = per_axis(bwd_codec, axes) if bwd_codec is not None else fwd
    if bwd is None:
        bwd = {a: arguments.parse(bwd_codec) for a in axes}
    arguments.check_rows(rows)
    if all(c.kind == "identity" for c in (*fwd.values(), *bwd.values())):
        return lax.psum(x, axis_name, axis_index_groups=axis_index_groups)
    if axis_index_groups is not None:
        raise ValueError("axis_index_groups is not supported with a codec per axis")
    arguments.check_floating(x, {a: str(c) for a, c in fwd.items()})
    for c in (*fwd.values(), *bwd.values()):
        arguments.check_key(key, c)
    cpu.check_scheduler(f"psum over {axes} hop by hop")
    spec = _Spec(axes, tuple(fwd.items()), tuple(bwd.items()), rows, bucket_bytes,
                 ops._checked(axes))
    leaves, treedef = jax.tree.flatten(x)
    return jax.tree.unflatten(treedef, _hier(spec, leaves, key))


def pmean(x, axis_name, **kw):
    """`psum` divided by the number of devices over `axis_name`."""
    if not isinstance(kw.get("codec", "none"), Mapping) and not isinstance(
            kw.get("bwd_codec"), Mapping):
        return ops.pmean(x, axis_name, **kw)
    n = lax.axis_size(arguments.axes_of(axis_name))
    return jax.tree.map(lambda v: v / n, psum(x, axis_name, **kw))


class _Spec(tuple):
    """(axes, fwd codecs, bwd codecs, rows, bucket_bytes, checked): static."""

    def __new__(cls, *parts):
        return super().__new__(cls, parts)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _hier(spec, leaves, key):
    return _forward(spec, leaves, key, spec[1])


def _hier_fwd(spec, leaves, key):
    return _hier(spec, leaves, key), key


def _hier_bwd(spec, key, cts):
    axes, _, bwd, *_ , checked = spec
    if checked:  # the transpose of an all-reduce into an invariant value
        return [arguments.vary(ct, axes) for ct in cts], None
    k = None if key is None else jax.random.fold_in(key, 1)
    return _forward(spec, list(cts), k, bwd), None


_hier.defvjp(_hier_fwd, _hier_bwd)


def _forward(spec, leaves, key, codecs):
    """Each leaf summed over the axes: raw reduce-scatter over the uncoded axes,
    coded all-reduce over the others (one call per codec, in the axes' order),
    raw all-gather back."""
    axes, _, _, rows, bucket_bytes, checked = spec
    codecs = dict(codecs)
    raw = tuple(a for a in axes if codecs[a].kind == "identity")
    coded = [a for a in axes if a not in raw]
    n_raw = lax.axis_size(raw) if raw else 1
    ready, layouts, lives = [], [], []
    for leaf in leaves:
        live = axes
        if checked:  # n identical copies sum to n * x: nothing travels over those axes
            invariant = tuple(a for a in axes if a not in jax.typeof(leaf).mat.varying)
            if invariant:
                leaf = leaf * lax.axis_size(invariant)
            live = tuple(a for a in axes if a not in invariant)
        layouts.append(rowlayout.layout(leaf, n_raw, rows))
        lives.append(live)
        ready.append(layouts[-1].cut(leaf))
    out = list(ready)
    for live in sorted(set(lives)):  # leaves that travel over the same axes
        idx = [i for i, v in enumerate(lives) if v == live]
        part = [ready[i] for i in idx]
        live_raw = tuple(a for a in raw if a in live)
        if live_raw:  # n_raw divides the (piece) rows: whole rows or pieces per device
            part = [lax.psum_scatter(arguments.vary(p, live_raw), live_raw, scatter_dimension=0,
                                     tiled=True) for p in part]
        for j, (codec, group) in enumerate(_runs([a for a in coded if a in live], codecs)):
            k = None if key is None else jax.random.fold_in(key, j)
            part = ops.psum(part, group, codec=codec, bwd_codec=arguments.NONE, key=k, rows=rows,
                            bucket_bytes=bucket_bytes)
        if live_raw:
            part = [lax.all_gather(p, live_raw, axis=0, tiled=True, to="invarying")
                    for p in part]
        for i, p in zip(idx, part):
            out[i] = p
    return [layout.join(o) for o, layout in zip(out, layouts)]


def _runs(coded, codecs):
    """Consecutive coded axes with the same codec, as (codec, axes) pairs: one
    all-reduce over several axes where they share a codec."""
    out = []
    for a in coded:
        if out and str(out[-1][0]) == str(codecs[a]):
            out[-1] = (out[-1][0], out[-1][1] + (a,))
        else:
            out.append((codecs[a], (a,)))
    return [(c, g if len(g) > 1 else g[0]) for c, g in out]


def _split(codec, bwd_codec, axes):
    """-> (raw axes, [(codec spec, coded axes)] in the axes' order, bwd per axis) for a
    codec per axis, or None for a single codec."""
    fwd = per_axis(codec, axes)
    if fwd is None and not isinstance(bwd_codec, Mapping):
        return None
    fwd = fwd or {a: arguments.parse(codec) for a in axes}
    bwd = (fwd if bwd_codec is None else per_axis(bwd_codec, axes)
           or {a: arguments.parse(bwd_codec) for a in axes})
    raw = tuple(a for a in axes if fwd[a].kind == "identity" and bwd[a].kind == "identity")
    runs = []
    for a in axes:
        if a in raw:
            continue
        if runs and (str(fwd[runs[-1][2][0]]), str(bwd[runs[-1][2][0]])) == (str(fwd[a]),
                                                                              str(bwd[a])):
            runs[-1][2].append(a)
        else:
            runs.append((str(fwd[a]), str(bwd[a]), [a]))
    return raw, [(f, b, tuple(g)) for f, b, g in runs]


def psum_ef(x, residual, axis_name, *, codec, key=None, rows="independent",
            bucket_bytes=DEFAULT_BUCKET_BYTES):
    """`ops.psum_ef` with a codec per axis (a dict): x + residual reduce-scattered
    raw over the uncoded axes, the piece this device then holds sent with error
    feedback over the coded axes, the sums gathered raw. The new residual is what
    that piece lost, at the piece's place in a leaf of x's shape (zeros
    elsewhere), so the next step's reduce-scatter hands it back to this device.
    The coded axes must share one codec. Not differentiable."""
    axes = arguments.axes_of(axis_name)
    plan = _split(codec, None, axes)
    if plan is None:
        return ops.psum_ef(x, residual, axis_name, codec=codec, key=key, rows=rows,
                           bucket_bytes=bucket_bytes)
    raw, runs = plan
    if len(runs) > 1:
        raise ValueError(f"psum_ef: the coded axes {[g for _, _, g in runs]} have different "
                         "codecs; error feedback per hop takes one codec for them")
    check_residual("psum_ef", x, residual)
    if not runs:
        return (jax.tree.map(lambda a, r: lax.psum(a + r, axes), x, residual),
                jax.tree.map(jnp.zeros_like, residual))
    cpu.check_scheduler(f"psum_ef over {axes} hop by hop")
    coded, fc = runs[0][2], runs[0][0]
    n_raw = lax.axis_size(raw) if raw else 1
    leaves, treedef = jax.tree.flatten(x)
    res_leaves = treedef.flatten_up_to(residual)
    pieces, layouts = [], []
    for leaf, res in zip(leaves, res_leaves):
        corrected = lax.stop_gradient(arguments.vary(leaf + res.astype(leaf.dtype), axes))
        layouts.append((rowlayout.layout(corrected, n_raw, rows), res.dtype))
        rows_RxC = layouts[-1][0].cut(corrected)  # as psum's: few rows are cut
        pieces.append(lax.psum_scatter(rows_RxC, raw, scatter_dimension=0, tiled=True)
                      if raw else rows_RxC)
    totals, lost = ops.psum_ef(pieces, [jnp.zeros_like(p) for p in pieces],
                               coded if len(coded) > 1 else coded[0], codec=fc, key=key,
                               rows=rows, bucket_bytes=bucket_bytes)
    outs, news = [], []
    for total, miss, (layout, res_dtype) in zip(totals, lost, layouts):
        if raw:
            total = lax.all_gather(total, raw, axis=0, tiled=True, to="invarying")
            start = lax.axis_index(raw) * miss.shape[0]
            miss = lax.dynamic_update_slice_in_dim(
                jnp.zeros((layout.n_rows, layout.width), miss.dtype), miss, start, axis=0)
        outs.append(layout.join(total))
        news.append(layout.join(miss, res_dtype))
    return jax.tree.unflatten(treedef, outs), jax.tree.unflatten(treedef, news)
