"""jcomp.tune.probe's codec figures beside benchmarks/gpu.py's own codec timing,
in one process, on the same input size.

    python -m benchmarks.probe [--mib 4] [--codecs bf16 int8 int4:rot] [--repeats 20]
                               [--json benchmarks/results/probe_codecs.json]

Three figures per codec, encode and decode in GB/s of float32 input:
  bench     benchmarks.gpu.bench_codecs: a flat vector on one device, alone;
  probe 1   tune.probe on a mesh of that one device: rows of 4096 elements;
  probe all tune.probe on every device at once (what compression.auto prices):
            on emulated CPU devices they share the processor, so each codes
            slower than alone by about devices / cores.
bench and probe 1 should agree (the same work on the same device); probe all
is what the train step sees. The probe's link part is not timed here.
"""
import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8").strip()

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks import gpu  # noqa: E402
from jcomp import tune  # noqa: E402

DEFAULT_CODECS = tune.DEFAULT_CODECS


def _mesh(devices):
    return jax.sharding.Mesh(np.asarray(devices).reshape(len(devices)), ("data",))


def _gb_s(s_per_byte: float) -> float:
    return 1.0 / s_per_byte / 1e9


def measure(mib: float, codecs, repeats: int) -> list[dict]:
    nbytes = int(mib * (1 << 20))
    bench = {r["codec"]: r for r in gpu.bench_codecs([mib], list(codecs), repeats)}
    probed = {}
    for name, devices in (("probe_1", jax.devices()[:1]), ("probe_all", jax.devices())):
        # sizes are the link part's, irrelevant on a one-device axis: it has no link.
        prof = tune.probe(_mesh(devices), codecs=codecs, codec_bytes=nbytes, repeats=repeats)
        probed[name] = prof.codecs
    rows = []
    for c in codecs:
        b = bench[c]
        row = dict(codec=c, mib=mib, bench_encode_gb_s=b["encode_gb_s"],
                   bench_decode_gb_s=b["decode_gb_s"])
        for name, costs in probed.items():
            row[f"{name}_encode_gb_s"] = _gb_s(costs[c].encode_s_per_byte)
            row[f"{name}_decode_gb_s"] = _gb_s(costs[c].decode_s_per_byte)
        rows.append(row)
    return rows


def table(rows, devices: int) -> str:
    head = ("codec", "encode GB/s: bench", "probe 1", "x bench", f"probe all {devices}",
            "decode GB/s: bench", "probe 1", "x bench", f"probe all {devices}")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [f"`{r['codec']}`"]
        for part in ("encode", "decode"):
            b, one, every = (r[f"bench_{part}_gb_s"], r[f"probe_1_{part}_gb_s"],
                             r[f"probe_all_{part}_gb_s"])
            cells += [f"{b:.2f}", f"{one:.2f}", f"{one / b:.2f}", f"{every:.3f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=float, default=4.0, help="MiB of float32 each device codes")
    p.add_argument("--codecs", nargs="+", default=list(DEFAULT_CODECS))
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--json", default=None, help="write the rows here")
    args = p.parse_args(argv)
    if args.mib <= 0 or args.repeats < 1:
        print("probe.py: error: --mib must be > 0 and --repeats >= 1", file=sys.stderr)
        return 2
    rows = measure(args.mib, tuple(args.codecs), args.repeats)
    print(table(rows, jax.device_count()))
    if args.json:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True).stdout.strip()
        with open(args.json, "w") as f:
            json.dump(dict(command="python -m benchmarks.probe " + " ".join(argv or sys.argv[1:]),
                           commit=commit, date=datetime.datetime.now(datetime.timezone.utc)
                           .isoformat(timespec="seconds"), backend=jax.default_backend(),
                           device_count=jax.device_count(), rows=rows), f, indent=1)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
