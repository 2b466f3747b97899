"""jcomp/codecs/sparsepack.py: SparseLoCo's chunk payload, positions near their
entropy and values on four levels."""
import math

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jcomp.codecs import sparsepack as sp


def _positions(rng, rows, c, k):
    return np.sort(np.stack([rng.choice(c, k, replace=False) for _ in range(rows)]),
                   axis=-1).astype(np.int32)


@functools.partial(jax.jit, static_argnums=(1,))
def _round_trip(idx, c):
    code = sp.encode_positions(idx, c)
    return code, sp.decode_positions(code, c, idx.shape[1])


@pytest.mark.parametrize("c", [4096, 1000])
@pytest.mark.parametrize("density", [1 / 256, 1 / 64, 1 / 16, 1 / 8, 1 / 4])
def test_positions_round_trip_exactly(c, density):
    """Random sets, and the extremes (the first k, the last k, evenly spread)."""
    k = max(1, int(c * density))
    rng = np.random.default_rng(k + c)
    idx = np.concatenate([_positions(rng, 6, c, k), np.arange(k)[None], (c - k + np.arange(k))[None],
                          (np.arange(k) * (c // k))[None]]).astype(np.int32)
    code, back = _round_trip(jnp.asarray(idx), c)
    assert code.dtype == jnp.uint8 and code.shape == (len(idx), sp.position_bytes(c, k))
    np.testing.assert_array_equal(np.asarray(back), idx)


@pytest.mark.parametrize("c,k", [(4096, 16), (4096, 64), (4096, 256), (4096, 1024), (1000, 37)])
def test_positions_cost_at_most_two_bits_over_log2_c_over_k(c, k):
    """Elias-Fano's bound for every set: k (2 + log2(c / k)) bits (a byte for the
    padding); never more than the bitmap's c bits or uint16's 16 k."""
    got = 8 * sp.position_bytes(c, k)
    assert got <= k * (2 + math.log2(c / k)) + 8
    assert got <= c + 7 and got <= 16 * k
    entropy = math.log2(math.comb(c, k))
    assert got >= entropy  # no code beats it; the check keeps position_bytes honest


def test_at_256_of_4096_a_chunk_sends_under_two_percent_of_float32():
    """64 B of 2-bit values + 8 B of magnitudes + 192 B of positions = 264 B,
    0.0161 of 16,384 B (the uint16 coder: 580 B, 0.0354)."""
    assert sp.position_bytes(4096, 256) == 192
    assert sp.value_bytes(256) == 72
    assert (sp.position_bytes(4096, 256) + sp.value_bytes(256)) / (4096 * 4) <= 0.02


def test_all_four_levels_carry_heavy_tailed_values():
    """Student-t (3 degrees of freedom), the top 256 of each 4096-entry chunk:
    every chunk decodes to exactly four values (+-lo, +-hi), each used by a
    sizeable share of the entries, and the error is below the three-level
    int2 rule's (largest magnitude as the scale, codes -1, 0, +1)."""
    rng = np.random.default_rng(0)
    x_RxC = rng.standard_t(3, (8, 4096)).astype(np.float32)
    idx = np.sort(np.argpartition(-np.abs(x_RxC), 256, axis=-1)[:, :256], axis=-1)
    kept = np.take_along_axis(x_RxC, idx, axis=-1)
    code = jax.jit(sp.encode_values)(jnp.asarray(kept))
    out = np.asarray(jax.jit(sp.decode_values, static_argnums=1)(code, 256))
    for r in range(8):
        levels, counts = np.unique(out[r], return_counts=True)
        assert len(levels) == 4 and (levels < 0).sum() == 2, levels
        assert counts.min() >= 8, counts
        np.testing.assert_array_equal(np.sign(out[r]), np.sign(kept[r]))
    s = np.abs(kept).max(-1, keepdims=True)
    three = np.round(kept / s) * s
    assert np.abs(out - kept).sum() < 0.5 * np.abs(three - kept).sum()
    assert (three != 0).mean() < 0.3  # most kept entries sent as zeros by the int2 rule


def test_nan_and_inf_are_never_made_finite():
    v = np.ones((3, 8), np.float32)
    v[0, 2] = np.nan
    v[1, 5] = np.inf
    v[2, 1] = -np.inf
    out = np.asarray(sp.decode_values(sp.encode_values(jnp.asarray(v)), 8))
    assert np.isnan(out[0]).all()
    assert out[1, 5] == np.inf and np.isfinite(np.delete(out[1], 5)).all()
    assert out[2, 1] == -np.inf


def test_a_row_codes_alone():
    """Changing one chunk's entries moves nothing in the other chunks' payload."""
    rng = np.random.default_rng(1)
    v = rng.standard_normal((4, 64)).astype(np.float32)
    w = v.copy()
    w[2] *= 7.0
    a, b = sp.encode_values(jnp.asarray(v)), sp.encode_values(jnp.asarray(w))
    for name in ("q", "scale"):
        keep = np.array([0, 1, 3])
        np.testing.assert_array_equal(np.asarray(a[name])[keep], np.asarray(b[name])[keep])
