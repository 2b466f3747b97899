"""Codecs: what a compressed collective actually puts on the wire.

A codec is a small immutable object. It codes each slice along the *last*
axis of its input independently, so a collective can split a buffer into one
row per peer (`x_NxC`) and encode all rows at once:

  payload = codec.encode(x_RxC, key=None)   # pytree of arrays, leading dims R
  x_RxC   = codec.decode(payload, (R, C), dtype)
  nbytes  = codec.wire_bytes((R, C), dtype) # exact bytes of `payload`

Leading dimensions are arbitrary (`x` of shape (*lead, C) gives payload leaves
with leading dims `lead`); a 0-d input is coded as shape (1,).

`kind` tells a collective how partial results combine:
  "identity": no coding at all; collectives call `jax.lax` unchanged.
  "dense":    payload rows can be decoded, summed in float32 and re-encoded.
  "sparse":   payload is (values, indices); sums are scatter-adds.

Non-finite inputs are never turned into finite outputs: a NaN or Inf inside a
quantization block makes that block decode to NaN/Inf.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

Payload = Any  # a dict of arrays

VALID_FORMS = (
    "none",
    "bf16",
    "fp16",
    "fp8[:block=N]",
    "int8[:block=N][:sr]",
    "int4[:block=N][:sr]",
    "int2[:block=N][:sr]",
    "topk:F  (0 < F <= 1)",
    "randk:F (0 < F <= 1)",
)


def _itemsize(dtype) -> int:
    return jnp.dtype(dtype).itemsize


def _check_float(x, name: str):
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"codec {name!r} codes floating-point arrays; got dtype {x.dtype}")


def _as_rows(x):
    """A 0-d array is coded as one element; everything else keeps its shape."""
    return x.reshape(1) if x.ndim == 0 else x


@dataclasses.dataclass(frozen=True)
class Identity:
    """`none`: sends the array as it is. Collectives call `jax.lax` directly."""

    name: str = "none"
    kind: str = "identity"
    needs_key: bool = False

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
    fp16 overflows to +-Inf above 65504 (it never saturates to a finite value)."""

    name: str
    wire_dtype: Any
    kind: str = "dense"
    needs_key: bool = False

    def encode(self, x, *, key=None) -> Payload:
        _check_float(x, self.name)
        return {"x": _as_rows(x).astype(self.wire_dtype)}

    def decode(self, payload: Payload, shape, dtype):
        return payload["x"].reshape(shape).astype(dtype)

    def wire_bytes(self, shape, dtype) -> int:
        return max(_numel(shape), 1) * _itemsize(self.wire_dtype)

    def __str__(self):
        return self.name


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def parse(spec) -> Any:
    """Reads a codec spec such as "int8", "int4:block=128:sr", "topk:0.01".

    A codec object passes through unchanged. Raises ValueError naming the spec
    and listing the valid forms.
    """
    if not isinstance(spec, str):
        if hasattr(spec, "encode") and hasattr(spec, "wire_bytes"):
            return spec
        raise TypeError(f"codec spec must be a string or a codec; got {type(spec).__name__}")
    text = spec.strip().lower()
    if text == "none":
        return Identity()
    if text == "bf16":
        return Cast("bf16", jnp.bfloat16)
    if text == "fp16":
        return Cast("fp16", jnp.float16)
    raise _bad(spec, "unknown codec")


def _bad(spec, why: str) -> ValueError:
    return ValueError(
        f"invalid codec spec {spec!r}: {why}. Valid forms: " + ", ".join(VALID_FORMS)
    )
