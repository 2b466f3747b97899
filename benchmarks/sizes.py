"""Bytes of every compressed collective against its jax.lax twin, at every size.

    python -m benchmarks.collectives --sizes          # the default grid below
    python -m benchmarks.sizes [--elements 1 7 100] [--axis-sizes 2 4] [--codecs int8 ...]

For each axis size n, op, codec and per-device operand size it compiles the
`jcomp.collectives` call and the `jax.lax` call on a 1-D mesh of n emulated
devices and prints the ratio of the bytes one device sends per call, both read
from the compiled programs by `jcomp.meter.wire`. A cell where jcomp sends the
operand raw (the codec cannot win at that size) is marked `raw`; the meter
finds those from the compiled program's metadata, not from a formula.

Operands: psum, all_gather and ppermute take `size` float32 elements per
device; psum_scatter and all_to_all take `size` rounded up to a multiple of n
(they split the operand into n pieces).

Checks printed at the end: no cell above 1.00 except raw sends; int8 at most
0.26 from 4096 elements; topk:F psum at most 2F + 0.01 from 4096 elements
(below that a chunk keeps at least one entry, so the fraction rounds up).
"""
import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8").strip()

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import warnings  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from jcomp import codecs  # noqa: E402
from jcomp import collectives as cc  # noqa: E402
from jcomp.meter import wire  # noqa: E402

OPS = ("psum", "psum_scatter", "all_gather", "ppermute", "all_to_all")
ELEMENTS = (1, 7, 100, 4096, 1024 * 1024)
AXIS_SIZES = (2, 4, 8)
CODECS = ("bf16", "fp16", "fp8", "int8", "int4", "int2", "int8:sr", "topk:0.01", "topk:0.1",
          "randk:0.1")


def operand_len(op: str, size: int, n: int) -> int:
    return -(-size // n) * n if op in ("psum_scatter", "all_to_all") else size


def _call(op: str, x, n: int, codec):
    """`op` over axis 'x' with jcomp (codec given) or jax.lax (codec None)."""
    lib, kw = (lax, {}) if codec is None else (cc, dict(codec=codec))
    if codec is not None and codecs.parse(codec).needs_key:
        kw["key"] = jax.random.key(0)
    if op == "psum":
        return lib.psum(x, "x", **kw)
    if op == "psum_scatter":
        return lib.psum_scatter(x, "x", tiled=True, **kw)
    if op == "all_gather":
        return lib.all_gather(x, "x", tiled=True, **kw)
    if op == "ppermute":
        return lib.ppermute(x, "x", [(i, (i + 1) % n) for i in range(n)], **kw)
    return lib.all_to_all(x, "x", 0, 0, tiled=True, **kw)


def cell_report(op: str, size: int, n: int, codec):
    """WireReport of one call (per-device operand of `operand_len` float32 elements)."""
    mesh = jax.make_mesh((n,), ("x",), axis_types=(jax.sharding.AxisType.Explicit,),
                         devices=jax.devices()[:n])
    m = operand_len(op, size, n)
    out_spec = P() if op == "psum" else P("x")
    fn = jax.shard_map(lambda x: _call(op, x, n, codec), mesh=mesh, in_specs=P("x"),
                       out_specs=out_spec)
    x = jax.ShapeDtypeStruct((n * m,), jnp.float32,
                             sharding=jax.sharding.NamedSharding(mesh, P("x")))
    with jax.set_mesh(mesh), warnings.catch_warnings():
        warnings.simplefilter("ignore", cc.RawSendWarning)
        return wire.measure(jax.jit(fn), x, mesh=mesh)


def sweep(elements=ELEMENTS, axis_sizes=AXIS_SIZES, codec_list=CODECS, ops=OPS, log=print):
    rows = []
    for n in axis_sizes:
        if n > jax.device_count():
            raise SystemExit(f"--axis-sizes: {n} exceeds the {jax.device_count()} devices")
        for op in ops:
            for size in elements:
                lax_bytes = cell_report(op, size, n, None).total()
                for codec in codec_list:
                    rep = cell_report(op, size, n, codec)
                    raw = any("send raw" in note for note in rep.notes)
                    rows.append(dict(n=n, op=op, elements=size, codec=codec,
                                     bytes=rep.total(), lax_bytes=lax_bytes,
                                     ratio=rep.total() / lax_bytes if lax_bytes else None,
                                     raw=raw))
            log(f"  done n={n} {op}", flush=True)
    return rows


def violations(rows) -> list[str]:
    out = []
    for r in rows:
        where = f"{r['op']} {r['codec']} at {r['elements']} elements, n={r['n']}"
        ratio = r["ratio"]
        if ratio is None:
            continue
        if ratio > 1.0 + 1e-9 and not r["raw"]:
            out.append(f"{where}: {ratio:.3f} of lax's bytes")
        if r["raw"] and abs(ratio - 1.0) > 1e-9:
            out.append(f"{where}: marked raw but sends {ratio:.3f} of lax's bytes")
        if r["codec"] == "int8" and r["elements"] >= 4096 and ratio > 0.26:
            out.append(f"{where}: int8 sends {ratio:.3f} > 0.26")
        if r["codec"].startswith("topk:") and r["op"] == "psum" and r["elements"] >= 4096:
            f = float(r["codec"].split(":")[1])
            if ratio > 2 * f + 0.01:
                out.append(f"{where}: {ratio:.4f} > 2F + 0.01 = {2 * f + 0.01:.4f}")
    return out


def table(rows) -> str:
    """One line per (op, codec, n), one column per size; raw cells marked."""
    sizes = sorted({r["elements"] for r in rows})
    head = ["op", "codec", "n"] + [_size(s) for s in sizes]
    lines = [head]
    keys = list(dict.fromkeys((r["op"], r["codec"], r["n"]) for r in rows))
    by = {(r["op"], r["codec"], r["n"], r["elements"]): r for r in rows}
    for op, codec, n in keys:
        cells = []
        for s in sizes:
            r = by.get((op, codec, n, s))
            cells.append("-" if r is None or r["ratio"] is None else
                         ("raw" if r["raw"] else f"{r['ratio']:.3f}"))
        lines.append([op, codec, str(n)] + cells)
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    return "\n".join("  ".join(v.ljust(w) for v, w in zip(line, widths)).rstrip()
                     for line in lines)


def summary(rows) -> str:
    """Per codec and size, the largest ratio over all ops and axis sizes among the
    cells that code, and how many cells send raw: the README's table."""
    sizes = sorted({r["elements"] for r in rows})
    lines = ["| codec | " + " | ".join(_size(s) for s in sizes) + " |",
             "|---|" + "---|" * len(sizes)]
    for codec in dict.fromkeys(r["codec"] for r in rows):
        cells = []
        for size in sizes:
            group = [r for r in rows if r["codec"] == codec and r["elements"] == size
                     and r["ratio"] is not None]
            coded = [r["ratio"] for r in group if not r["raw"]]
            raw = len(group) - len(coded)
            cell = f"{max(coded):.3f}" if coded else "raw"
            if coded and raw:
                cell += f" ({raw} of {len(group)} raw)"
            cells.append(cell)
        lines.append(f"| `{codec}` | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _size(n: int) -> str:
    return f"{n // 2**20}Mi" if n >= 2**20 and n % 2**20 == 0 else str(n)


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--elements", nargs="+", type=int, default=list(ELEMENTS))
    ap.add_argument("--axis-sizes", nargs="+", type=int, default=list(AXIS_SIZES))
    ap.add_argument("--codecs", nargs="+", default=list(CODECS))
    ap.add_argument("--ops", nargs="+", choices=OPS, default=list(OPS))
    ap.add_argument("--json", default="benchmarks/results/collectives_sizes.json")
    args = ap.parse_args(argv)
    if any(e < 1 for e in args.elements) or any(n < 2 for n in args.axis_sizes):
        ap.error("--elements must be >= 1 and --axis-sizes >= 2")
    for c in args.codecs:
        try:
            cc.parse(c)
        except (ValueError, TypeError) as e:
            ap.error(f"--codecs: {e}")
    print(f"jax {jax.__version__}, backend {jax.default_backend()}, {jax.device_count()} devices; "
          "bytes one device sends per call relative to the jax.lax op", flush=True)
    rows = sweep(args.elements, args.axis_sizes, args.codecs, args.ops)
    print(table(rows))
    print("\nlargest ratio over ops and axis sizes, per codec and size (raw cells counted):")
    print(summary(rows))
    bad = violations(rows)
    print("checks: " + ("PASS (no cell above 1.00 except raw sends; int8 <= 0.26 and "
                        "topk psum <= 2F + 0.01 from 4096 elements)" if not bad else
                        "FAIL\n  " + "\n  ".join(bad)))
    out = dict(jax_version=jax.__version__, backend=jax.default_backend(), commit=_commit(),
               date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               rows=rows, violations=bad)
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {args.json}")
    return 0 if not bad else 1


if __name__ == "__main__":
    raise SystemExit(main())
