"""A leaf laid out as rows for a reduce-scatter over n devices that hands each
device whole rows or whole pieces of rows (`hopsum`'s raw hop, `outer`'s shares).

Rows stay apart: a piece lies inside one row (one vector of the leaf's last
axis with rows="independent", the whole leaf with "flat"), and all padding is
zeros at the end of a row or of the rows, so every block, scale and rotation a
codec puts on a piece lies inside one row.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np

from jcomp.collectives import arguments

__all__ = ["Layout", "layout", "pieces_for", "whole_rows", "from_whole_rows"]


class Layout(NamedTuple):
    """A leaf laid out as rows for the raw reduce-scatter over n_raw devices: its
    `r` rows of `c` elements, each cut into `pieces` rows of `width` elements (c
    zero-padded to pieces * width), then zero rows up to `n_rows`, a multiple
    of n_raw. A row's pieces are consecutive rows and all padding is zeros at
    the end of a row or of the rows, so every piece holds one row's elements."""
    shape: tuple
    dtype: Any
    r: int
    c: int
    pieces: int
    width: int
    n_rows: int

    def cut(self, leaf):
        """`leaf` as [n_rows, width] rows in its own dtype."""
        x_RxC = leaf.reshape(self.r, self.c)
        if self.pieces * self.width != self.c:
            x_RxC = jnp.pad(x_RxC, ((0, 0), (0, self.pieces * self.width - self.c)))
        x_RxC = x_RxC.reshape(self.r * self.pieces, self.width)
        pad = self.n_rows - x_RxC.shape[0]
        return jnp.pad(x_RxC, ((0, pad), (0, 0))) if pad else x_RxC

    def join(self, x_RxC, dtype=None):
        """Inverse of `cut`, in `dtype` (default the leaf's): the zero rows dropped,
        each row's pieces put back together and its padding cut off."""
        x_RxC = x_RxC.reshape(-1)[:self.r * self.pieces * self.width]
        x_RxC = x_RxC.reshape(self.r, self.pieces * self.width)[:, :self.c]
        return x_RxC.reshape(self.shape).astype(self.dtype if dtype is None else dtype)


def layout(leaf, n, rows, pieces=None) -> Layout:
    """rows="independent": one row per vector of the last axis, each cut into the
    `pieces_for` that pad least (or `pieces`); "flat": the leaf as one row cut into
    n pieces."""
    size = int(np.prod(leaf.shape, dtype=np.int64))
    c = arguments.last_row(leaf) if rows == "independent" else max(size, 1)
    r = size // c
    if pieces is None:
        pieces = pieces_for(r, c, n) if rows == "independent" else n
    return Layout(leaf.shape, leaf.dtype, r, c, pieces, -(-c // pieces),
                   -(-r * pieces // n) * n)


def pieces_for(r: int, c: int, n: int) -> int:
    """How many pieces to cut each of r rows of c elements into, so that the rows
    divide over n devices with the fewest padded elements (ceil(r s / n) n rows
    of ceil(c / s)); the fewest pieces among those. 1 (no cut) where n divides
    r, as before; for one row (a flat gradient buffer) n pieces where n divides
    c, not n - 1 zero rows that the fast hops would carry in full. s stops at
    n, where every row divides, padded by fewer than n elements: more pieces
    could save a few of those (an odd c) but cut rows shorter than the codec's
    blocks sooner."""
    padded = lambda s: -(-r * s // n) * n * -(-c // s)
    return min(range(1, n + 1), key=lambda s: (padded(s), s))


def whole_rows(leaf, n, rows):
    """Whole rows, the row count padded with zero rows to a multiple of n (rows
    are not cut): the layout outer.py's `_piece` shares out, inverted by
    `from_whole_rows`."""
    return layout(leaf, n, rows, pieces=1 if rows == "independent" else n).cut(leaf)


def from_whole_rows(x_RxC, shape, dtype):
    """Inverse of `whole_rows`: its padding is all at the end."""
    size = int(np.prod(shape, dtype=np.int64))
    return x_RxC.reshape(-1)[:size].reshape(shape).astype(dtype)
