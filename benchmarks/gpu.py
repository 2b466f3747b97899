"""Codec, collective and train-step speed on whatever accelerator JAX finds, in one call.

    pip install -e '.[cuda12]'          # on a GPU machine
    python -m benchmarks.gpu [--sizes-mib 1 4 16 64 256]
        [--codecs bf16 fp8 int8 int4 int4:rot int2 mxfp8 mxfp4 mxfp4:rot nvfp4 topk:0.01]
        [--ops psum psum_scatter all_gather ppermute all_to_all] [--op-mib 64]
        [--config configs/base.py] [--policies baseline hybrid] [--train-steps 20]
        [--repeats 10] [--json benchmarks/results/gpu.json] [--tiny]
    python -m benchmarks.gpu --h100 [--budget-s 480]   # predicted beside measured

Four parts, each timed with every call waited for (median of --repeats after
one warm-up call):
  codecs       encode and decode of a float32 vector of each size on one
               device; GB/s = input bytes / time (what a collective's codec
               pass costs, independent of any link);
  collectives  every cc.* op beside its jax.lax twin on a mesh of all devices
               (benchmarks/collectives.py's bodies and byte meter), --op-mib of
               float32 per device. An axis of size 1 moves nothing, so on one
               GPU these rows only show that the op falls back to jax.lax;
  train        train.py with --config for --train-steps steps per policy, in a
               subprocess: the median step_time_s of its metrics.jsonl after
               the first two steps. With fewer than 8 devices the mesh is all
               data-parallel (mesh.data=-1, tensor=1, pipeline=1); on one GPU
               every axis has size 1, so no policy sends anything and the
               policies' step times differ only by what they compute;
  psum         (with --h100, or --psum-mib) the program benchmarks.aot compiles
               for H100s: cc.psum of --psum-mib float32 per device over every
               local device on a 1-D mesh, per codec of benchmarks.aot's table,
               beside the plain psum; each row carries what jcomp.tune.compiled
               predicts from the H100 compile (benchmarks/results/
               aot_h100_psum64.json) and the profile's NVLink link
               (configs/profiles/h100_8x_nvlink_400g.json, "tensor"): the codec's
               seconds and the whole psum's, beside the measured ones (a codec's
               measured seconds: its psum's time less the plain psum's, plus the
               link time it is predicted to save).

--h100 is the program to run the day a GPU is lent: 64 MiB psums of every
codec the H100 compile holds, encode/decode at 64 MiB, and train.py on
configs/base.py with baseline, hybrid and auto (the codecs `python -m
jcomp.train.plan` picks for that mesh from the H100 profile), 12 steps each;
--budget-s (480 there) stops starting parts once spent, so the whole call
stays within 8 minutes, and says what it skipped.

--tiny is the smallest form (1 MiB, two codecs, two ops at 256 KiB, 3 steps of
configs/tiny.py): seconds on CPU, where it runs on 8 emulated devices.
"""
import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8").strip()
# train.py runs beside this process on the same accelerator: neither may take
# most of its memory up front, as JAX does by default on GPUs.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks import collectives as collectives_bench  # noqa: E402
from jcomp import codecs  # noqa: E402
from jcomp.gpt import mesh as jmesh  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

DEFAULTS = dict(sizes_mib=[1, 4, 16, 64, 256],
                codecs=["bf16", "fp8", "int8", "int4", "int4:rot", "int2", "mxfp8", "mxfp4",
                        "mxfp4:rot", "nvfp4", "topk:0.01"],
                ops=["psum", "psum_scatter", "all_gather", "ppermute", "all_to_all"], op_mib=64.0,
                config="configs/base.py", policies=["baseline", "hybrid"], train_steps=20,
                repeats=10)
TINY = dict(sizes_mib=[1], codecs=["bf16", "int8"], ops=["psum", "all_gather"], op_mib=0.25,
            config="configs/tiny.py", policies=["baseline"], train_steps=3, repeats=3,
            psum_mib=0.25)
# The codecs of benchmarks.aot's H100 table (not imported: it sets JAX_PLATFORMS=cpu).
AOT_CODECS = ["bf16", "fp8", "int8", "int4", "int4:rot", "mxfp8", "mxfp4", "mxfp4:rot", "nvfp4",
              "nvfp4:rot"]
H100 = dict(sizes_mib=[64], codecs=AOT_CODECS, ops=[], op_mib=64.0, config="configs/base.py",
            policies=["baseline", "hybrid", "auto"], train_steps=12, repeats=10, psum_mib=64.0,
            budget_s=480.0)
AOT_JSON = os.path.join(ROOT, "benchmarks", "results", "aot_h100_psum64.json")
PROFILE = os.path.join(ROOT, "configs", "profiles", "h100_8x_nvlink_400g.json")
PSUM_LINK = "tensor"  # the profile's link inside a node (NVLink)
WARM_STEPS = 2


def _median_time(fn, *args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_codecs(sizes_mib, codec_names, repeats: int) -> list[dict]:
    """Encode and decode GB/s of each codec on one device, per input size."""
    rows, rng = [], np.random.default_rng(0)
    device = jax.devices()[0]
    for mib in sizes_mib:
        n = int(mib * (1 << 20)) // 4
        x = jax.device_put(rng.standard_normal(n, dtype=np.float32), device)
        for name in codec_names:
            codec = codecs.parse(name)
            key = jax.random.key(0) if codec.needs_key else None
            enc = jax.jit(lambda v, c=codec, k=key: c.encode(v, key=k))
            dec = jax.jit(lambda p, c=codec: c.decode(p, (n,), np.float32))
            payload = enc(x)
            t_enc = _median_time(enc, x, repeats=repeats)
            t_dec = _median_time(dec, payload, repeats=repeats)
            y = np.asarray(dec(payload))
            rows.append(dict(codec=name, mib=mib, elements=n, wire_bytes=codec.wire_bytes((n,), np.float32),
                             encode_s=t_enc, decode_s=t_dec, encode_gb_s=4 * n / t_enc / 1e9,
                             decode_gb_s=4 * n / t_dec / 1e9,
                             rel_err=float(np.linalg.norm(y - np.asarray(x)) / np.linalg.norm(np.asarray(x)))))
            del payload
        del x
    return rows


def bench_collectives(ops, codec_names, op_mib: float, repeats: int) -> dict:
    """Every op with each codec beside its jax.lax twin ('none'), on all devices."""
    col = collectives_bench
    sizes = col.mesh_sizes(jax.device_count())
    mesh = jmesh.make_mesh(sizes)
    size = max(int(op_mib * (1 << 20)) // 4 // 256 * 256, 256)
    rng = np.random.default_rng(0)
    usable = [c for c in codec_names if codecs.parse(c).kind in ("dense", "sparse")]
    rows = []
    for op in ops:
        rows += col.bench_op(op, size, ["none"] + usable, mesh, repeats, rng)
    for r in rows:
        r.pop("times_s", None)
    return dict(mesh=dict(zip(jmesh.AXES, sizes)), elements_per_device=size, rows=rows)


def predicted_psum(codec_names, elements: int, n: int, aot_json: str = AOT_JSON,
                   profile_path: str = PROFILE) -> dict:
    """{codec: (predicted codec seconds, predicted psum seconds)} of a psum of
    `elements` float32 per device over n devices ("none" included), from the H100
    compile's codec costs (jcomp.tune.compiled) and the profile's NVLink link;
    {} where either file is missing."""
    from jcomp import tune
    from jcomp.tune import compiled
    try:
        with open(aot_json) as f:
            costs = compiled.codec_costs(json.load(f)["rows"])
        prof = tune.load(profile_path)
    except (OSError, ValueError, KeyError):
        return {}
    prof = tune.Profile(links=prof.links, codecs=costs, device=prof.device)
    n = max(n, 2)
    traffic = tune.Traffic(raw_bytes=4.0 * elements * 2 * (n - 1) / n, collectives=1,
                           op="all-reduce", n=n)
    out = {}
    for c in ["none"] + [c for c in codec_names if c in costs]:
        total = tune.predict(prof, PSUM_LINK, traffic, c, 0.0)
        link = prof.link(PSUM_LINK).seconds(traffic.coded_bytes(c), traffic.coded_collectives(c))
        out[c] = (total - link, total, link)
    return out


def bench_psum(codec_names, mib: float, repeats: int) -> dict:
    """cc.psum of `mib` MiB float32 per device over every local device (1-D mesh),
    per codec beside the plain psum, with benchmarks.aot's program and the
    predictions of `predicted_psum`."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jcomp import collectives as cc
    devices = jax.local_devices()
    n = len(devices)
    mesh = jax.sharding.Mesh(np.array(devices), ("x",))
    elements = max(int(mib * (1 << 20)) // 4 // 256 * 256, 256)
    x = jax.device_put(np.random.default_rng(0).standard_normal((n, elements), np.float32),
                       NamedSharding(mesh, P("x")))
    predicted = predicted_psum(codec_names, elements, n)
    rows = []
    for codec in ["none"] + list(codec_names):
        needs_key = codec != "none" and codecs.parse(codec).needs_key

        def body(x_1xS, codec=codec, needs_key=needs_key):
            return cc.psum(x_1xS[0], "x", codec=codec,
                           key=jax.random.key(0) if needs_key else None)[None]

        fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P()))
        rows.append(dict(op="psum", codec=codec, elements=elements, mib=4 * elements / 2**20,
                         devices=n, time_s=_median_time(fn, x, repeats=repeats)))
    plain = rows[0]["time_s"]
    for r in rows:
        pred = predicted.get(r["codec"])
        r["measured_over_plain_s"] = r["time_s"] - plain
        if pred:
            r.update(predicted_codec_s=pred[0], predicted_psum_s=pred[1],
                     predicted_link_s=pred[2],
                     # What the codec itself took, if the link's time is as predicted.
                     measured_codec_s=r["time_s"] - plain
                     + (predicted["none"][2] - pred[2]))
    return dict(devices=n, device_kind=devices[0].device_kind, rows=rows)


def auto_flags(config: str, n_devices: int) -> list[str]:
    """The --config.compression.AXIS.KIND=CODEC flags of what `python -m
    jcomp.train.plan` picks for `config` on `n_devices` from the H100 profile."""
    from jcomp.train.auto import basis as auto_basis, decide as auto
    from jcomp.train import plan
    from jcomp.train.settings import runspec
    cfg = plan._config(os.path.join(ROOT, config))
    run = runspec.build(runspec.read(cfg, n_devices).uncompressed())
    summary = auto.choose(run, auto_basis.load_profile(PROFILE, "profile"), {}, 0.0, "gpu.py")
    return [f"--config.compression.{entry}={e['codec']}"
            for entry, e in summary["entries"].items() if e["codec"] != "none"]


def _mesh_flags(n_devices: int) -> list[str]:
    if n_devices >= 8:
        return []
    return ["--config.mesh.data=-1", "--config.mesh.tensor=1", "--config.mesh.pipeline=1"]


def bench_train(config: str, policies, steps: int, timeout: float,
                deadline: float | None = None) -> list[dict]:
    """train.py's median step time per policy, each in a fresh subprocess
    ("auto": baseline with `auto_flags`); none started past `deadline`
    (time.perf_counter())."""
    rows = []
    for policy in policies:
        left = None if deadline is None else deadline - time.perf_counter()
        if left is not None and left < 30:
            rows.append(dict(policy=policy, skipped="over --budget-s"))
            continue
        extra = []
        if policy == "auto":
            extra = auto_flags(config, jax.device_count() if jax.device_count() >= 8 else 8)
            if jax.device_count() < 8:
                extra = []  # the mesh is all data-parallel: no plan for 8 applies
        with tempfile.TemporaryDirectory(prefix="gpu-train-") as workdir:
            cmd = [sys.executable, os.path.join(ROOT, "train.py"), f"--config={config}",
                   f"--workdir={workdir}", f"--config.train.steps={steps}",
                   "--config.train.log_every=1", f"--config.train.eval_every={steps}",
                   "--config.optim.warmup_steps=1", f"--config.checkpoint.every={steps}",
                   f"--config.compression.policy={'baseline' if policy == 'auto' else policy}",
                   *extra, *_mesh_flags(jax.device_count())]
            t0 = time.perf_counter()
            try:
                proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                                      timeout=timeout if left is None else min(timeout, left))
            except subprocess.TimeoutExpired:
                rows.append(dict(policy=policy, error=["timed out"]))
                continue
            wall = time.perf_counter() - t0
            if proc.returncode:
                rows.append(dict(policy=policy, error=proc.stderr.strip().splitlines()[-1:]))
                continue
            with open(os.path.join(workdir, "metrics.jsonl")) as f:
                records = [json.loads(line) for line in f]
        times = [r["step_time_s"] for r in records if r["step"] > WARM_STEPS] or \
            [r["step_time_s"] for r in records]
        static = next(r for r in records if "wire_bytes_total" in r)
        rows.append(dict(policy=policy, flags=extra, steps=steps,
                         median_step_s=statistics.median(times),
                         tokens_per_s=statistics.median(r["tokens_per_s"] for r in records),
                         wire_bytes_per_device=static["wire_bytes_total"],
                         devices=static["devices"], final_loss=records[-1]["loss"], wall_s=wall))
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="the smallest form (seconds on CPU)")
    p.add_argument("--h100", action="store_true",
                   help="the H100 compile's program, measured (within --budget-s)")
    p.add_argument("--psum-mib", type=float, help="time cc.psum of this size per codec")
    p.add_argument("--budget-s", type=float, help="start no part after this many seconds")
    p.add_argument("--sizes-mib", type=float, nargs="+")
    p.add_argument("--codecs", nargs="+")
    p.add_argument("--ops", nargs="+")
    p.add_argument("--op-mib", type=float)
    p.add_argument("--config")
    p.add_argument("--policies", nargs="+")
    p.add_argument("--train-steps", type=int)
    p.add_argument("--repeats", type=int)
    p.add_argument("--train-timeout", type=float, default=900.0)
    p.add_argument("--json", default=os.path.join("benchmarks", "results", "gpu.json"))
    args = p.parse_args(argv)
    if args.tiny and args.h100:
        print("gpu.py: error: --tiny and --h100 are two forms; pick one", file=sys.stderr)
        return 2
    base = TINY if args.tiny else H100 if args.h100 else DEFAULTS
    for key, value in base.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    try:
        for c in args.codecs:
            codecs.parse(c)
        bad = [o for o in args.ops if o not in collectives_bench.OPS]
        if bad:
            raise ValueError(f"--ops: unknown {bad}")
        if min(args.sizes_mib) <= 0 or args.op_mib <= 0 or args.repeats < 1 or \
                args.train_steps <= WARM_STEPS:
            raise ValueError(f"--sizes-mib and --op-mib must be > 0, --repeats >= 1 and "
                             f"--train-steps > {WARM_STEPS}")
    except ValueError as e:
        print(f"gpu.py: error: {e}", file=sys.stderr)
        return 2
    start = time.perf_counter()
    deadline = None if args.budget_s is None else start + args.budget_s
    devices = jax.devices()
    out = dict(command="python -m benchmarks.gpu " + " ".join(sys.argv[1:] if argv is None else argv),
               date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               backend=jax.default_backend(), device_kind=devices[0].device_kind,
               device_count=len(devices), jax_version=jax.__version__, repeats=args.repeats)
    out["codecs"] = bench_codecs(args.sizes_mib, args.codecs, args.repeats)
    for r in out["codecs"]:
        print(f"codec {r['codec']:>10} {r['mib']:>6g} MiB: encode {r['encode_gb_s']:8.2f} GB/s, "
              f"decode {r['decode_gb_s']:8.2f} GB/s, rel. error {r['rel_err']:.2e}", flush=True)
    if args.psum_mib:
        out["psum"] = bench_psum(args.codecs, args.psum_mib, args.repeats)
        for r in out["psum"]["rows"]:
            pred = (f", predicted {r['predicted_psum_s'] * 1e3:.3f} ms (codec "
                    f"{r['predicted_codec_s'] * 1e3:.3f} ms, measured "
                    f"{r['measured_codec_s'] * 1e3:.3f} ms)" if "predicted_psum_s" in r else "")
            print(f"psum {r['mib']:g} MiB over {r['devices']} {r['codec']:>10}: "
                  f"{r['time_s'] * 1e3:9.3f} ms{pred}", flush=True)
    if args.ops:
        out["collectives"] = bench_collectives(args.ops, args.codecs, args.op_mib, args.repeats)
        for r in out["collectives"]["rows"]:
            ratio = "-" if r["byte_ratio"] is None else f"{r['byte_ratio']:.3f}"
            print(f"{r['op']:>12} {r['codec']:>10}: {r['time_s'] * 1e3:9.3f} ms, "
                  f"x{r['time_ratio']:.2f} the jax.lax op's time, bytes x{ratio}", flush=True)
    out["train"] = bench_train(args.config, args.policies, args.train_steps, args.train_timeout,
                               deadline)
    for r in out["train"]:
        print(f"train.py {args.config} {r['policy']}: " + (
            f"skipped ({r['skipped']})" if "skipped" in r else
            f"median step {r['median_step_s'] * 1e3:.1f} ms on {r['devices']} devices"
            if "error" not in r else f"FAILED: {r['error']}"), flush=True)
    out["wall_s"] = time.perf_counter() - start
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1, allow_nan=False)
    print(f"wrote {args.json}")
    return 1 if any("error" in r for r in out["train"]) else 0


if __name__ == "__main__":
    sys.exit(main())
