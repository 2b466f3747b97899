"""The codec spec grammar: NAME[:OPTION]..., with no dependency on the codecs.

Every family's parser reads its options through these helpers, so that errors
name the spec and list every valid form the same way."""
from __future__ import annotations

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


def _join(*parts: str) -> str:
    return ":".join(p for p in parts if p)


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
