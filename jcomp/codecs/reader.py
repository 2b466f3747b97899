"""Reads a byte codec's spec ("int8", "int4:block=128:sr", "topk:0.01", ...)."""
from __future__ import annotations

import jax.numpy as jnp

from jcomp.codecs.base import Cast, Identity
from jcomp.codecs.blockwise import Fp8, IntQuant, block_options
from jcomp.codecs.microscale import Mx, NvFp4
from jcomp.codecs.sparse import RandK, TopK
from jcomp.codecs.spec import _bad, _fraction_option


def byte_codec(spec: str, name: str, opts: list):
    """The byte codec `name` with options `opts` (the spec split at ':'); ValueError
    naming `spec` otherwise."""
    plain = {"none": Identity, "bf16": lambda: Cast("bf16", jnp.bfloat16),
             "fp16": lambda: Cast("fp16", jnp.float16)}
    if name in plain:
        if opts:
            raise _bad(spec, f"{name!r} takes no options")
        return plain[name]()
    if name in ("int8", "int4", "int2"):
        block, sr, rot = block_options(spec, opts, allow_sr=True)  # its errors name the spec
        try:  # IntQuant refuses a rotation over a block that is no power of two
            return IntQuant(int(name[3:]), block, sr, rot)
        except ValueError as e:
            raise _bad(spec, str(e)) from None
    if name in ("mxfp8", "mxfp4", "nvfp4"):
        block, sr, rot = block_options(spec, opts, allow_sr=True,
                                       default=16 if name == "nvfp4" else 32)
        try:
            return NvFp4(block, sr, rot) if name == "nvfp4" else Mx(int(name[4:]), block, sr, rot)
        except ValueError as e:
            raise _bad(spec, str(e)) from None
    if name == "fp8":
        block, _, _ = block_options(spec, opts, allow_sr=False)
        return Fp8(block)
    if name in ("topk", "randk"):
        return (TopK if name == "topk" else RandK)(_fraction_option(spec, name, opts))
    raise _bad(spec, f"unknown codec {name!r}")


def split(spec: str) -> tuple[str, list]:
    """ " Int4:Block=64 " -> ("int4", ["block=64"])."""
    name, *opts = [part.strip() for part in spec.strip().lower().split(":")]
    return name, opts


def parse_byte(spec):
    """A byte codec object passes through; a string is read by `byte_codec`."""
    if not isinstance(spec, str):
        if hasattr(spec, "encode") and hasattr(spec, "wire_bytes"):
            return spec
        raise TypeError(f"codec spec must be a string or a codec; got {type(spec).__name__}")
    return byte_codec(spec, *split(spec))
