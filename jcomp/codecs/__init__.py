"""Codecs: what a compressed collective actually puts on the wire.

A codec is a small immutable object that codes each slice along the *last* axis
of its input independently, so a collective encodes one row per peer at once:

  payload = codec.encode(x_RxC, key=None)   # pytree of arrays, leading dims R
  x_RxC   = codec.decode(payload, (R, C), dtype)
  nbytes  = codec.wire_bytes((R, C), dtype) # exact bytes of `payload`

`kind` says how partial results combine: "identity" (collectives call `jax.lax`
unchanged), "dense" (decode, sum in float32, code again), "sparse" (scatter-add)
or, for the structured codecs, "lowrank" and "learned". `row_multiple` is the
row length that codes without padding; `needs_key` codecs draw random numbers.
A NaN or Inf is never coded into a finite number. Modules, by family:

  base        shapes, dtype checks, identity and the 16-bit casts
  blockwise   int8/int4/int2 and fp8 (block scales, packing), fit and fit_row
  microscale  mxfp8, mxfp4, nvfp4
  formats     the narrow floats' bits (E4M3, E2M1, E8M0)
  rotation    the Hadamard rotation of `:rot`, and the GPU form's pieces
  gpu         the rotated codecs' Pallas kernels (IntQuant, Mx, NvFp4)
  sparse      top-k, random-k
  sparsepack  SparseLoCo's packed positions and values
  spec        the grammar: every reader of a spec string, byte codecs and structured
  structured  the specs of jcomp.powersgd and jcomp.autoencoder (PowerSGD, Autoencoder)

`parse` reads a string through `spec` alone. Nothing here imports from outside
the package.
"""
from __future__ import annotations

from typing import Any

from jcomp.codecs.base import Cast, Identity, Payload  # noqa: F401
from jcomp.codecs.blockwise import DEFAULT_BLOCK, Fp8, IntQuant, fit, fit_row  # noqa: F401
from jcomp.codecs.microscale import Mx, NvFp4  # noqa: F401
from jcomp.codecs.sparse import RandK, TopK  # noqa: F401
from jcomp.codecs.spec import VALID_FORMS  # noqa: F401
from jcomp.codecs.spec import byte_codec, parse_byte, split, structured_codec
from jcomp.codecs.structured import Autoencoder, PowerSGD, parse_ae, parse_powersgd  # noqa: F401


def parse(spec) -> Any:
    """Reads a codec spec such as "int8", "int4:block=128:sr", "nvfp4:rot", "topk:0.01",
    "powersgd:rank=4" or "ae:dim=32".

    Case-insensitive; surrounding whitespace is ignored. A codec object passes
    through unchanged. Raises ValueError naming the spec and listing the valid
    forms.
    """
    if not isinstance(spec, str):
        return spec if isinstance(spec, (PowerSGD, Autoencoder)) else parse_byte(spec)
    name, opts = split(spec)
    structured = {"powersgd": PowerSGD, "ae": Autoencoder}.get(name)
    return structured_codec(spec, structured) if structured else byte_codec(spec, name, opts)
