"""Measures the links of a mesh and the codecs of its device: a `Profile`.

    prof = probe(mesh)                          # every axis of size > 1
    prof = probe(mesh, codecs=("int8",), sizes=(1 << 16, 1 << 20, 1 << 23))

Per mesh axis of size n > 1, a jitted shard_map `lax.psum` of `size` bytes of
float32 per device, over that axis alone, runs a few times after a warm-up
call; the median time at each size is fitted by least squares to

    t = latency_s + w / bytes_per_s,   w = 2(n-1)/n * size

(w: the bytes per device jcomp.meter.wire counts for that all-reduce), with
latency and 1/bandwidth kept >= 0. A fit in which time does not grow with the
bytes cannot give a bandwidth: ValueError, asking for larger sizes. The
defaults suit CPU meshes; on GPU links, where 4 MiB moves in microseconds,
pass sizes up to hundreds of MiB so that bytes, not latency, dominate.

The default sizes grow 4x at a time, and on a slow link they stop early: no
larger size is tried once two are in and the last one's call passed
SLOW_CALL_S, and the calls of one size stop once together past SIZE_BUDGET_S
(one at least). A call of seconds there adds time to the start, not accuracy.
On the two-process rig (tc's tbf between two network namespaces, 4 devices
per process crossing at once) a psum's throughput fell once one call moved
megabytes across a slow link, with TCP retransmitting: at 10 Mbit/s 0.95 of
tc's rate at 256 KiB per device, 0.87-0.92 at 1 MiB; at 100 Mbit/s 0.95 at
1 MiB, 0.87-0.89 at 4 and 8 MiB. With sizes of 64 KiB, 1 MiB and 4 MiB, the
one or two calls of the largest put the probe's figure anywhere from 0.83 to
0.98 of the rate. A train step's messages across such a link are far smaller
(experiments/probelink.py measures this). Per codec,
encode and decode of `codec_bytes` of float32 rows per device are timed apart
on every device of the mesh at once, as the train step runs them: where
devices share the processor (emulated CPU devices) each one codes slower than
it would alone, and a codec timed on one idle device would look cheaper than
it is in the step. Each is divided by the bytes one device codes. The per-byte
figures include the call's fixed overhead, which overstates codec time at
small sizes: that errs towards sending raw.

Every call waits for its result: it is what is timed, and emulated CPU
devices can stop on collectives queued without waiting. With
several processes, every process runs the same programs, and all take process
0's figures, so that each one plans the same codecs and compiles the same step.
The stop rules decide on the slowest process's time (`_slowest`, a reduction
over processes): each process reading its own clock around a joint psum could
stop after another number of calls than the others, whose next psum would then
wait for it forever. A size's time is the slowest process's median, so the
fit, and its refusal, come out the same on every process too.
"""
from __future__ import annotations

import functools
import math
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from jcomp.collectives import arguments
from jcomp.tune.profile import BYTES_PER_S, CodecCost, Link, Profile, codec_name

DEFAULT_CODECS = ("bf16", "int8", "int4", "int4:rot")  # every default ladder's codecs
DEFAULT_SIZES = (1 << 16, 1 << 18, 1 << 20, 1 << 22)  # bytes per device
DEFAULT_CODEC_BYTES = 1 << 22
CODEC_ROW = 4096  # elements per coded row: a multiple of every default block
SLOW_CALL_S = 0.25  # a call past this (of the second size or later) ends the sizes
SIZE_BUDGET_S = 1.0  # the timed calls of one size stop once together past this
_clock = time.perf_counter  # what calls are timed with (replaceable per process)


def _check_sizes(sizes, name: str):
    if isinstance(sizes, (str, bytes)) or not hasattr(sizes, "__iter__"):
        raise TypeError(f"{name} must be a sequence of byte counts; got {sizes!r}")
    sizes = tuple(sizes)
    for s in sizes:
        if isinstance(s, bool) or not isinstance(s, int) or s < 4 or s % 4:
            raise ValueError(f"{name}: each size must be an int multiple of 4 bytes (float32), "
                             f">= 4; got {s!r}")
    if len(set(sizes)) < 2:
        raise ValueError(f"{name}: a latency and a bandwidth need at least two distinct sizes; "
                         f"got {sizes!r}")
    return tuple(sorted(set(sizes)))


def _slowest(seconds: float) -> float:
    """The largest of every process's `seconds` (one process: its own). Every
    process must call it at the same point."""
    if jax.process_count() == 1:
        return seconds
    from jax.experimental import multihost_utils
    return float(np.max(np.asarray(multihost_utils.process_allgather(np.float32(seconds)))))


def _times_s(fn, arg, repeats: int, max_s: float = float("inf")) -> list[float]:
    """Seconds of each of `repeats` calls after an untimed first one (the compile);
    fewer, at least one, once the timed calls together pass max_s on the slowest
    process."""
    jax.block_until_ready(fn(arg))
    times = []
    for _ in range(repeats):
        t0 = _clock()
        jax.block_until_ready(fn(arg))
        times.append(_clock() - t0)
        if math.isfinite(max_s) and _slowest(sum(times)) > max_s:
            break
    return times


def _median_s(fn, arg, repeats: int, max_s: float = float("inf")) -> float:
    return statistics.median(_times_s(fn, arg, repeats, max_s))


def _ones(mesh, size: int):
    """`size` bytes of float32 ones on every device of `mesh`, made on the devices
    so that every process holds only its own shards."""
    sharding = NamedSharding(mesh, P(tuple(mesh.axis_names)))
    return jax.jit(lambda: jnp.ones((mesh.devices.size * size // 4,), jnp.float32),
                   out_shardings=sharding)()


def fit_link(wire_bytes, seconds) -> tuple[float, float]:
    """Least squares t = a + w * b with a >= 0 and b >= 0 -> (a, b): latency in
    seconds and seconds per byte. The constrained optimum of two parameters lies
    inside, or on the edge a = 0, or on the edge b = 0."""
    w = np.asarray(wire_bytes, np.float64)
    t = np.asarray(seconds, np.float64)
    if not (np.all(np.isfinite(w)) and np.all(np.isfinite(t))):
        raise ValueError(f"fit_link: non-finite input: wire_bytes={w.tolist()}, seconds={t.tolist()}")
    slope, intercept = np.polyfit(w, t, 1)
    if slope >= 0 and intercept >= 0:
        return float(intercept), float(slope)
    through_origin = float(w @ t / (w @ w))
    candidates = [(0.0, max(through_origin, 0.0)), (float(t.mean()), 0.0)]
    return min(candidates, key=lambda ab: float(np.sum((ab[0] + ab[1] * w - t) ** 2)))


def _psum_program(mesh, axis: str):
    all_axes = tuple(mesh.axis_names)

    @jax.jit
    @functools.partial(jax.shard_map, mesh=mesh, in_specs=P(all_axes), out_specs=P(all_axes))
    def reduce(x):
        return lax.psum(x, axis)
    return reduce


def _probe_axis(mesh, axis: str, sizes, repeats: int) -> Link:
    n = int(mesh.shape[axis])
    program = _psum_program(mesh, axis)
    wire, seconds = [], []
    for size in sizes:
        seconds.append(_slowest(_median_s(program, _ones(mesh, size), repeats,
                                          max_s=SIZE_BUDGET_S)))
        wire.append(2 * (n - 1) / n * size)
        if len(seconds) >= 2 and seconds[-1] > SLOW_CALL_S:
            break  # a slow link: its bandwidth is clear, larger sizes only cost time
    sizes = sizes[:len(seconds)]
    latency, s_per_byte = fit_link(wire, seconds)
    # A slope too flat for any real link is the same failure as none at all.
    if s_per_byte * BYTES_PER_S[1] < 1:
        raise ValueError(
            f"probe: over mesh axis {axis!r} the psum took no longer at {max(sizes)} bytes than "
            f"at {min(sizes)} ({[f'{s:.3g}' for s in seconds]} s): no bandwidth to fit; pass "
            "larger sizes=")
    return Link(latency_s=latency, bytes_per_s=1.0 / s_per_byte,
                comment=f"probe: psum over {axis!r} (n={n}), sizes {list(sizes)} B/device, "
                        f"median of {repeats}")


def _codec_programs(mesh, codec, shape):
    """(encode, decode) of each device's own (rows, CODEC_ROW) block, every device
    at once: shard_maps with no collective in them. Apart, so that XLA cannot
    fuse a decode into its encode (bf16's round trip is two converts)."""
    all_axes = tuple(mesh.axis_names)
    key = jax.random.key(0) if codec.needs_key else None
    local = functools.partial(jax.shard_map, mesh=mesh, in_specs=P(all_axes), out_specs=P(all_axes))

    @jax.jit
    @local
    def encode(x):
        # The payload's leaves on a leading axis of one per device.
        return jax.tree.map(lambda a: a[None], codec.encode(x, key=key))

    @jax.jit
    @local
    def decode(payload):
        return codec.decode(jax.tree.map(lambda a: a[0], payload), shape, jnp.float32)
    return encode, decode


def _probe_codec(mesh, spec: str, nbytes: int, repeats: int) -> CodecCost:
    codec = arguments.parse(spec)
    rows = max(nbytes // (4 * CODEC_ROW), 1)
    shape = (rows, CODEC_ROW)
    devices = mesh.devices.size
    sharding = NamedSharding(mesh, P(tuple(mesh.axis_names)))
    x = jax.jit(lambda: jax.random.normal(jax.random.key(1), (devices * rows, CODEC_ROW),
                                          jnp.float32), out_shardings=sharding)()
    encode, decode = _codec_programs(mesh, codec, shape)
    payload = jax.block_until_ready(encode(x))
    raw = rows * CODEC_ROW * 4
    t_enc = _median_s(encode, x, repeats)
    t_dec = _median_s(decode, payload, repeats)
    kind = jax.local_devices()[0].device_kind
    return CodecCost(encode_s_per_byte=t_enc / raw, decode_s_per_byte=t_dec / raw,
                     comment=f"probe: {shape} float32 per device on all {devices} x {kind} at "
                             f"once, median of {repeats}")


def agree(values: list[float]) -> list[float]:
    """Process 0's figures on every process (one process: unchanged)."""
    if jax.process_count() == 1:
        return values
    from jax.experimental import multihost_utils
    return [float(v) for v in np.asarray(
        multihost_utils.broadcast_one_to_all(np.asarray(values, np.float64)))]


def probe(mesh, codecs=DEFAULT_CODECS, sizes=DEFAULT_SIZES, *, codec_bytes=DEFAULT_CODEC_BYTES,
          repeats: int = 5) -> Profile:
    """Links of every axis of `mesh` of size > 1, and the cost of each of `codecs`
    ("none" needs none) on every device of `mesh` at once. sizes: bytes of float32
    per device the psums move (at least two distinct). See the module doc."""
    if not isinstance(mesh, jax.sharding.Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh; got {type(mesh).__name__}")
    sizes = _check_sizes(sizes, "sizes")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be an int >= 1; got {repeats!r}")
    if isinstance(codec_bytes, bool) or not isinstance(codec_bytes, int) or codec_bytes < 4:
        raise ValueError(f"codec_bytes must be an int >= 4; got {codec_bytes!r}")
    if isinstance(codecs, str):
        raise TypeError(f"codecs must be a sequence of codec specs; got the string {codecs!r}")
    names = []
    for i, spec in enumerate(codecs):
        name = codec_name(spec, f"codecs[{i}]")
        if name != "none" and name not in names:
            names.append(name)
    axes = [a for a in mesh.axis_names if mesh.shape[a] > 1]
    links = [_probe_axis(mesh, a, sizes, repeats) for a in axes]
    device = jax.local_devices()[0]
    costs = [_probe_codec(mesh, c, codec_bytes, repeats) for c in names]
    flat = agree([v for link in links for v in (link.latency_s, link.bytes_per_s)]
                  + [v for c in costs for v in (c.encode_s_per_byte, c.decode_s_per_byte)])
    links = {a: Link(flat[2 * i], flat[2 * i + 1], link.comment)
             for i, (a, link) in enumerate(zip(axes, links))}
    off = 2 * len(axes)
    costs = {n: CodecCost(flat[off + 2 * i], flat[off + 2 * i + 1], c.comment)
             for i, (n, c) in enumerate(zip(names, costs))}
    shape = ", ".join(f"{a}={mesh.shape[a]}" for a in mesh.axis_names)
    return Profile(links=links, codecs=costs,
                   device=f"{jax.device_count()} x {device.device_kind} ({device.platform}); "
                          f"mesh {shape}; {jax.process_count()} process(es)")
