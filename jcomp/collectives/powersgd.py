"""PowerSGD: rank-R data-parallel gradient reduction (Vogels et al., NeurIPS 2019).

    psgd = powersgd.parse("powersgd:rank=4:factor=bf16:fallback=int8")
    mean_g, q, res = powersgd.reduce(g, q, res, "data", codec=psgd)   # inside shard_map

A gradient leaf is a matrix M (m, n), m = prod(shape[:-1]) and n = shape[-1], so
stacked layers share one right factor Q. One step is one power iteration
warm-started from the previous step's Q (the paper's Algorithm 1, with error
feedback as in its Algorithm 2):

    M_i = g_i + e_i                       data rank i: gradient plus residual
    P   = sum_i M_i Q                     all-reduce of (m, R) over 'data'
    P^  = orthonormal basis of P          float32 QR, same on every rank
    Q'  = mean_i M_i^T P^                 all-reduce of (n, R) over 'data'
    out = P^ Q'^T                         the mean gradient's rank-R estimate
    e_i = M_i - out                       what rank i's contribution still owes

The residual is taken against the aggregated estimate, as the paper's
reference code and torch's PowerSGD hook do, so that D * out + sum_i e_i(new)
== sum_i (g_i + e_i(old)) exactly, even with a lossy factor codec. Q' is the
next step's Q, the same on every data rank.

A vector, or a leaf where low rank would not save `min_compression`x
((m + n) * R * min_compression >= m * n), goes through the `fallback` codec.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from jcomp import collectives as cc
from jcomp.codecs import structured

Q_SEED = 0  # every data rank draws the same initial Q from it
PowerSGD, parse = structured.PowerSGD, structured.parse_powersgd  # the spec, beside the codecs'


# ------------------------------------------------------------------ shapes

def matrix_shape(shape) -> tuple[int, int]:
    """(m, n) = (prod(shape[:-1]), shape[-1]); a 0-d leaf is (1, 1)."""
    shape = tuple(int(s) for s in shape)
    return (math.prod(shape[:-1]), shape[-1]) if shape else (1, 1)


def compresses(shape, codec: PowerSGD) -> bool:
    """Whether a leaf of `shape` goes low rank (else through the fallback codec)."""
    m, n = matrix_shape(shape)
    return len(shape) >= 2 and (m + n) * codec.rank * codec.min_compression < m * n


def init_q(key, shape, rank: int):
    """Initial Q: standard normal float32 of `shape` + (rank,); pass the same key
    on every data rank."""
    return jax.random.normal(key, (*shape, rank), jnp.float32)


def init_qs(shapes):
    """Initial Qs of a tree of (..., n, R) shapes (ShapeDtypeStructs or arrays):
    leaf i is `init_q` from fold_in(key(Q_SEED), i), the same on every data rank."""
    leaves, treedef = jax.tree.flatten(shapes)
    key = jax.random.key(Q_SEED)
    qs = [init_q(jax.random.fold_in(key, i), a.shape[:-1], a.shape[-1])
          for i, a in enumerate(leaves)]
    return jax.tree.unflatten(treedef, qs)


def orthogonalize(p_MxR):
    """An orthonormal basis of the columns of p_MxR (m >= R), by float32 QR."""
    return jnp.linalg.qr(p_MxR.astype(jnp.float32), mode="reduced")[0]


# ---------------------------------------------------------------- reduce

def _mm(a, b):
    # Full float32 products: default precision on GPUs/TPUs would round the factors.
    return jnp.matmul(a, b, precision=lax.Precision.HIGHEST)


def _dense(grad, residual, axis, codec, key):
    d = lax.axis_size(axis)
    if residual is None:
        return cc.psum(grad, axis, codec=codec, key=key, rows="flat") / d, None
    total, new_res = cc.psum_ef(grad, residual, axis, codec=codec, key=key, rows="flat")
    return total / d, new_res


def reduce(grad_local, q_state, residual, axis="data", *, codec, key=None):
    """Mean over `axis` of one gradient leaf, rank `codec.rank` (inside shard_map).

    grad_local: this rank's gradient, any shape S, varying over `axis`.
    q_state:    (n, R) float32, the previous step's Q (or `init_q`), invariant over `axis`.
    residual:   shape S float32 error feedback, or None to keep none.
    -> (mean gradient of shape S and grad_local's dtype, invariant over `axis`;
        next (n, R) Q, invariant over `axis`; new residual or None).
    """
    codec = parse(codec)
    shape = grad_local.shape
    m, n = matrix_shape(shape)
    if q_state.shape != (n, codec.rank):
        raise ValueError(f"q_state: shape {q_state.shape}; expected (n, rank) = "
                         f"({n}, {codec.rank}) for a gradient of shape {shape}")
    if residual is not None and residual.shape != shape:
        raise ValueError(f"residual: shape {residual.shape}; expected the gradient's {shape}")
    if not compresses(shape, codec):
        mean, new_res = _dense(grad_local, residual, axis, codec.fallback, key)
        return mean, q_state, new_res
    k_p, k_q = (None, None) if key is None else tuple(jax.random.split(key))
    m_MxN = grad_local.astype(jnp.float32).reshape(m, n)
    if residual is not None:
        m_MxN = m_MxN + residual.astype(jnp.float32).reshape(m, n)
    p_MxR = cc.psum(_mm(m_MxN, q_state.astype(jnp.float32)), axis,
                    codec=codec.factor_codec, key=k_p, rows="flat")
    p_MxR = orthogonalize(p_MxR)
    q_NxR = cc.psum(_mm(m_MxN.T, p_MxR), axis, codec=codec.factor_codec, key=k_q, rows="flat")
    q_NxR = q_NxR / lax.axis_size(axis)
    approx_MxN = _mm(p_MxR, q_NxR.T)
    new_res = None if residual is None else (m_MxN - approx_MxN).reshape(shape)
    return approx_MxN.reshape(shape).astype(grad_local.dtype), q_NxR, new_res


def reduce_shards(flats, p_leaves, q_leaves, res, codec, key):
    """`reduce` of each leaf's local block over 'data', for the ZeRO optimizer.

    flats: zero-padded [d*c] local gradients (d = data ranks, c = a shard);
    p_leaves: the local params (shapes); q_leaves: (1, 1, n, R) Qs; res: [d*c]
    residuals or None. -> (this rank's [c] slices of the mean gradients, new Qs,
    new [d*c] residuals or None)."""
    d, r = lax.axis_size("data"), lax.axis_index("data")
    own, new_qs, new_res = [], [], []
    for i, (flat, p, q) in enumerate(zip(flats, p_leaves, q_leaves)):
        pad = flat.size - p.size
        res_leaf = None if res is None else res[i][:p.size].reshape(p.shape)
        k = None if key is None else jax.random.fold_in(key, i)
        mean, q_new, res_new = reduce(flat[:p.size].reshape(p.shape),
                                      q.reshape(q.shape[-2:]), res_leaf, "data", codec=codec,
                                      key=k)
        mean_flat = jnp.pad(mean.reshape(-1).astype(jnp.float32), (0, pad))
        own.append(lax.dynamic_slice_in_dim(mean_flat, r * (flat.size // d), flat.size // d))
        new_qs.append(q_new.reshape(q.shape))
        if res_new is not None:
            new_res.append(jnp.pad(res_new.reshape(-1), (0, pad)))
    return own, new_qs, (new_res if res is not None else None)
