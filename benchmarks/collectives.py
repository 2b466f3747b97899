"""Benchmark of jcomp's compressed collectives against the jax.lax ops they replace.

    python -m benchmarks.collectives [--sizes 64Ki 1Mi] [--ops psum ...] [--codecs int8 ...]
                                     [--repeats 5] [--json PATH] [--quick]
    python -m benchmarks.collectives --sizes    # bytes only, sizes 1..1Mi, axes 2..8

For every op x codec x size (per-device float32 elements) it reports the bytes
one device sends per call, read from the compiled program by `jcomp.meter.wire`, and
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

Two structured codecs get their own rows per size (`bench_structured`):
PowerSGD over data beside lax.pmean, and a linear autoencoder's coded
all-reduce over tensor beside lax.psum.
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

from jcomp.gpt import autoencoder  # noqa: E402
from jcomp import codecs  # noqa: E402
from jcomp import collectives as cc  # noqa: E402
from jcomp.collectives import powersgd  # noqa: E402
from jcomp.gpt import mesh as jmesh  # noqa: E402
from jcomp.meter import wire  # noqa: E402

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


def _matrix(size: int) -> tuple[int, int]:
    """(m, n) with m * n = size and m <= n, as square as powers of two allow."""
    m = 1 << ((size.bit_length() - 1) // 2)
    while size % m:
        m //= 2
    return m, size // m


def structured_bodies(size: int, rank: int, ae_dim: int):
    """{name: (body, out_spec, axis)} for the codecs that are structures rather
    than byte codecs, each beside the jax.lax op it replaces (see bench_structured)."""
    m, n = _matrix(size)
    psgd = f"powersgd:rank={rank}"
    q_NxR = powersgd.init_q(jax.random.key(powersgd.Q_SEED), (n,), rank)

    def psgd_body(x_1xS):
        return powersgd.reduce(x_1xS[0].reshape(m, n), q_NxR, None, "data", codec=psgd)[0][None]

    def mean_body(x_1xS):
        return lax.pmean(x_1xS[0].reshape(m, n), "data")[None]

    # A tensor-parallel activation [tokens, d_model=n] coded to ae_dim numbers per
    # token by an (untrained) orthonormal encoder and decoded by its transpose.
    enc_NxA = autoencoder.init_pair(jax.random.key(0), n, ae_dim, "orthogonal")[0]

    def ae_body(x_1xS):
        z_MxA = x_1xS[0].reshape(m, n) @ enc_NxA
        return (cc.psum(z_MxA, "tensor", codec="none") @ enc_NxA.T)[None]

    def sum_body(x_1xS):
        return lax.psum(x_1xS[0].reshape(m, n), "tensor")[None]

    not_data = P(tuple(a for a in jmesh.AXES if a != "data"))
    not_tensor = P(tuple(a for a in jmesh.AXES if a != "tensor"))
    return {psgd: (psgd_body, not_data, "data"), "lax.pmean": (mean_body, not_data, "data"),
            f"ae:dim={ae_dim}": (ae_body, not_tensor, "tensor"),
            "lax.psum": (sum_body, not_tensor, "tensor")}


def bench_structured(size: int, mesh, repeats: int, rng, rank: int = 4) -> list[dict]:
    """PowerSGD over data against lax.pmean, and a linear autoencoder's coded
    all-reduce over tensor (code width n/4) against lax.psum, on [m, n] matrices.

    Inputs are one rank-`rank` matrix shared by every device (the part of a
    gradient data ranks agree on) plus 10% Gaussian noise of each device's own:
    PowerSGD's error then shows the noise it drops and its single power step. The autoencoder here is an
    untrained orthonormal projection, so its error is a random projection's; a
    trained one's effect on the loss is what the convergence benchmark measures.
    """
    m, n = _matrix(size)
    a_MxN = rng.normal(size=(m, rank)) @ rng.normal(size=(rank, n)) / rank
    noise = 0.1 * rng.normal(size=(mesh.size, m, n))
    x_np = (a_MxN + noise).reshape(mesh.size, size).astype(np.float32)
    x = jax.device_put(x_np, NamedSharding(mesh, EVERY))
    bodies = structured_bodies(size, rank, max(n // 4, 1))
    fns, reports = {}, {}
    for name, (body, out_spec, _) in bodies.items():
        fns[name] = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=EVERY, out_specs=out_spec))
        reports[name] = wire.measure(fns[name], x, mesh=mesh)
    times = time_interleaved(fns, x, repeats)
    rows = []
    for name, ref_name in ((f"powersgd:rank={rank}", "lax.pmean"),
                           (f"ae:dim={max(n // 4, 1)}", "lax.psum")):
        base, ours = reports[ref_name].total(), reports[name].total()
        t_ours, t_ref = statistics.median(times[name]), statistics.median(times[ref_name])
        rows.append(dict(
            codec=name, reference=ref_name, axis=bodies[name][2], matrix=[m, n],
            bytes_per_device=ours, reference_bytes=base, byte_ratio=ours / base if base else None,
            rel_err=rel_err(fns[name](x), fns[ref_name](x)), time_s=t_ours,
            time_ratio=t_ours / t_ref, notes=list(reports[name].notes)))
    return rows


def _fixed_width(lines) -> str:
    """Rows of strings as columns: the first three left-aligned, the rest right."""
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    return "\n".join("  ".join(v.rjust(w) if i > 2 else v.ljust(w)
                               for i, (v, w) in enumerate(zip(line, widths))).rstrip()
                     for line in lines)


def structured_table(rows) -> str:
    """Fixed-width table of the structured rows, laid out like `table`."""
    head = ("codec", "axis", "vs", "matrix", "bytes/dev", "bytes x", "rel err", "ms", "time x")
    lines = [head] + [(
        r["codec"], r["axis"], r["reference"], f"{r['matrix'][0]}x{r['matrix'][1]}",
        f"{int(r['bytes_per_device']):,}",
        "-" if r["byte_ratio"] is None else f"{r['byte_ratio']:.3f}", f"{r['rel_err']:.2e}",
        f"{r['time_s'] * 1e3:.2f}", f"{r['time_ratio']:.2f}") for r in rows]
    return _fixed_width(lines)


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
    return _fixed_width(lines)


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
    ap.add_argument("--sizes", nargs="*", type=parse_size,
                    help="per-device float32 elements to time; alone (no values): the byte "
                    "sweep of benchmarks/sizes.py over sizes 1 to 1Mi and axes of 2 to 8")
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
    if args.sizes == []:
        from benchmarks import sizes
        return sizes.main([])
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
        structured = [r for size in args.sizes
                      for r in bench_structured(size, mesh, args.repeats, rng)]
    print(table(rows))
    print("\nStructured codecs beside the jax.lax op they replace (rank-4 + noise inputs; "
          "untrained autoencoder):")
    print(structured_table(structured))
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
               rows=rows, structured_rows=structured, notes=notes, budget=b)
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    raise SystemExit(main())
