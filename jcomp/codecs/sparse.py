"""Sparse codecs: top-k and random-k, values plus int32 indices of a fraction of
each row."""
from __future__ import annotations

import dataclasses
import fractions
import math
from typing import ClassVar

import jax
import jax.numpy as jnp

from jcomp.codecs.base import Payload, _as_rows, _check_float, _itemsize, _numel, _rows_shape


def _check_fraction(fraction):
    ok = isinstance(fraction, (int, float)) and not isinstance(fraction, bool)
    if not ok or not 0.0 < fraction <= 1.0:
        raise ValueError(f"fraction F must be a float with 0 < F <= 1; got {fraction!r}")


def _num_kept(fraction: float, c: int) -> int:
    """k = ceil(F*C), at least 1 and at most C. F is read as the decimal it
    prints as, so 0.01 * 300 gives 3 rather than ceil(3.0000000000000004)."""
    k = math.ceil(fractions.Fraction(repr(float(fraction))) * c)
    return min(max(k, 1), c)


def top_k_indices(score_RxC, k: int):
    """Indices of the k largest scores of every row -> int32 (*lead, k).

    Scores are non-negative floats (no NaN). Ties go to the lower index, as in
    `lax.top_k`. Which k indices are chosen is exact; their order within the
    row is not part of the result (`lax.top_k` order for k <= C/40, index
    order above, where a threshold search beats XLA's partial sort, whose cost
    grows with k: 4x faster at k = C/10 on a million elements).
    """
    lead, c = score_RxC.shape[:-1], score_RxC.shape[-1]
    score_RxC = score_RxC.reshape(-1, c)
    if _THRESHOLD_SELECT * k > c:
        idx_RxK = _threshold_top_k(score_RxC, k)
    elif score_RxC.shape[0] <= _UNROLLED_ROWS:
        # One `lax.top_k` per row: XLA:CPU runs a row's top-k as a partial sort,
        # but once the rows of a batched top-k are sliced apart (as an
        # all_to_all does with the payload) it rewrites the whole top-k into a
        # full sort of every row, about 100x slower at a million elements.
        idx_RxK = jnp.stack([jax.lax.top_k(row_C, k)[1] for row_C in score_RxC])
    else:
        idx_RxK = jax.lax.map(lambda row_C: jax.lax.top_k(row_C, k)[1], score_RxC)
    return idx_RxK.astype(jnp.int32).reshape(*lead, k)


_THRESHOLD_SELECT = 40  # threshold search when k > C / 40
_UNROLLED_ROWS = 8


def _threshold_top_k(score_RxC, k: int):
    """Indices of the k largest non-negative scores of every row, in index order.

    The bits of a non-negative float32 order like its value, so the k-th
    largest score of a row is found by bisection over the 31 value bits (one
    counting pass each). Everything above it is kept, and the first of the
    entries equal to it (lowest index first) until there are k.
    """
    r, c = score_RxC.shape
    key_RxC = jax.lax.bitcast_convert_type(score_RxC.astype(jnp.float32), jnp.int32)

    def halve(_, bounds):
        # invariant: at least k keys >= lo, fewer than k keys >= hi
        lo_R, hi_R = bounds
        mid_R = lo_R + (hi_R - lo_R) // 2
        enough_R = jnp.sum(key_RxC >= mid_R[:, None], axis=-1) >= k
        return jnp.where(enough_R, mid_R, lo_R), jnp.where(enough_R, hi_R, mid_R)

    # Bounds computed from the keys carry their type, including how they vary
    # over mesh axes inside shard_map, as the loop requires.
    lo_R = key_RxC[:, 0] * 0
    kth_R = jax.lax.fori_loop(0, 31, halve, (lo_R, lo_R + 0x7F800001))[0]  # +inf bits + 1
    above_RxC = key_RxC > kth_R[:, None]
    tied_RxC = key_RxC == kth_R[:, None]
    need_Rx1 = (k - jnp.sum(above_RxC, axis=-1))[:, None]
    # Running counts by associative scan: XLA:CPU's cumsum is 3x slower here.
    n_above_RxC = jax.lax.associative_scan(jnp.add, above_RxC.astype(jnp.int32), axis=-1)
    n_tied_RxC = jax.lax.associative_scan(jnp.add, tied_RxC.astype(jnp.int32), axis=-1)
    keep_RxC = above_RxC | (tied_RxC & (n_tied_RxC <= need_Rx1))
    slot_RxC = n_above_RxC + jnp.minimum(n_tied_RxC, need_Rx1) - 1 + k * jnp.arange(r)[:, None]
    slot_RxC = jnp.where(keep_RxC, slot_RxC, r * k)  # r*k is out of range: dropped
    col_RxC = jnp.broadcast_to(jnp.arange(c, dtype=jnp.int32), (r, c))
    idx = jnp.zeros((r * k,), jnp.int32).at[slot_RxC.reshape(-1)].set(
        col_RxC.reshape(-1), mode="drop")
    return idx.reshape(r, k)


@dataclasses.dataclass(frozen=True)
class _Sparse:
    """What top-k and random-k share: a fraction F of each row, the entries of
    the k = ceil(F*C) largest `_scores`, sent as values plus int32 indices and
    scattered back into zeros.
    Payload: {"values": x.dtype (*lead, k), "indices": int32 (*lead, k)}."""

    fraction: float
    kind: ClassVar[str] = "sparse"
    row_multiple: ClassVar[int] = 1

    def __post_init__(self):
        _check_fraction(self.fraction)
        object.__setattr__(self, "fraction", float(self.fraction))

    def encode(self, x, *, key=None) -> Payload:
        x = _as_rows(jnp.asarray(x))
        _check_float(x, self.name)
        k = _num_kept(self.fraction, x.shape[-1])
        idx = top_k_indices(self._scores(x, key), k)
        values = jnp.take_along_axis(x, idx, axis=-1)
        # More non-finite entries than k: some cannot be sent, and they would
        # decode as zeros. The row's kept values go NaN instead, so the loss turns
        # NaN rather than the Infs vanishing into finite numbers.
        lost = jnp.sum(~jnp.isfinite(x), axis=-1, keepdims=True) > k
        return {"values": jnp.where(lost, jnp.nan, values).astype(x.dtype), "indices": idx}

    def decode(self, payload: Payload, shape, dtype):
        rows = _rows_shape(shape)
        vals_RxK = payload["values"].reshape(-1, payload["values"].shape[-1]).astype(dtype)
        idx_RxK = payload["indices"].reshape(vals_RxK.shape)
        r = jnp.arange(vals_RxK.shape[0])[:, None]
        out_RxC = jnp.zeros((vals_RxK.shape[0], rows[-1]), dtype).at[r, idx_RxK].set(vals_RxK)
        return out_RxC.reshape(shape)

    def wire_bytes(self, shape, dtype) -> int:
        rows = _rows_shape(shape)
        return _numel(rows[:-1]) * _num_kept(self.fraction, rows[-1]) * (_itemsize(dtype) + 4)

    def __str__(self):
        return f"{self.name}:{self.fraction!r}"


@dataclasses.dataclass(frozen=True)
class TopK(_Sparse):
    """`topk:F`: per row, the k entries largest in magnitude.

    NaN ranks as +inf magnitude, so non-finite entries are kept first: none is
    dropped while k >= their number. A row with more non-finite entries than k
    sends its k values as NaN (see `_Sparse.encode`)."""

    needs_key: ClassVar[bool] = False
    name: ClassVar[str] = "topk"

    def _scores(self, x, key):
        mag = jnp.abs(x.astype(jnp.float32))
        return jnp.where(jnp.isnan(mag), jnp.inf, mag)


@dataclasses.dataclass(frozen=True)
class RandK(_Sparse):
    """`randk:F`: per row, k indices drawn uniformly without replacement from
    `key` (required).

    Values are sent as they are, not rescaled by C/k: the result is a biased
    estimate of x, meant for use with error feedback, which carries the unsent
    remainder to the next step. Non-finite entries are always picked first (up
    to k) so a NaN/Inf is not hidden by chance; past k, the row's values go NaN
    (as for top-k)."""

    needs_key: ClassVar[bool] = True
    name: ClassVar[str] = "randk"

    def _scores(self, x, key):
        if key is None:
            raise ValueError(f"codec {str(self)!r} draws random indices and needs key=")
        # The k largest of iid uniforms are a uniform k-subset.
        score = jax.random.uniform(key, x.shape, jnp.float32)
        return jnp.where(jnp.isfinite(x), score, 2.0)
