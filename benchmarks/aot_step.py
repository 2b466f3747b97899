"""jcomp's train step compiled for H100s without a GPU: what each policy's
codecs cost in HBM traffic per step, every collective, and what XLA's
scheduler runs while each async collective is in flight.

    pip install -e '.[aot]'
    JAX_PLATFORMS=cpu python -m benchmarks.aot_step [--runs base neox20b]
        [--json benchmarks/results/aot_step_h100.json] [--hlo-dir DIR]

Each run builds the trainer's own step (jcomp.gpt.step.make_train_step, the
RunSpec of a config as train.py validates it) on a mesh of compile-only H100s
(benchmarks.aot.topology), with the train state and batch as abstract shapes
(jax.ShapeDtypeStruct with NamedShardings): nothing is allocated or run.

  base     configs/base.py on 8 H100s as (data 2, tensor 2, pipeline 2):
           baseline, hybrid, and auto (what `python -m jcomp.train.plan`
           chooses for that mesh with configs/profiles/h100_8x_nvlink_400g.json).
  neox20b  configs/neox20b.py at its per-device shapes on the paper's layout
           (tensor 4, pipeline 4; 128 sequences of 2048 per data rank, 16
           microbatches, remat) on 32 H100s as (data 2, tensor 4, pipeline 4),
           with --neox-layers of its 44 layers (default 8, a multiple of 4: one or
           more per stage) and half as many beside it: the byte figures scale
           linearly to 44 layers from the two (the `*_at_44` fields), the
           embedding, head and optimizer of those kept. Auto is the choice for
           the paper's run itself (192 GPUs, data 12). Its gemms compile to
           cuBLAS (NEOX_OPTIONS: why).

From the optimized HLO (scheduled: its text order is the GPU's launch order):

  kernel_io        benchmarks.aot's kernel I/O (bytes read plus written by each
                   launched kernel) summed over the step, each while loop's body
                   counted its known trip count times;
  by message       the same, of the kernels in each message's scope
                   (jcomp.meter.scope: the op_name of every instruction the
                   collectives of a message run under), split into collectives
                   and the rest;
  codec_io         per message, the rest's kernel I/O less the baseline's of the
                   same message: the HBM bytes the codec adds (its encode and
                   decode kernels, and what fusing them changed), against the
                   wire bytes it saves (jcomp.meter.wire of both programs);
  collectives      every collective: kind, async or not, its message, and the
                   launched instructions scheduled between its start and done
                   (kernels, gemms among them, other collectives): what XLA
                   overlaps it with.
"""
from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402

from benchmarks import aot  # noqa: E402
from jcomp.meter import hlo, wire  # noqa: E402

ROOT = aot.ROOT
PROFILE = os.path.join(ROOT, "configs", "profiles", "h100_8x_nvlink_400g.json")
RUNS = ("base", "neox20b")
POLICIES = ("baseline", "hybrid", "auto")
NEOX_LAYERS = 8
# XLA's Triton gemm tiler finds no tiling for one of neox20b's fused bf16 dots
# without a device to autotune on ("Couldn't find output tile sizes", jax
# 0.10.2); its gemms go to cuBLAS instead, as XLA's own fallback would.
NEOX_OPTIONS = {"xla_gpu_enable_triton_gemm": False}
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
_GEMM_TARGETS = re.compile(r"gemm|cublas", re.I)
_GEMM_FUSIONS = re.compile(r"__triton_(nested_)?gemm|__cublas")


# ---------------------------------------------------------------- the step

def config(path: str):
    from jcomp.train import plan
    return plan._config(os.path.join(ROOT, path) if not os.path.isabs(path) else path)


def auto_entries(cfg, n_devices: int, profile_path: str = PROFILE) -> dict:
    """{"axis.kind": codec} that compression.auto picks for `cfg` on
    `n_devices` from the profile (jcomp.train.plan's choice)."""
    from jcomp.train.auto import basis as auto_basis, decide as auto
    from jcomp.train.settings import auto as auto_settings
    from jcomp.train.settings import runspec
    run = runspec.build(runspec.read(cfg, n_devices).uncompressed())
    budget = auto_settings.parse_budget(cfg.compression.get("budget", ""))
    overlap = auto_settings.check_overlap(cfg.compression.get("overlap", 0.0))
    summary = auto.choose(run, auto_basis.load_profile(profile_path, "profile"), budget, overlap,
                          "planned from shapes")
    return {e: v["codec"] for e, v in summary["entries"].items()}


def with_policy(cfg, policy: str, n_devices: int):
    """A copy of `cfg` sending `policy`'s codecs ("auto": auto_entries's; "keep":
    the config's own)."""
    cfg = cfg.copy_and_resolve_references()
    cfg.compression.auto = "off"
    if policy == "keep":
        return cfg
    if policy == "auto":
        cfg.compression.policy = "baseline"
        for entry, codec in auto_entries(cfg, n_devices).items():
            axis, _, kind = entry.partition(".")
            cfg.compression[axis][kind] = codec
    else:
        cfg.compression.policy = policy
    return cfg


def step_program(cfg, devices):
    """(jitted train step, abstract state, abstract batch, mesh, RunSpec) of
    `cfg` on `devices` (compile-only ones): the trainer's step, abstract shapes."""
    from jcomp.gpt import mesh as mesh_lib
    from jcomp.gpt import sharding, step
    from jcomp.train.state import resume
    from jcomp.train.settings import runspec

    run = runspec.validate(cfg, len(devices))
    mesh = mesh_lib.make_mesh(run.mesh_shape, devices, dcn_data=run.mesh_split())
    tx = run.optim.tx(run.train.steps)
    shapes = jax.eval_shape(resume.init_params(run))
    state = step.abstract_state(shapes, mesh, tx, run.zero)
    rows = NamedSharding(mesh, sharding.batch_spec(sharding.data_axes(mesh)))
    batch = jax.ShapeDtypeStruct((run.train.batch_size, run.data.seq_len + 1), jnp.int32,
                                 sharding=rows)
    fn = step.make_train_step(run.model, mesh, run.plan(run.policy), tx, shapes,
                              **run.step_options())
    return fn, state, batch, mesh, run


# ---------------------------------------------------------------- reading HLO

def _kernel(instr, names, comps) -> dict | None:
    """A launched instruction's kind and bytes, or None for one that launches nothing."""
    op = instr.opcode
    if op in aot._FREE or op in aot._CONTROL:
        return None
    base = op.removesuffix("-start")
    collective = base in aot._COLLECTIVES or op == "async-start"
    target = re.search(r'custom_call_target="([^"]+)"', instr.attrs)
    gemm = (op == "fusion" and bool(_GEMM_FUSIONS.search(instr.attrs))) or (
        op == "custom-call" and target is not None and bool(_GEMM_TARGETS.search(target.group(1))))
    return dict(name=instr.name, opcode=op, collective=collective, gemm=bool(gemm),
                is_async=op.endswith("-start"), kind=base,
                io=aot._kernel_io(instr, names, comps), message=wire._message_of(instr.line))


def read_step(text: str) -> dict:
    """Kernels (with trip counts), bytes by message, and every collective with what
    is scheduled between its start and done, from an optimized (scheduled) module."""
    comps, entry = hlo.computations(text)
    kernels, collectives = [], []

    def visit(name: str, trips: int, where: str):
        if name not in comps:
            return
        names = {i.name: i for i in comps[name]}
        order = comps[name]
        launched = []
        for instr in order:
            if instr.opcode in aot._CONTROL:
                n = trips
                if instr.opcode == "while":
                    m = _TRIP.search(instr.attrs)
                    n = trips * (int(m.group(1)) if m else 1)
                for key in ("body", "to_apply", "branch_computations", "true_computation",
                            "false_computation"):
                    for c in aot._called(instr, key):
                        visit(c, n, c)
                launched.append(dict(name=instr.name, opcode=instr.opcode, collective=False,
                                     gemm=False, control=True))
                continue
            k = _kernel(instr, names, comps)
            if k is None:
                continue
            k.update(trips=trips, computation=where)
            kernels.append(k)
            launched.append(k)
        done_of = {}
        for pos, instr in enumerate(order):
            if instr.opcode.endswith("-done"):
                ops = hlo.operands(instr)
                if ops:
                    done_of[ops[0]] = instr.name
        position = {i.name: p for p, i in enumerate(order)}
        for k in launched:
            if not k.get("collective"):
                continue
            row = dict(kind=k["kind"], is_async=k["is_async"], message=k["message"],
                       computation=where, trips=trips, io=k["io"])
            if k["is_async"]:
                done = done_of.get(k["name"])
                if done is None:
                    row["overlap"] = None  # its done is in another computation
                else:
                    lo, hi = position[k["name"]], position[done]
                    between = [x for x in launched
                               if lo < position[x["name"]] < hi and x is not k]
                    row["overlap"] = dict(
                        kernels=sum(not x["collective"] and not x.get("control")
                                    for x in between),
                        gemms=sum(x["gemm"] for x in between),
                        collectives=sum(x["collective"] for x in between),
                        loops=sum(bool(x.get("control")) for x in between),
                        io=sum(x.get("io", 0) for x in between
                               if not x["collective"] and not x.get("control")))
            collectives.append(row)

    visit(entry, 1, "entry")
    total = sum(k["io"] * k["trips"] for k in kernels)
    by_msg: dict = {}
    for k in kernels:
        m = by_msg.setdefault(k["message"] or "", dict(collective_io=0, other_io=0,
                                                       kernels=0))
        m["collective_io" if k["collective"] else "other_io"] += k["io"] * k["trips"]
        m["kernels"] += k["trips"]
    return dict(kernel_io=total,
                kernels=sum(k["trips"] for k in kernels),
                gemm_io=sum(k["io"] * k["trips"] for k in kernels if k["gemm"]),
                collective_io=sum(k["io"] * k["trips"] for k in kernels if k["collective"]),
                by_message=by_msg, collectives=collectives,
                async_collectives=sum(c["trips"] for c in collectives if c["is_async"]),
                overlap=_overlap_summary(collectives),
                sync_collectives=sum(c["trips"] for c in collectives if not c["is_async"]),
                host_callback=aot.read_program(text)["host_callback"])


def _overlap_summary(collectives) -> dict:
    """Async collectives launched per step (loop trips counted) by what runs while
    each is in flight: a gemm, other kernels only, or nothing (start, then done)."""
    out = dict(with_gemm=0, with_kernels_only=0, with_nothing=0, done_elsewhere=0)
    for c in collectives:
        if not c["is_async"]:
            continue
        o = c["overlap"]
        key = ("done_elsewhere" if o is None else "with_gemm" if o["gemms"]
               else "with_kernels_only" if o["kernels"] or o["loops"] else "with_nothing")
        out[key] += c["trips"]
    return out


def measure(cfg, devices, hlo_path: str | None = None, options: dict | None = None) -> dict:
    t0 = time.perf_counter()
    fn, state, batch, mesh, run = step_program(cfg, devices)
    compiled = fn.trace(state, batch).lower().compile(dict(options or {}))
    compile_s = time.perf_counter() - t0
    text = compiled.as_text()
    if hlo_path:
        os.makedirs(os.path.dirname(os.path.abspath(hlo_path)), exist_ok=True)
        with open(hlo_path, "w") as f:
            f.write(text)
    row = read_step(text)
    report = wire.from_text(text, mesh)
    row.update(compile_s=compile_s, wire_bytes=report.total(),
               wire_by_message=report.by_message(), wire_by_axis=report.by_mesh_axis(),
               policy={f"{a}.{k}": str(run.policy[a, k])
                       for a, k in _entries(run) if str(run.policy[a, k]) != "none"},
               mesh=run.mesh_sizes(), layers=run.model.n_layers,
               compiler_options=dict(options or {}))
    return row


def _entries(run):
    from jcomp.gpt import policy as policy_lib
    return policy_lib.MESSAGES


def compare(rows: dict) -> None:
    """Adds to each coded row its codec's HBM bytes per message against the
    baseline's row (`codec_io`) and the wire bytes it saves."""
    base = rows["baseline"]
    for name, row in rows.items():
        if name == "baseline":
            continue
        per = {}
        for msg, m in row["by_message"].items():
            if not msg:
                continue
            b = base["by_message"].get(msg, dict(other_io=0, collective_io=0))
            per[msg] = dict(codec_io=m["other_io"] - b["other_io"],
                            collective_io_saved=b["collective_io"] - m["collective_io"],
                            wire_saved=base["wire_by_message"].get(msg, 0.0)
                            - row["wire_by_message"].get(msg, 0.0))
        row["codec"] = per
        row["codec_io"] = sum(p["codec_io"] for p in per.values())
        row["wire_saved"] = base["wire_bytes"] - row["wire_bytes"]
        row["kernel_io_vs_baseline"] = row["kernel_io"] / base["kernel_io"]


def scale_layers(rows: dict, measured: int, target: int, other: dict) -> None:
    """Per-step byte figures at `target` layers from `measured` layers and a run at
    `other`'s layer count: linear in layers (what one layer adds, times the
    layers), the fixed part (embedding, head, optimizer of those) kept."""
    for name, row in rows.items():
        o = other[name]
        dl = row["layers"] - o["layers"]
        for key in ("kernel_io", "collective_io", "wire_bytes", "codec_io", "wire_saved"):
            if key in row and key in o:
                per = (row[key] - o[key]) / dl
                row[f"{key}_at_{target}"] = row[key] + per * (target - row["layers"])
        row["scaled_from_layers"] = [o["layers"], row["layers"]]


# ---------------------------------------------------------------- runs

def run_base(devices, hlo_dir=None) -> dict:
    cfg = config("configs/base.py")
    cfg.mesh.update(data=2, tensor=2, pipeline=2)
    out = {}
    for pol in POLICIES:
        out[pol] = measure(with_policy(cfg, pol, len(devices)), devices,
                           hlo_dir and os.path.join(hlo_dir, f"base_{pol}.hlo"))
        _print("base", pol, out[pol])
    compare(out)
    return out


def neox_cfg(layers: int, policy: str, n_devices: int):
    cfg = config("configs/neox20b.py")
    if policy == "auto":
        # What auto picks for the run itself (192 GPUs, data 12), not for the
        # 32 compiled here: the codecs the real run would send.
        cfg = with_policy(cfg, "auto", 192)
        policy = "keep"
    # The paper's run on 192 GPUs: data 12, so 1536 / 12 = 128 sequences per
    # data rank; on data 2 the same per-device batch is 256.
    per_rank = cfg.train.batch_size // 12
    cfg.mesh.update(data=2, tensor=4, pipeline=4)
    cfg.train.batch_size = 2 * per_rank
    cfg.model.n_layers = layers
    return with_policy(cfg, policy, n_devices)


def run_neox(devices, layers: int, hlo_dir=None) -> dict:
    out, small = {}, {}
    for pol in POLICIES:
        for n, into in ((layers, out), (layers // 2, small)):
            if n < 4 or n % 4:
                continue
            into[pol] = measure(neox_cfg(n, pol, len(devices)), devices,
                                hlo_dir and os.path.join(hlo_dir, f"neox20b_{pol}_{n}l.hlo"),
                                NEOX_OPTIONS)
            _print(f"neox20b {n} layers", pol, into[pol])
    compare(out)
    if small:
        compare(small)
        scale_layers(out, layers, 44, small)
    return out


def _print(run: str, pol: str, r: dict):
    codec = f", codec I/O {r['codec_io'] / 2**20:.1f} MiB, wire saved " \
            f"{r['wire_saved'] / 2**20:.1f} MiB" if "codec_io" in r else ""
    print(f"{run} {pol}: {r['kernels']} kernels, kernel I/O {r['kernel_io'] / 2**30:.3f} GiB, "
          f"collectives {r['async_collectives']} async / {r['sync_collectives']} sync, "
          f"wire {r['wire_bytes'] / 2**20:.1f} MiB{codec} (compile {r['compile_s']:.0f} s)",
          flush=True)


def table(out: dict) -> str:
    """The docs table of an aot_step JSON: per run and policy, GiB per step per device."""
    g = 2**30
    head = ("run", "policy", "kernel I/O", "codec I/O", "x step", "wire", "wire saved",
            "codec I/O / wire saved", "async (sync)", "overlap gemm / other / nothing")
    rows = [head]
    for name, runs in out["runs"].items():
        for pol, r in runs.items():
            at = "_at_44" if "kernel_io_at_44" in r else ""
            kio, wire_b = r[f"kernel_io{at}"], r[f"wire_bytes{at}"]
            cio, saved = r.get(f"codec_io{at}"), r.get(f"wire_saved{at}")
            o = r["overlap"]
            label = name + (" (44 layers, from {} and {})".format(*r["scaled_from_layers"])
                            if at else "")
            rows.append((label, pol,
                         f"{kio / g:.4g}", "-" if cio is None else f"{cio / g:.4g}",
                         "-" if cio is None else f"{cio / kio:.1%}", f"{wire_b / g:.4g}",
                         "-" if saved is None else f"{saved / g:.4g}",
                         "-" if not saved else f"{cio / saved:.2f}",
                         f"{r['async_collectives']} ({r['sync_collectives']})",
                         f"{o['with_gemm']} / {o['with_kernels_only']} / {o['with_nothing']}"))
    return "\n".join("| " + " | ".join(r) + " |" + ("\n|" + "---|" * len(head) if i == 0 else "")
                     for i, r in enumerate(rows))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", nargs="+", default=list(RUNS), choices=RUNS)
    p.add_argument("--neox-layers", type=int, default=NEOX_LAYERS)
    p.add_argument("--json", default=os.path.join("benchmarks", "results", "aot_step_h100.json"))
    p.add_argument("--hlo-dir", help="also write each optimized HLO module here")
    p.add_argument("--table", metavar="JSON", help="print the docs table of a written JSON")
    args = p.parse_args(argv)
    if args.table:
        with open(args.table) as f:
            print(table(json.load(f)))
        return 0
    try:
        if args.neox_layers < 4 or args.neox_layers % 4:
            raise ValueError(f"--neox-layers={args.neox_layers}: a multiple of 4 "
                             "(one or more layers per pipeline stage)")
        devices = aot.topology(8)
        big = aot.topology(32) if "neox20b" in args.runs else None
    except (ValueError, aot.PluginMissing) as e:
        print(f"aot_step.py: error: {e}", file=sys.stderr)
        return 2
    out = dict(command="JAX_PLATFORMS=cpu python -m benchmarks.aot_step "
               + " ".join(sys.argv[1:] if argv is None else argv),
               date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               commit=aot._git_head(), jax_version=jax.__version__,
               target=devices[0].device_kind, runs={})
    if "base" in args.runs:
        out["runs"]["base"] = run_base(devices, args.hlo_dir)
    if "neox20b" in args.runs:
        out["runs"]["neox20b"] = run_neox(big, args.neox_layers, args.hlo_dir)
    aot.write_json(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
