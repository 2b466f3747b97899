"""What every codec shares: row shapes, dtype checks, the spec text a codec
prints (`_join`), and the two codecs that do not quantize (identity and the
16-bit casts)."""
from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

Payload = Any  # a dict of arrays


def _itemsize(dtype) -> int:
    return jnp.dtype(dtype).itemsize


def _check_float(x, name: str):
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"codec {name!r} codes floating-point arrays; got dtype {x.dtype}")


def _as_rows(x):
    """A 0-d array is coded as one element; everything else keeps its shape."""
    return x.reshape(1) if x.ndim == 0 else x


def _join(*parts: str) -> str:
    """A codec's spec text, NAME[:OPTION]..., from its non-empty parts (`__str__`)."""
    return ":".join(p for p in parts if p)


def _rows_shape(shape) -> tuple:
    """The shape actually coded for an input of `shape` (0-d becomes (1,))."""
    shape = tuple(int(s) for s in shape)
    return shape if shape else (1,)


@dataclasses.dataclass(frozen=True)
class Identity:
    """`none`: sends the array as it is. Collectives call `jax.lax` directly."""

    name: str = "none"
    kind: str = "identity"
    needs_key: bool = False
    row_multiple: ClassVar[int] = 1

    def encode(self, x, *, key=None) -> Payload:
        return {"x": x}

    def decode(self, payload: Payload, shape, dtype):
        return payload["x"].reshape(shape).astype(dtype)

    def wire_bytes(self, shape, dtype) -> int:
        return _numel(shape) * _itemsize(dtype)

    def __str__(self):
        return self.name


@dataclasses.dataclass(frozen=True)
class Cast:
    """`bf16` / `fp16`: a plain cast to a narrower float. Inf/NaN survive the cast;
    fp16 overflows to +-Inf above 65504 (it never saturates to a finite value).

    The 16-bit values travel as uint16 bits: XLA on CPU widens bf16 collectives
    to f32 in the compiled program, which would send the full f32 bytes.
    """

    name: str
    wire_dtype: Any
    kind: str = "dense"
    needs_key: bool = False
    row_multiple: ClassVar[int] = 1

    def encode(self, x, *, key=None) -> Payload:
        _check_float(x, self.name)
        narrow = _as_rows(x).astype(self.wire_dtype)
        return {"x": jax.lax.bitcast_convert_type(narrow, jnp.uint16)}

    def decode(self, payload: Payload, shape, dtype):
        narrow = jax.lax.bitcast_convert_type(payload["x"], self.wire_dtype)
        return narrow.reshape(shape).astype(dtype)

    def wire_bytes(self, shape, dtype) -> int:
        return max(_numel(shape), 1) * _itemsize(self.wire_dtype)

    def __str__(self):
        return self.name


def _numel(shape) -> int:
    return math.prod(int(s) for s in shape)
