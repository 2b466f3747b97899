"""Codec, collective and train-step speed on whatever accelerator JAX finds, in one call.

    pip install -e '.[cuda12]'          # on a GPU machine
    python -m benchmarks.gpu [--sizes-mib 1 4 16 64 256]
        [--codecs bf16 fp8 int8 int4 int4:rot int2 mxfp8 mxfp4 mxfp4:rot nvfp4 topk:0.01]
        [--ops psum psum_scatter all_gather ppermute all_to_all] [--op-mib 64]
        [--config configs/base.py] [--policies baseline hybrid] [--train-steps 20]
        [--repeats 10] [--json benchmarks/results/gpu.json] [--tiny]

Three parts, each timed with every call waited for (median of --repeats after
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
               policies' step times differ only by what they compute.

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
            config="configs/tiny.py", policies=["baseline"], train_steps=3, repeats=3)
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


def _mesh_flags(n_devices: int) -> list[str]:
    if n_devices >= 8:
        return []
    return ["--config.mesh.data=-1", "--config.mesh.tensor=1", "--config.mesh.pipeline=1"]


def bench_train(config: str, policies, steps: int, timeout: float) -> list[dict]:
    """train.py's median step time per policy, each in a fresh subprocess."""
    rows = []
    for policy in policies:
        with tempfile.TemporaryDirectory(prefix="gpu-train-") as workdir:
            cmd = [sys.executable, os.path.join(ROOT, "train.py"), f"--config={config}",
                   f"--workdir={workdir}", f"--config.train.steps={steps}",
                   "--config.train.log_every=1", f"--config.train.eval_every={steps}",
                   "--config.optim.warmup_steps=1", f"--config.checkpoint.every={steps}",
                   f"--config.compression.policy={policy}", *_mesh_flags(jax.device_count())]
            t0 = time.perf_counter()
            proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
            wall = time.perf_counter() - t0
            if proc.returncode:
                rows.append(dict(policy=policy, error=proc.stderr.strip().splitlines()[-1:]))
                continue
            with open(os.path.join(workdir, "metrics.jsonl")) as f:
                records = [json.loads(line) for line in f]
        times = [r["step_time_s"] for r in records if r["step"] > WARM_STEPS] or \
            [r["step_time_s"] for r in records]
        static = next(r for r in records if "wire_bytes_total" in r)
        rows.append(dict(policy=policy, steps=steps, median_step_s=statistics.median(times),
                         tokens_per_s=statistics.median(r["tokens_per_s"] for r in records),
                         wire_bytes_per_device=static["wire_bytes_total"],
                         devices=static["devices"], final_loss=records[-1]["loss"], wall_s=wall))
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="the smallest form (seconds on CPU)")
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
    base = TINY if args.tiny else DEFAULTS
    for key, value in base.items():
        if getattr(args, key) is None:
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
    devices = jax.devices()
    out = dict(command="python -m benchmarks.gpu " + " ".join(sys.argv[1:] if argv is None else argv),
               date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               backend=jax.default_backend(), device_kind=devices[0].device_kind,
               device_count=len(devices), jax_version=jax.__version__, repeats=args.repeats)
    out["codecs"] = bench_codecs(args.sizes_mib, args.codecs, args.repeats)
    for r in out["codecs"]:
        print(f"codec {r['codec']:>10} {r['mib']:>6g} MiB: encode {r['encode_gb_s']:8.2f} GB/s, "
              f"decode {r['decode_gb_s']:8.2f} GB/s, rel. error {r['rel_err']:.2e}", flush=True)
    out["collectives"] = bench_collectives(args.ops, args.codecs, args.op_mib, args.repeats)
    for r in out["collectives"]["rows"]:
        ratio = "-" if r["byte_ratio"] is None else f"{r['byte_ratio']:.3f}"
        print(f"{r['op']:>12} {r['codec']:>10}: {r['time_s'] * 1e3:9.3f} ms, x{r['time_ratio']:.2f} "
              f"the jax.lax op's time, bytes x{ratio}", flush=True)
    out["train"] = bench_train(args.config, args.policies, args.train_steps, args.train_timeout)
    for r in out["train"]:
        print(f"train.py {args.config} {r['policy']}: " + (
            f"median step {r['median_step_s'] * 1e3:.1f} ms on {r['devices']} devices"
            if "error" not in r else f"FAILED: {r['error']}"), flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1, allow_nan=False)
    print(f"wrote {args.json}")
    return 1 if any("error" in r for r in out["train"]) else 0


if __name__ == "__main__":
    sys.exit(main())
