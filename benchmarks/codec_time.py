"""Where a policy's extra step time goes: the train step with one policy entry
compressed at a time, timed side by side with the baseline and the whole policy.

    python -m benchmarks.codec_time [--policy hybrid] [--shape 2,2,2] [--microbatches 2]
                                    [--entries data.grad ...] [--codecs int4 nvfp4 ...]
                                    [--repeats 11] [--json PATH] [--flat-rows] [--quick]
                                    [--d-model 128 --layers 4 --heads 4 --seq 128 --batch 16]

For each entry of the policy that compresses a message the step sends
(policy.MESSAGES), it compiles the step with only that entry's codec (the rest
"none"), plus the baseline and the whole policy, and times every compiled step
round-robin in one loop (benchmarks/parallel.py's `time_interleaved`), so that
load on a shared machine slows them alike. Per row: the median step time, its
ratio to the baseline, and the milliseconds it adds. On emulated CPU devices
nothing crosses a wire, so what a row adds is the codec's own time (encode,
decode, the float32 sums) and the extra collectives' rendezvous: the cost a
fast link cannot pay back. The model and batch default to configs/base.py's.

--codecs times each entry alone with each of these codecs instead of the
policy's own (e.g. `--entries tensor.act --codecs int4 mxfp4 nvfp4`): codecs
side by side on one message.

--flat-rows adds the whole policy with its activation messages coded in flat
blocks across tokens, as the step sent them before blocks were kept within a
token (benchmarks/parallel.py's `flat_activations`): the bytes and time that
row-local blocks cost, side by side. Every row also gives the compiled step's
bytes per device per axis.
"""
import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8").strip()

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

import jax  # noqa: E402

from benchmarks import parallel as bench_parallel  # noqa: E402
from jcomp import codecs  # noqa: E402
from jcomp.gpt import mesh as jmesh  # noqa: E402
from jcomp.gpt import sharding  # noqa: E402
from jcomp.gpt import policy as policy_lib  # noqa: E402
from jcomp.meter import wire  # noqa: E402

DEFAULTS = dict(repeats=11, d_model=128, layers=4, heads=4, d_ff=512, vocab=256, seq=128,
                batch=16)
QUICK = dict(repeats=1, d_model=32, layers=2, heads=4, d_ff=64, vocab=64, seq=16, batch=8)


def variants(pol: policy_lib.Policy, entries=None, codec_list=None) -> dict:
    """{name: policy}: the baseline, the whole policy, and the baseline with each of
    the policy's compressing entries ("axis.kind"; None: all) alone, its
    error-feedback switch kept; with `codec_list`, each wanted entry (None: the
    policy's compressing ones) alone with each of those codecs."""
    base = policy_lib.preset("baseline")
    out = {"baseline": base, "whole policy": pol}
    for axis, kind in policy_lib.MESSAGES:
        codec = pol[axis, kind]
        wanted = f"{axis}.{kind}" in entries if entries is not None else \
            getattr(codec, "kind", None) != "identity"
        if not wanted:
            continue
        for c in codec_list or ([codec] if getattr(codec, "kind", None) != "identity" else []):
            alone = base.replace({f"{axis}.{kind}": c})
            out[f"only {axis}.{kind}={alone[axis, kind]}"] = dataclasses.replace(
                alone, error_feedback=pol.error_feedback)
    return out


def rows_of(names, built, times) -> list[dict]:
    base = statistics.median(times[0])
    return [dict(variant=n, compression=b["plan"].describe(), median_s=statistics.median(t),
                 ratio=statistics.median(t) / base, added_ms=(statistics.median(t) - base) * 1e3,
                 times_s=t, bytes_by_axis=wire.measure_compiled(b["exe"], b["mesh"]).by_axis())
            for n, b, t in zip(names, built, times)]


def table(rows) -> str:
    axes = ("data", "tensor", "pipeline")
    lines = [f"{'variant':40s} {'step ms':>9s} {'x baseline':>11s} {'added ms':>9s} "
             + " ".join(f"{a + ' B':>11s}" for a in axes)]
    lines += [f"{r['variant']:40s} {r['median_s'] * 1e3:9.1f} {r['ratio']:11.3f} "
              f"{r['added_ms']:+9.1f} "
              + " ".join(f"{r['bytes_by_axis'].get(a, 0.0):11,.0f}" for a in axes) for r in rows]
    alone = sum(r["added_ms"] for r in rows if r["variant"].startswith("only "))
    lines.append(f"sum of the entries alone: {alone:+.1f} ms; the whole policy: "
                 f"{rows[1]['added_ms']:+.1f} ms")
    return "\n".join(lines)


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, cwd=os.path.dirname(os.path.abspath(__file__)),
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--policy", default="hybrid", choices=list(policy_lib.PRESETS))
    ap.add_argument("--shape", type=bench_parallel.parse_shape, default=(2, 2, 2),
                    help="data,tensor,pipeline sizes")
    ap.add_argument("--microbatches", type=int, default=2)
    ap.add_argument("--entries", nargs="+", metavar="AXIS.KIND",
                    help="time only these entries alone (default: every compressing one)")
    ap.add_argument("--codecs", nargs="+", metavar="CODEC",
                    help="time each entry alone with each of these codecs")
    ap.add_argument("--repeats", type=int, help="timed steps per variant (default 11)")
    bench_parallel.add_model_args(ap)
    ap.add_argument("--json", default="benchmarks/results/codec_time.json")
    ap.add_argument("--flat-rows", action="store_true",
                    help="add the whole policy with activation blocks across tokens")
    ap.add_argument("--quick", action="store_true", help=f"smoke run: {QUICK} unless given")
    args = ap.parse_args(argv)
    for name, value in (QUICK if args.quick else DEFAULTS).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    bench_parallel.check_positive(args, ap, ("repeats", "microbatches")
                                  + bench_parallel.MODEL_FIELDS)
    if math.prod(args.shape) != jax.device_count():
        ap.error(f"--shape must use all {jax.device_count()} devices; got "
                 + ",".join(map(str, args.shape)))
    known = [f"{a}.{k}" for a, k in policy_lib.MESSAGES]
    for e in args.entries or ():
        if e not in known:
            ap.error(f"--entries: {e!r} names no message; allowed: {', '.join(known)}")
    for c in args.codecs or ():
        try:
            codecs.parse(c)
        except (ValueError, TypeError) as e:
            ap.error(f"--codecs: {e}")
    args.model = bench_parallel.model_config(args, ap)
    try:
        sharding.check_layout(args.model, dict(zip(jmesh.AXES, args.shape)), args.batch,
                              args.microbatches)
    except ValueError as e:
        ap.error(str(e))
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    cfg = args.model
    tx, params, tokens_BxL1 = bench_parallel.inputs(cfg, args.batch, args.seq)
    pols = variants(policy_lib.preset(args.policy), args.entries, args.codecs)
    flat = {"whole policy, flat blocks across tokens": pols["whole policy"]} if args.flat_rows \
        else {}
    built = [bench_parallel.compile_step(p, args.shape, args.microbatches, cfg, tx, params,
                                         tokens_BxL1, rows="flat" if n in flat else None)
             for n, p in {**pols, **flat}.items()]
    pols = {**pols, **flat}
    _, times = bench_parallel.time_interleaved(built, args.repeats)
    rows = rows_of(list(pols), built, times)
    print(f"policy {args.policy} on mesh {args.shape}, M={args.microbatches}, model {cfg}, "
          f"batch {args.batch}, {args.repeats} timed steps each, interleaved")
    print(table(rows))
    out = dict(command="python -m benchmarks.codec_time " + " ".join(argv or sys.argv[1:]),
               commit=_commit(), date=datetime.datetime.now(datetime.timezone.utc).isoformat(
                   timespec="seconds"), jax_version=jax.__version__,
               backend=jax.default_backend(), policy=args.policy, shape=list(args.shape),
               microbatches=args.microbatches, model=str(cfg), batch=args.batch, rows=rows)
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1, default=str)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
