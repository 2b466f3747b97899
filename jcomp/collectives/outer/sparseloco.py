"""SparseLoCo's pseudo-gradient exchange (Sarfi et al. 2025) for `cc.outer_sync`.

Each island keeps a residual e that decays: acc = beta * e + delta. It sends,
of every chunk of `chunk` consecutive entries of acc, the k entries largest in
magnitude. The islands all-gather these payloads and each sums the decoded
ones: the mean. The new residual is acc less what was sent, decoded (dropped
entries and the rounding of the kept ones). The decayed residual stands in for
DiLoCo's outer momentum: the outer step is plain averaging (SGD without
momentum).

Two coders of a chunk's k entries (`coder=`):

- "packed" (the default): values on 2 bits, 4 levels (+-lo, +-hi: a sign and
  a magnitude bit, the chunk's two float32 magnitudes from one Lloyd step from
  the mean), positions as an Elias-Fano code or a bitmap, whichever is smaller
  (`jcomp.codecs.sparsepack`). At k = 256 of 4096: 64 + 8 + 192 = 264 B, 0.0161
  of the chunk's float32 bytes.
- "index": the earlier coder, kept so that runs made with it can be repeated:
  values as `int2` with one float32 scale (the chunk's largest kept magnitude;
  its largest code is 1, so three levels -s, 0, +s), positions as uint16
  (int32 past 65536). At k = 256 of 4096: 580 B, 0.0354.

    codec = cc.SparseLoCo(k=64, chunk=4096, beta=0.95)
    params_IxX, state = cc.outer_init(params, optax.sgd(1.0), ..., error_feedback=True)
    params_IxX, state = cc.outer_sync(params_IxX, state, tx=optax.sgd(1.0), codec=codec, ...)

A piece whose payload would not send fewer bytes than its raw all-reduce
(short chunks, many islands: `sends_less`) is averaged raw instead, and its
residual then is zero: everything was sent.
"""
from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
from jax import lax

from jcomp import codecs
from jcomp.codecs import sparsepack
from jcomp.codecs.sparse import top_k_indices

__all__ = ["SparseLoCo"]

_SHORT_INDEX = 2 ** 16  # "index": chunks up to this length send uint16 positions
CODERS = ("packed", "index")


@dataclasses.dataclass(frozen=True)
class SparseLoCo:
    """k: entries kept per chunk; chunk: the chunk length; beta: the residual's
    decay, in [0, 1]; coder: how a chunk's kept entries travel ("packed" or
    "index", the module's docstring)."""

    k: int = 64
    chunk: int = 4096
    beta: float = 0.95
    coder: str = "packed"

    def __post_init__(self):
        for name in ("k", "chunk"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"SparseLoCo {name}={v!r}; allowed: an integer >= 1")
        if self.k > self.chunk:
            raise ValueError(f"SparseLoCo k={self.k} exceeds chunk={self.chunk}; allowed: "
                             "1 <= k <= chunk")
        b = self.beta
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not 0.0 <= b <= 1.0:
            raise ValueError(f"SparseLoCo beta={b!r}; allowed: a number in [0, 1]")
        if self.coder not in CODERS:
            raise ValueError(f"SparseLoCo coder={self.coder!r}; allowed: {', '.join(CODERS)}")

    def __str__(self):
        coder = "" if self.coder == "packed" else f":coder={self.coder}"
        return f"sparseloco:k={self.k}:chunk={self.chunk}:beta={self.beta!r}{coder}"

    def layout(self, n: int) -> tuple[int, int, int]:
        """(chunks, chunk length, kept per chunk) for a piece of n entries: a
        piece shorter than `chunk` is one chunk."""
        c = min(self.chunk, n)
        return -(-n // c), c, min(self.k, c)

    def payload_bytes(self, n: int) -> int:
        """Bytes of one island's payload for a piece of n entries."""
        r, c, k = self.layout(n)
        if self.coder == "packed":
            return r * (sparsepack.value_bytes(k) + sparsepack.position_bytes(c, k))
        index = 2 if c <= _SHORT_INDEX else 4
        return r * (_int2(k).wire_bytes((1, k), jnp.float32) + k * index)

    def sends_less(self, n: int, islands: int, itemsize: int = 4) -> bool:
        """Whether the all-gather of the payloads sends fewer bytes per device
        than a raw all-reduce of the piece (2 (I-1)/I of its bytes)."""
        return self.payload_bytes(n) * (islands - 1) < 2 * (islands - 1) * n * itemsize / islands


def _int2(k):
    return codecs.parse(f"int2:block={k}")


def encode(x_C, codec: SparseLoCo):
    """A flat float32 piece -> its payload: {"q", "scale", "pos"} ("packed") or
    {"q", "scale", "index"} ("index")."""
    n = x_C.shape[0]
    r, c, k = codec.layout(n)
    x_RxC = jnp.pad(x_C, (0, r * c - n)).reshape(r, c)
    score = jnp.abs(x_RxC)
    idx_RxK = top_k_indices(jnp.where(jnp.isnan(score), jnp.inf, score), k)
    if codec.coder == "packed":
        idx_RxK = jnp.sort(idx_RxK, axis=-1)  # the position code sends them in order
        kept_RxK = jnp.take_along_axis(x_RxC, idx_RxK, axis=-1)
        return {**sparsepack.encode_values(kept_RxK),
                "pos": sparsepack.encode_positions(idx_RxK, c)}
    kept_RxK = jnp.take_along_axis(x_RxC, idx_RxK, axis=-1)
    out = dict(_int2(k).encode(kept_RxK))
    out["index"] = idx_RxK.astype(jnp.uint16 if c <= _SHORT_INDEX else jnp.int32)
    return out


def decode(payload, n: int, codec: SparseLoCo):
    """A payload -> the flat float32 piece it stands for (zeros where nothing was kept)."""
    r, c, k = codec.layout(n)
    if codec.coder == "packed":
        kept_RxK = sparsepack.decode_values(payload, k)
        idx_RxK = sparsepack.decode_positions(payload["pos"], c, k)
    else:
        kept_RxK = _int2(k).decode({"q": payload["q"], "scale": payload["scale"]}, (r, k),
                                   jnp.float32)
        idx_RxK = payload["index"].astype(jnp.int32)
    rows = jnp.arange(r)[:, None]
    out_RxC = jnp.zeros((r, c), jnp.float32).at[rows, idx_RxK].set(kept_RxK)
    return out_RxC.reshape(-1)[:n]


def average(delta, residual, axis, codec: SparseLoCo):
    """Inside shard_map: this island's pseudo-gradient piece and residual ->
    (the islands' mean, the new residual), both in delta's shape. Sends the
    payload across `axis` with one all_gather (or a raw pmean, `sends_less`)."""
    shape, dtype = delta.shape, delta.dtype
    n, islands = math.prod(shape), lax.axis_size(axis)
    acc = codec.beta * residual.astype(jnp.float32) + delta.astype(jnp.float32)
    acc_C = acc.reshape(-1)
    if not codec.sends_less(n, islands, jnp.dtype(dtype).itemsize):
        mean = lax.pmean(acc_C, axis)
        return mean.reshape(shape).astype(dtype), jnp.zeros(shape, residual.dtype)
    own = encode(acc_C, codec)
    everyone = {name: lax.all_gather(v, axis, axis=0, to="invarying") for name, v in own.items()}
    total = sum(decode({name: v[i] for name, v in everyone.items()}, n, codec)
                for i in range(islands))
    sent = decode(own, n, codec)
    return ((total / islands).reshape(shape).astype(dtype),
            (acc_C - sent).reshape(shape).astype(residual.dtype))
