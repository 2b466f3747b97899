"""The codec spec grammar, NAME[:OPTION]...: every reader of a spec string.

A byte codec's spec ("int8", "int4:block=128:sr", "topk:0.01", ...) is read
here into the classes of base, blockwise, microscale and sparse
(`parse_byte`, `byte_codec`). A structured codec's ("powersgd:rank=4",
"ae:dim=32") is read here too, by `structured_codec`, into the class that
jcomp.codecs.structured defines and hands in: those classes read their own
byte codec specs (PowerSGD's factor and fallback codecs) through
`parse_byte`, so they stand above this module, not below it. Every error
names the spec and lists its valid forms."""
from __future__ import annotations

import jax.numpy as jnp

from jcomp.codecs.base import Cast, Identity
from jcomp.codecs.blockwise import DEFAULT_BLOCK, Fp8, IntQuant
from jcomp.codecs.microscale import Mx, NvFp4
from jcomp.codecs.sparse import RandK, TopK

VALID_FORMS = (
    "none",
    "bf16",
    "fp16",
    "fp8[:block=N]",
    "int8[:block=N][:sr][:rot]",
    "int4[:block=N][:sr][:rot]",
    "int2[:block=N][:sr][:rot]  (rot: block a power of two)",
    "mxfp8[:block=N][:sr][:rot]  (N = 32 unless given)",
    "mxfp4[:block=N][:sr][:rot]  (N = 32 unless given)",
    "nvfp4[:block=N][:sr][:rot]  (N = 16 unless given)",
    "topk:F  (0 < F <= 1)",
    "randk:F (0 < F <= 1)",
    "powersgd:rank=R[:factor=C][:fallback=C]  (data-parallel gradients only)",
)
POWERSGD_FORM = ("powersgd:rank=R[:factor=CODEC][:fallback=CODEC][:min_compression=F] "
                 "(R an int >= 1, F a number >= 1, CODEC a codec spec without ':' such as "
                 "none, bf16, int8)")
AE_FORM = ("ae:dim=A[:init=orthogonal|normal][:rest=CODEC] (A an int >= 1; CODEC one of "
           "none, bf16, fp16, fp8, int8, int4, int2, mxfp8, mxfp4, nvfp4)")

# A structured codec's options: each spec option -> (the field it sets, how its
# text is read). The first is required; `__str__` writes them back (structured).
_POWERSGD_OPTIONS = {"rank": ("rank", int), "factor": ("factor_codec", str),
                     "fallback": ("fallback", str), "min_compression": ("min_compression", float)}
_AE_OPTIONS = {"dim": ("dim", int), "init": ("init", str), "rest": ("rest", str)}
# By the codec's NAME: its options, its valid form, what its errors call it.
_STRUCTURED = {"powersgd": (_POWERSGD_OPTIONS, POWERSGD_FORM, "PowerSGD"),
               "ae": (_AE_OPTIONS, AE_FORM, "autoencoder")}


def split(spec: str) -> tuple[str, list]:
    """ " Int4:Block=64 " -> ("int4", ["block=64"])."""
    name, *opts = [part.strip() for part in spec.strip().lower().split(":")]
    return name, opts


# ------------------------------------------------------------- byte codecs


def parse_byte(spec):
    """A byte codec object passes through; a string is read by `byte_codec`."""
    if not isinstance(spec, str):
        if hasattr(spec, "encode") and hasattr(spec, "wire_bytes"):
            return spec
        raise TypeError(f"codec spec must be a string or a codec; got {type(spec).__name__}")
    return byte_codec(spec, *split(spec))


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


def block_options(spec, opts, *, allow_sr: bool, default: int = DEFAULT_BLOCK):
    """Reads `block=N` (else `default`) and (if allowed) the flags `sr` and `rot`,
    each at most once."""
    flags, block = ("sr", "rot") if allow_sr else (), default
    keys = [opt.partition("=")[0] for opt in opts]
    for opt, key in zip(opts, keys):
        if keys.count(key) > 1:
            raise _bad(spec, f"option {key!r} given twice")
        if opt in flags:
            continue
        if key != "block" or "=" not in opt:
            raise _bad(spec, f"unknown option {opt!r}")
        try:
            block = int(opt.partition("=")[2])
        except ValueError:
            raise _bad(spec, f"block must be a positive int, got {opt!r}") from None
        if block <= 0:
            raise _bad(spec, f"block must be a positive int, got {opt!r}")
    return block, "sr" in opts, "rot" in opts


def _fraction_option(spec, name: str, opts) -> float:
    """Reads the single fraction option F of topk/randk, 0 < F <= 1."""
    if len(opts) != 1:
        raise _bad(spec, f"{name!r} takes exactly one option, the fraction F")
    try:
        fraction = float(opts[0])
    except ValueError:
        raise _bad(spec, f"fraction must be a number, got {opts[0]!r}") from None
    if not 0.0 < fraction <= 1.0:
        raise _bad(spec, f"fraction must satisfy 0 < F <= 1, got {opts[0]!r}")
    return fraction


def _bad(spec, why: str) -> ValueError:
    return ValueError(
        f"invalid codec spec {spec!r}: {why}. Valid forms: " + ", ".join(VALID_FORMS)
    )


# ------------------------------------------------------- structured codecs


def structured_codec(spec, cls):
    """`cls` (structured.PowerSGD or .Autoencoder) from its spec
    "NAME:key=value:..." (case-insensitive; an object of `cls` passes through).
    The first option is required. ValueError names the spec and its valid form;
    TypeError for a spec that is not a string."""
    options, form, what = _STRUCTURED[cls.name]
    if isinstance(spec, cls):
        return spec
    if not isinstance(spec, str):
        raise TypeError(f"{what} spec must be a string; got {type(spec).__name__}")

    def bad(why):
        return ValueError(f"invalid {what} spec {spec!r}: {why}. Valid form: {form}")

    head, opts = split(spec)
    if head != cls.name:
        raise bad(f"it must start with {cls.name!r}, not {head!r}")
    texts = key_value_options(opts, options, bad)
    first = next(iter(options))
    if first not in texts:
        raise bad(f"{first} is missing")
    fields = {}
    for key, text in texts.items():
        field, read = options[key]
        try:
            fields[field] = read(text)
        except ValueError:
            raise bad(f"{key} must be {'an int' if read is int else 'a number'}, "
                      f"got {text!r}") from None
    try:
        return cls(**fields)
    except (TypeError, ValueError) as e:
        raise bad(str(e)) from None


def key_value_options(opts, keys, bad) -> dict[str, str]:
    """Reads options `key=value`, each of `keys` at most once -> {key: value text}.
    `bad(why)` makes the ValueError (it names the spec and its valid form)."""
    fields = {}
    for opt in opts:
        key, eq, value = opt.partition("=")
        if key not in keys or not eq:
            raise bad(f"unknown option {opt!r}")
        if key in fields:
            raise bad(f"option {key!r} given twice")
        fields[key] = value
    return fields
