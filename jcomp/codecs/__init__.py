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

`row_multiple` is the row length that codes without padding: a collective that
chooses its row length C as a multiple of it sends no padding bytes.

Codecs with `needs_key` (stochastic rounding, random-k) take a PRNG key in
`encode`. Collectives fold the device's axis index into that key
(`jax.random.fold_in(key, lax.axis_index(axis))`) so that devices draw
independent noise; the same key on every device would correlate their errors.

Non-finite inputs are never turned into finite outputs: a NaN or Inf inside a
quantization block makes that block decode to NaN/Inf.

The package, by family: `base` (shapes, Identity, the 16-bit Casts),
`blockwise` (IntQuant, Fp8, `fit`), `rotation` (the Hadamard
transform of the `rot` quantizers), `sparse` (TopK, RandK)
and `spec` (the NAME[:OPTION] grammar, free of the codecs). `parse` below
reads a spec into one of them (`reader` for the byte codecs). `structured`
holds the specs of the structured codecs (PowerSGD, the learned
autoencoder); their algorithms live in jcomp.powersgd and jcomp.autoencoder,
above the collectives they use. Nothing here imports anything outside the
package.
"""
from __future__ import annotations

from typing import Any

from jcomp.codecs.base import Cast, Identity, Payload  # noqa: F401
from jcomp.codecs.blockwise import (  # noqa: F401
    DEFAULT_BLOCK, Fp8, IntQuant, _e4m3_bits, _e4m3_values, block_options, fit)
from jcomp.codecs.rotation import _fwht, _rotate, _unrotate  # noqa: F401
from jcomp.codecs.sparse import RandK, TopK, _num_kept, _top_k_indices  # noqa: F401
from jcomp.codecs.reader import BYTE_CODECS, byte_codec, parse_byte, split  # noqa: F401
from jcomp.codecs.spec import VALID_FORMS, _bad, _fraction_option, key_value_options  # noqa: F401
from jcomp.codecs.structured import Autoencoder, PowerSGD, parse_ae, parse_powersgd  # noqa: F401


def parse(spec) -> Any:
    """Reads a codec spec such as "int8", "int4:block=128:sr", "topk:0.01",
    "powersgd:rank=4" or "ae:dim=32".

    Case-insensitive; surrounding whitespace is ignored. A codec object passes
    through unchanged. Raises ValueError naming the spec and listing the valid
    forms.
    """
    if not isinstance(spec, str):
        if isinstance(spec, (PowerSGD, Autoencoder)):
            return spec
        return parse_byte(spec)
    name, opts = split(spec)
    if name == "powersgd":
        return parse_powersgd(spec)
    if name == "ae":
        return parse_ae(spec)
    return byte_codec(spec, name, opts)
