"""A checksum of each array of a pytree that does not depend on how it is
sharded: what `jcomp.train.run.checkpoint` stores beside a train state and checks on
restore, since orbax's bulk array data carries no checksum of its own.

    sums = tree_checksums(state)     # {'params/w_DxF': '0123456789abcdef', ...}
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

_GOLDEN = 0x9E3779B9


def _fmix32(h_N):
    """MurmurHash3's finalizer: a bijection of uint32, so distinct words stay distinct."""
    h_N = h_N ^ (h_N >> 16)
    h_N = h_N * jnp.uint32(0x85EBCA6B)
    h_N = h_N ^ (h_N >> 13)
    h_N = h_N * jnp.uint32(0xC2B2AE35)
    return h_N ^ (h_N >> 16)


def _as_words(x):
    """The bits of `x` as uint32 words: same shape, plus a trailing dim for 8-byte dtypes."""
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    size = x.dtype.itemsize
    if size == 4:
        return lax.bitcast_convert_type(x, jnp.uint32)
    if size in (1, 2):
        return lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * size}")).astype(jnp.uint32)
    return lax.bitcast_convert_type(x, jnp.uint32)  # [..., itemsize // 4]


def _flat_index(shape):
    """Row-major position of each element as uint32 (wrapping), built without a reshape
    so that a sharded array is never gathered."""
    idx = jnp.zeros(shape, jnp.uint32)
    stride = 1
    for d in reversed(range(len(shape))):
        idx = idx + lax.broadcasted_iota(jnp.uint32, shape, d) * jnp.uint32(stride % 2**32)
        stride *= shape[d]
    return idx


def _leaf_sums(x):
    """Two uint32 sums over the elements of `x`, each term a bijection of the element's
    bits keyed by its position. Integer sums are exact in any order, so the result does
    not depend on the sharding, and changing any one element changes both sums."""
    w = _as_words(x)
    pos = _flat_index(w.shape)
    a = _fmix32(w + _fmix32(pos * jnp.uint32(_GOLDEN)))
    b = _fmix32(w ^ _fmix32(pos * jnp.uint32(_GOLDEN) + jnp.uint32(1)))
    return jnp.sum(a, dtype=jnp.uint32), jnp.sum(b, dtype=jnp.uint32)


_tree_sums = jax.jit(lambda leaves: [_leaf_sums(x) for x in leaves])


def path_name(path) -> str:
    """A key path as 'a/b/0', the spelling orbax's stored tree also flattens to."""
    parts = []
    for k in path:
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
        else:
            parts.append(str(k))
    return "/".join(parts)


def _host_int(x) -> int:
    # A reduction's result is replicated; every process holds a copy of it.
    return int(np.asarray(x.addressable_shards[0].data))


def tree_checksums(state) -> dict[str, str]:
    """{'a/b/0': 16 hex digits} for each array of `state`, independent of its sharding."""
    named = jax.tree_util.tree_flatten_with_path(state)[0]
    for path, leaf in named:
        if not isinstance(leaf, (jax.Array, np.ndarray, np.generic)):
            raise TypeError(
                f"state leaf {path_name(path)!r} must be a jax.Array or numpy array; "
                f"got {type(leaf).__name__}"
            )
        if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            raise TypeError(
                f"state leaf {path_name(path)!r} is a typed PRNG key; "
                "store jax.random.key_data(key) instead"
            )
    # One jitted call per set of devices: a call cannot mix arrays committed to
    # different devices (a restored scalar sits on one device, the weights on the mesh).
    groups: dict = {}
    for i, (_, leaf) in enumerate(named):
        devices = leaf.sharding.device_set if isinstance(leaf, jax.Array) else None
        groups.setdefault(frozenset(d.id for d in devices or ()), []).append(i)
    sums = [None] * len(named)
    for idx in groups.values():
        for i, pair in zip(idx, _tree_sums([named[i][1] for i in idx])):
            sums[i] = pair
    return {
        path_name(path): f"{_host_int(a):08x}{_host_int(b):08x}"
        for (path, _), (a, b) in zip(named, sums)
    }
