"""Compressed drop-in replacements for the `jax.lax` collectives.

    from jcomp import collectives as cc
    y = cc.psum(x, "data", codec="int8")           # inside jax.shard_map

Each op takes its `jax.lax` twin's arguments plus `codec=`, `bwd_codec=` (the
backward's; default `codec`), `key=`, `rows=` and `bucket_bytes=`. With both
codecs "none" the call *is* the lax call, on any pytree. What travels is the
codec's payload (`kernels`), or the raw operand, with a warning, where the codec
cannot send fewer bytes. Gradients come from one `custom_vjp` factory
(`ops._coded`): the transpose of the lax op, sent with `bwd_codec`. Results are
named `REMAT_NAMES[op]` for remat policies. `value_and_grad` (`jitgrad`) brings
the gradient reduction of a `jax.jit` program without shard_map here;
`outer_init` / `outer_sync` (`outer`) DiLoCo's outer step, for islands that
sync every H steps across a slow link.

`rows` says what a lossy codec may mix. "independent" (the default): every
vector along a leaf's last axis (one token's features) is coded on its own, so
no block, scale, rotation or top-k selection spans two of them, and an output
row depends only on the input rows lax's op would combine into it. "flat": a
leaf is one flat vector, for gradient and parameter buffers only; leaves share
flat buckets, but every leaf starts on a block boundary and fills whole
blocks, so no leaf's scale is set by another (`arguments.flat_group`). The
README ("Using the collectives") tables what each op sends, forward and back;
docs/collectives.md is the full reference.
"""
from jcomp.collectives.ops import (  # noqa: F401
    DEFAULT_BUCKET_BYTES, RAW_SCOPE, REMAT_NAMES, ROWS, RawSendWarning, all_gather, all_to_all,
    copy_to_parallel, pmean, ppermute, psum, psum_ef, psum_scatter, psum_scatter_ef,
    parse, reduce_from_parallel, vary)
from jcomp.collectives.jit.grad import gather_params, scatter_specs, value_and_grad  # noqa: F401
from jcomp.collectives.jit.bytecheck import ExtraBytesWarning  # noqa: F401
from jcomp.collectives.jit.rank import rank_key  # noqa: F401
from jcomp.collectives.hops import (  # noqa: F401,F811  (a codec per mesh axis)
    all_gather, pmean, psum, psum_ef, psum_scatter)
from jcomp.collectives.outer.sync import OuterState, outer_init, outer_sync  # noqa: F401
from jcomp.collectives.outer.sparseloco import SparseLoCo  # noqa: F401

__all__ = [
    "psum", "pmean", "psum_scatter", "all_gather", "ppermute", "all_to_all",
    "copy_to_parallel", "reduce_from_parallel", "psum_ef", "psum_scatter_ef", "vary",
    "value_and_grad", "scatter_specs", "gather_params", "rank_key",
    "outer_init", "outer_sync", "OuterState", "SparseLoCo",
    "REMAT_NAMES", "DEFAULT_BUCKET_BYTES", "RAW_SCOPE", "RawSendWarning", "ROWS",
    "ExtraBytesWarning",
]
