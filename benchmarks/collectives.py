"""Benchmark of jcomp's compressed collectives against the jax.lax ops they replace.

    python benchmarks/collectives.py [--sizes 64Ki 1Mi] [--ops psum ...] [--codecs int8 ...]
                                     [--repeats 5] [--json PATH] [--quick]

For every op x codec x size (per-device float32 elements) it reports the bytes
one device sends per call, read from the compiled program by `jcomp.wire`, and
their ratio to the uncompressed jax.lax op; the relative L2 error of the output
against that op; and the median wall time with its ratio to the jax.lax op.
Timed calls of all codecs of one op and size are interleaved round-robin, so
load on a shared machine slows them alike, and every call waits for its result
(queued calls deadlock emulated CPU devices).

Devices: without a device count in XLA_FLAGS, the host platform is split into
8 emulated CPU devices and the mesh is (data, tensor, pipeline) = (2, 2, 2).
On a GPU or TPU machine the real devices are used and the mesh is built from
however many there are (`mesh_sizes`); an axis of size 1 moves nothing, so
ops over it show 0 bytes and no byte ratio. On emulated devices no byte
crosses a wire: times measure the coding work, not bandwidth saved.
"""
import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8").strip()

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from jcomp import codecs  # noqa: E402
from jcomp import collectives as cc  # noqa: E402
from jcomp import mesh as jmesh  # noqa: E402
from jcomp import wire  # noqa: E402

OPS = {"psum": "data", "psum_scatter": "data", "all_gather": "tensor",
       "ppermute": "pipeline", "all_to_all": "data"}
CODECS = ["none", "bf16", "fp16", "fp8", "int8", "int4", "int2",
          "topk:0.01", "topk:0.1", "randk:0.1"]
SIZES = [64 * 1024, 1024 * 1024]
QUICK = dict(sizes=[2048], codecs=["none", "int8", "topk:0.1"], repeats=1)
BUDGET_ELEMENTS = 1024 * 1024  # 4 MiB of float32 per device
BUDGET = 2.0
EVERY = P(jmesh.AXES)  # one row of the global array per device


def mesh_sizes(n_devices: int) -> tuple[int, int, int]:
    """(data, tensor, pipeline) for n devices, as even as the prime factors allow
    (each, largest first, goes to the smallest axis), in decreasing order: 'data'
    gets the largest. 8 -> (2, 2, 2), 4 -> (2, 2, 1), 24 -> (4, 3, 2)."""
    sizes, n, p, primes = [1, 1, 1], n_devices, 2, []
    while n > 1:
        while n % p == 0:
            primes.append(p)
            n //= p
        p += 1
    for p in sorted(primes, reverse=True):
        sizes[sizes.index(min(sizes))] *= p
    return tuple(sorted(sizes, reverse=True))


def op_body(op: str, codec: str, n_axis: int):
    """-> (body for shard_map taking this device's x_1xS, its out_specs)."""
    axis = OPS[op]
    needs_key = codecs.parse(codec).needs_key

    def body(x_1xS):
        x_S = x_1xS[0]
        # Made while tracing: shard_map may reject a concrete key closed over from outside.
        kw = dict(codec=codec, key=jax.random.key(0) if needs_key else None)
        if op == "psum":
            y = cc.psum(x_S, axis, **kw)
        elif op == "psum_scatter":
            y = cc.psum_scatter(x_S, axis, tiled=True, **kw)
        elif op == "all_gather":
            y = cc.all_gather(x_S, axis, tiled=True, **kw)
        elif op == "ppermute":
            ring = [(i, (i + 1) % n_axis) for i in range(n_axis)]
            y = cc.ppermute(x_S, axis, ring, **kw)
        else:
            y = cc.all_to_all(x_S, axis, 0, 0, tiled=True, **kw)
        return y[None]

    rest = tuple(a for a in jmesh.AXES if a != axis)
    return body, (P(rest) if op == "psum" else EVERY)


def rel_err(y, ref) -> float:
    """||y - ref|| / ||ref|| in float64 (NaN/Inf in y stay visible)."""
    y, ref = np.asarray(y, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(y - ref) / np.linalg.norm(ref))


def time_interleaved(fns: dict, x, repeats: int) -> dict:
    """{name: [seconds per call]}: one warm-up call each, then `repeats` rounds that
    call every fn once in turn, each call waited for."""
    for fn in fns.values():
        jax.block_until_ready(fn(x))
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            jax.block_until_ready(fn(x))
            times[name].append(time.perf_counter() - t0)
    return times


def bench_op(op: str, size: int, codec_list, mesh, repeats: int, rng) -> list[dict]:
    """Rows for one op and per-device size, `none` (the jax.lax op) first."""
    n_axis = mesh.shape[OPS[op]]
    x = jax.device_put(np.asarray(rng.normal(size=(mesh.size, size)), np.float32),
                       NamedSharding(mesh, EVERY))
    fns, reports = {}, {}
    for codec in codec_list:
        body, out_spec = op_body(op, codec, n_axis)
        fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=EVERY, out_specs=out_spec))
        # The jit call reuses the executable `measure` compiled: what is timed is
        # the program that was metered.
        fns[codec], reports[codec] = fn, wire.measure(fn, x, mesh=mesh)
    ref = np.asarray(fns["none"](x))
    outs = {c: rel_err(fns[c](x), ref) for c in codec_list}
    times = time_interleaved(fns, x, repeats)
    base_bytes, base_time = reports["none"].total(), statistics.median(times["none"])
    rows = []
    for codec in codec_list:
        total, med = reports[codec].total(), statistics.median(times[codec])
        ratio = total / base_bytes if base_bytes else None
        rows.append(dict(
            op=op, axis=OPS[op], axis_size=n_axis, codec=codec, elements=size,
            bytes_per_device=total, bytes_by_axis=reports[codec].by_axis(),
            bytes_by_dtype=reports[codec].by_dtype(), byte_ratio=ratio,
            rel_err=outs[codec], time_s=med, times_s=times[codec],
            time_ratio=med / base_time,
            notes=list(reports[codec].notes) + no_saving_note(codec, ratio, reports[codec])))
    return rows


def no_saving_note(codec: str, ratio, report) -> list[str]:
    """A note when a compressed program sends no fewer bytes than the jax.lax op.
    The meter's own note covers widened all-reduces only; XLA on CPU also widens
    bf16 all-to-all, all-gather and collective-permute to f32."""
    if codec == "none" or ratio is None or ratio < 1:
        return []
    dtypes = ", ".join(sorted(report.by_dtype()))
    return [f"sends {ratio:.3f}x the bytes of the jax.lax op; on the wire: {dtypes}"]


def _size_str(n: int) -> str:
    for unit, m in (("Mi", 1 << 20), ("Ki", 1 << 10)):
        if n % m == 0:
            return f"{n // m}{unit}"
    return str(n)


def table(rows) -> str:
    """Fixed-width table of the rows."""
    head = ("op", "axis", "codec", "elems/dev", "bytes/dev", "bytes x", "rel err",
            "ms", "time x")
    lines = [head] + [(
        r["op"], r["axis"], r["codec"], _size_str(r["elements"]), f"{int(r['bytes_per_device']):,}",
        "-" if r["byte_ratio"] is None else f"{r['byte_ratio']:.3f}", f"{r['rel_err']:.2e}",
        f"{r['time_s'] * 1e3:.2f}", f"{r['time_ratio']:.2f}") for r in rows]
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    return "\n".join("  ".join(v.rjust(w) if i > 2 else v.ljust(w)
                               for i, (v, w) in enumerate(zip(line, widths))).rstrip()
                     for line in lines)


def budget(rows) -> dict | None:
    """Worst compressed/jax.lax time ratio at 4 MiB per device, overall and per
    codec, or None if that size was not measured. Ops over a size-1 axis run the
    jax.lax op itself and do not count."""
    at = [r for r in rows if r["elements"] == BUDGET_ELEMENTS and r["codec"] != "none"
          and r["axis_size"] > 1]
    if not at:
        return None
    worst = {}
    for r in at:
        if r["codec"] not in worst or r["time_ratio"] > worst[r["codec"]]["time_ratio"]:
            worst[r["codec"]] = dict(time_ratio=r["time_ratio"], op=r["op"])
    codec = max(worst, key=lambda c: worst[c]["time_ratio"])
    ratio = worst[codec]["time_ratio"]
    return dict(elements=BUDGET_ELEMENTS, max_time_ratio=ratio, op=worst[codec]["op"],
                codec=codec, limit=BUDGET, passed=ratio <= BUDGET, by_codec=worst)


def parse_size(text: str) -> int:
    """'4096', '64Ki', '1Mi' -> elements per device (a positive int)."""
    mult = {"ki": 1 << 10, "mi": 1 << 20}.get(text[-2:].lower(), 1)
    digits = text[:-2] if mult > 1 else text
    if not digits.isdigit() or int(digits) <= 0:
        raise argparse.ArgumentTypeError(
            f"--sizes: {text!r} is not a positive element count (e.g. 4096, 64Ki, 1Mi)")
    return int(digits) * mult


def parse_codec(text: str) -> str:
    """A codec spec jcomp.codecs accepts, normalised to its canonical form."""
    try:
        return str(codecs.parse(text))
    except (ValueError, TypeError) as e:
        raise argparse.ArgumentTypeError(f"--codecs: {e}") from None


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", nargs="+", type=parse_size, help="per-device float32 elements")
    ap.add_argument("--ops", nargs="+", choices=list(OPS), default=list(OPS))
    ap.add_argument("--codecs", nargs="+", type=parse_codec,
                    help="codec specs; 'none' (the jax.lax op) is always run as the baseline")
    ap.add_argument("--repeats", type=int, help="timed calls per program (default 5)")
    ap.add_argument("--json", default="benchmarks/results/collectives.json")
    ap.add_argument("--quick", action="store_true",
                    help=f"smoke run: {QUICK} unless given explicitly")
    args = ap.parse_args(argv)
    preset = QUICK if args.quick else dict(sizes=SIZES, codecs=CODECS, repeats=5)
    for name, value in preset.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.codecs = ["none"] + [c for c in dict.fromkeys(args.codecs) if c != "none"]
    if args.repeats < 1:
        ap.error(f"--repeats must be >= 1; got {args.repeats}")
    return args, ap


def main(argv=None):
    args, ap = parse_args(argv)
    mesh = jmesh.make_mesh(mesh_sizes(jax.device_count()))
    data = mesh.shape["data"]
    bad = [s for s in args.sizes if s % data]
    if bad:  # psum_scatter and all_to_all split the buffer over 'data'
        ap.error(f"--sizes must be multiples of the data axis size {data}; got {bad}")
    print(f"jax {jax.__version__}, backend {jax.default_backend()}, {jax.device_count()} devices, "
          f"mesh {dict(mesh.shape)}, repeats {args.repeats}", flush=True)
    rng, rows = np.random.default_rng(0), []
    with jax.set_mesh(mesh):
        for size in args.sizes:
            for op in args.ops:
                rows += bench_op(op, size, args.codecs, mesh, args.repeats, rng)
                print(f"  done {op} at {_size_str(size)} elements per device", flush=True)
    print(table(rows))
    notes = list(dict.fromkeys(f"{r['op']}/{r['codec']}: {n}" for r in rows for n in r["notes"]))
    for n in notes:
        print(f"NOTE {n}")
    b = budget(rows)
    if b is None:
        print("budget: not measured (needs size 1Mi = 4 MiB per device)")
    else:
        print(f"budget at 4 MiB/device: max compressed/jax.lax time = {b['max_time_ratio']:.2f}x "
              f"({b['op']}, {b['codec']}) vs {BUDGET:.0f}x: {'PASS' if b['passed'] else 'FAIL'}")
        print("  worst per codec: " + ", ".join(
            f"{c} {w['time_ratio']:.2f}x ({w['op']})" for c, w in b["by_codec"].items()))
    out = dict(jax_version=jax.__version__, backend=jax.default_backend(),
               device_kind=jax.devices()[0].device_kind, device_count=jax.device_count(),
               mesh=dict(mesh.shape), repeats=args.repeats,
               date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               rows=rows, notes=notes, budget=b)
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
