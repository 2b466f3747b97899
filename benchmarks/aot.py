"""jcomp's coded collectives compiled for 8 H100s without a GPU: what XLA's GPU
compiler makes of each codec, read from the optimized HLO.

    pip install -e '.[aot]'
    JAX_PLATFORMS=cpu python -m benchmarks.aot [--sizes-mib 1 16 64]
        [--codecs none int8 ...] [--ops psum psum_scatter all_gather ppermute]
        [--devices 8] [--spec FILE]
        [--json benchmarks/results/aot_h100.json] [--hlo-dir DIR]

The `aot` extra installs the CUDA plugin at jax's own version; its
compile-only topology (`jax.experimental.topologies.get_topology_desc`) gives
8 H100 devices described by `benchmarks.h100` (or a GpuTargetConfigProto text
file given with --spec), and `jit(...).trace(x)
.lower().compile()` runs XLA's GPU pipeline on abstract shapes: nothing is
allocated or run. Under JAX_PLATFORMS=cpu the plugin skips its check for a
CUDA driver (this module sets it when unset).

Per op x codec x size (float32 elements per device, on a 1-D mesh of
--devices), one `shard_map` over all devices, the `cc.*` op with that codec
(`none`: the op sends raw, as `jax.lax` does), and from its compiled HLO:

  fusions       fusion instructions that run (XLA's Triton gemms included);
  custom_calls  custom-call targets (a Pallas kernel is one);
  kernel_io     the sum over every instruction that runs on the device (a
                fusion, custom call, copy, collective) of its operand and
                result bytes; an async collective counts once, at its start;
                a fusion whose parameter only feeds slices reads the slices.
                Per operand byte (x's bytes on one device): near what the
                program moves through HBM, from the HLO alone;
  flops         XLA's HloCostAnalysis of the H100 module (through the CPU
                client: the compiled object itself has no cost analysis);
  async         collective start/done pairs, and collectives left synchronous;
  host_callback whether any instruction calls back into Python or the host.
"""
from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from benchmarks import h100  # noqa: E402
from jcomp import codecs  # noqa: E402
from jcomp import collectives as cc  # noqa: E402
from jcomp.meter import hlo  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
AXIS = "x"
OPS = ("psum", "psum_scatter", "all_gather", "ppermute")
CODECS = ("none", "bf16", "fp8", "int8", "int4", "int4:rot", "mxfp8", "mxfp4", "mxfp4:rot",
          "nvfp4", "nvfp4:rot")
SIZES_MIB = (1.0, 16.0, 64.0)
PLUGIN_HINT = "pip install -e '.[aot]'"

# Instructions that launch nothing: views, tuples, constants, and the waits of
# async pairs (the start carries the work).
_FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all",
         "partition-id", "replica-id", "opt-barrier", "add-dependency", "copy-done",
         "all-reduce-done", "all-gather-done", "collective-permute-done", "async-done",
         "async-update", "send-done", "recv-done", "all-to-all-done", "reduce-scatter-done",
         "domain"}
_CONTROL = {"while", "conditional", "call"}
_COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all",
                "collective-permute", "collective-broadcast", "ragged-all-to-all")
_SLICES = {"slice", "dynamic-slice"}
_VIEWS = {"bitcast", "reshape"}
_HOST_TARGETS = re.compile(r"callback|host|python", re.I)


class PluginMissing(RuntimeError):
    """The CUDA plugin (and so the compile-only H100 topology) is not installed."""


def spec_text(path: str | None = None) -> str:
    """The target description: benchmarks.h100's, or the text file at `path`."""
    if path is None:
        return h100.target_config()
    with open(path) as f:
        return f.read()


def topology(n_devices: int = 8, spec: str | None = None):
    """`n_devices` compile-only GPUs of one host, described by the target spec."""
    from jax.experimental import topologies

    try:
        topo = topologies.get_topology_desc(platform="cuda", topology=f"1x1x{n_devices}",
                                            target_config=spec_text() if spec is None else spec)
    except NotImplementedError as e:
        raise PluginMissing(f"no compile-only CUDA topology ({e}); {PLUGIN_HINT} and run "
                            f"under JAX_PLATFORMS=cpu") from e
    return list(topo.devices)


def plugin_installed() -> bool:
    try:
        import jax_plugins.xla_cuda12  # noqa: F401
    except ImportError:
        return False
    return True


# ---------------------------------------------------------------- programs

def op_program(op: str, codec: str, n: int):
    """(function over the global (n, elements) array, out_specs) of `op` on one row
    per device, with `codec` (or raw, `none`)."""
    needs_key = codec != "none" and codecs.parse(codec).needs_key

    def body(x_1xS):
        x_S = x_1xS[0]
        kw = dict(codec=codec, key=jax.random.key(0) if needs_key else None)
        if op == "psum":
            y = cc.psum(x_S, AXIS, **kw)
        elif op == "psum_scatter":
            y = cc.psum_scatter(x_S, AXIS, tiled=True, **kw)
        elif op == "all_gather":
            y = cc.all_gather(x_S, AXIS, tiled=True, **kw)
        elif op == "ppermute":
            y = cc.ppermute(x_S, AXIS, [(i, (i + 1) % n) for i in range(n)], **kw)
        else:
            raise ValueError(f"unknown op {op!r}; one of {OPS}")
        return y[None]

    return body, (P() if op == "psum" else P(AXIS))


def compile_op(op: str, codec: str, elements: int, devices):
    """The compiled program of `op` x `codec` on `elements` float32 per device."""
    n = len(devices)
    mesh = jax.sharding.Mesh(np.array(devices), (AXIS,), axis_types=(jax.sharding.AxisType.Explicit,))
    body, out_spec = op_program(op, codec, n)
    f = jax.shard_map(body, mesh=mesh, in_specs=P(AXIS), out_specs=out_spec)
    x = jax.ShapeDtypeStruct((n, elements), jnp.float32, sharding=NamedSharding(mesh, P(AXIS)))
    return jax.jit(f).trace(x).lower().compile()


def cost_analysis(compiled) -> dict:
    """XLA's HloCostAnalysis of the compiled (GPU) module, run by the CPU client."""
    from jax._src.lib import _jax

    module = compiled.runtime_executable().hlo_modules()[0]
    return dict(_jax.hlo_module_cost_analysis(jax.devices("cpu")[0].client, module))


# ---------------------------------------------------------------- reading HLO

def shape_bytes(shape) -> int:
    total = 0
    for dtype, dims, bits in hlo.leaves(shape):
        total += -(-math.prod(dims) * (bits or hlo.DTYPE_BITS[dtype]) // 8)
    return total


def _called(instr, key: str) -> list[str]:
    m = re.search(rf"\b{key}=(\{{[^}}]*\}}|%?[\w.\-]+)", instr.attrs)
    return re.findall(r"%?([\w.\-]+)", m.group(1)) if m else []


def _param_reads(comp: list, number: int, full: int) -> int:
    """Bytes a fused computation reads of parameter `number`: the whole
    parameter, or only the slices it feeds when slices are its only users
    (through bitcasts and reshapes)."""
    by_name = {i.name: i for i in comp}
    users: dict[str, list] = {}
    for i in comp:
        for o in hlo.operands(i):
            users.setdefault(o, []).append(i)
    param = next((i for i in comp if i.opcode == "parameter"
                  and re.match(rf"\s*{number}\)", i.attrs)), None)
    if param is None:
        return full
    read, frontier = 0, [param.name]
    while frontier:
        name = frontier.pop()
        for u in users.get(name, []):
            if u.opcode in _SLICES and hlo.operands(u)[0] == name:
                read += shape_bytes(u.shape)
            elif u.opcode in _VIEWS:
                frontier.append(u.name)
            else:
                return full
    del by_name
    return min(read, full) if read else full


def _kernel_io(instr, names: dict, comps: dict) -> int:
    ops = hlo.operands(instr)
    callee = _called(instr, "calls")
    fused = comps.get(callee[0]) if instr.opcode == "fusion" and callee else None
    io = shape_bytes(instr.shape)
    if instr.opcode.endswith("-start"):
        # An async start's result tuple repeats its operand; what it writes is its
        # last leaf (the gathered or received buffer).
        io = shape_bytes(instr.shape[-1]) if isinstance(instr.shape, list) else io
    for k, name in enumerate(ops):
        src = names.get(name)
        if src is None:
            continue
        full = shape_bytes(src.shape)
        io += _param_reads(fused, k, full) if fused is not None else full
    return io


def read_program(text: str) -> dict:
    """What runs in an optimized GPU HLO module: kernels, their bytes, collectives."""
    comps, entry = hlo.computations(text)
    kernels, custom_calls, starts, sync, host = [], [], [], [], []
    seen = set()

    def visit(name: str):
        if name in seen or name not in comps:
            return
        seen.add(name)
        names = {i.name: i for i in comps[name]}
        for instr in comps[name]:
            op = instr.opcode
            if op in _CONTROL:
                for key in ("body", "condition", "to_apply", "branch_computations",
                            "true_computation", "false_computation"):
                    for c in _called(instr, key):
                        visit(c)
                continue
            if op in _FREE:
                continue
            if op == "custom-call":
                target = re.search(r'custom_call_target="([^"]+)"', instr.attrs)
                custom_calls.append(target.group(1) if target else "?")
                if target and _HOST_TARGETS.search(target.group(1)):
                    host.append(target.group(1))
            if op in ("send", "recv", "outfeed", "infeed") or "is_host_transfer=true" in instr.attrs:
                host.append(op)
            base = op.removesuffix("-start")
            if base in _COLLECTIVES or op == "async-start":
                (starts if op.endswith("-start") else sync).append(base)
            kind = None
            if op == "fusion":
                kind = "triton_gemm" if "__triton_gemm" in instr.attrs else \
                    (re.search(r"kind=(\w+)", instr.attrs) or [None, "?"])[1]
            kernels.append(dict(name=instr.name, opcode=op, kind=kind,
                                io=_kernel_io(instr, names, comps)))

    visit(entry)
    fusions = [k for k in kernels if k["opcode"] == "fusion"]
    return dict(kernels=len(kernels), fusions=len(fusions),
                triton_gemms=sum(k["kind"] == "triton_gemm" for k in fusions),
                custom_calls=custom_calls, async_collectives=sorted(starts),
                sync_collectives=sorted(sync), host_callback=bool(host), host_calls=host,
                kernel_io_bytes=sum(k["io"] for k in kernels),
                kernel_list=[(k["name"], k["opcode"], k["kind"], k["io"]) for k in kernels])


def measure(op: str, codec: str, elements: int, devices, hlo_dir: str | None = None) -> dict:
    t0 = time.perf_counter()
    compiled = compile_op(op, codec, elements, devices)
    compile_s = time.perf_counter() - t0
    text = compiled.as_text()
    if hlo_dir:
        os.makedirs(hlo_dir, exist_ok=True)
        with open(os.path.join(hlo_dir, f"{op}_{codec.replace(':', '-')}_{elements}.hlo"), "w") as f:
            f.write(text)
    row = read_program(text)
    costs = cost_analysis(compiled)
    operand = 4 * elements
    row.update(op=op, codec=codec, elements=elements, mib=operand / 2**20, devices=len(devices),
               kernel_io_per_operand_byte=row["kernel_io_bytes"] / operand,
               flops=costs.get("flops", 0.0),
               flops_per_element=costs.get("flops", 0.0) / elements,
               cost_bytes_accessed=costs.get("bytes accessed", 0.0),
               compile_s=compile_s)
    return row


def _git_head() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes-mib", type=float, nargs="+", default=list(SIZES_MIB))
    p.add_argument("--codecs", nargs="+", default=list(CODECS))
    p.add_argument("--ops", nargs="+", default=list(OPS))
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--spec", default=None,
                   help="a GpuTargetConfigProto text file (default: benchmarks.h100's H100)")
    p.add_argument("--json", default=os.path.join("benchmarks", "results", "aot_h100.json"))
    p.add_argument("--hlo-dir", help="also write each optimized HLO module here")
    p.add_argument("--kernels", action="store_true", help="keep each program's kernel list")
    args = p.parse_args(argv)
    try:
        for c in args.codecs:
            if c != "none":
                codecs.parse(c)
        bad = [o for o in args.ops if o not in OPS]
        if bad:
            raise ValueError(f"--ops: unknown {bad}; one of {list(OPS)}")
        devices = topology(args.devices, spec_text(args.spec))
    except (ValueError, PluginMissing, OSError) as e:
        print(f"aot.py: error: {e}", file=sys.stderr)
        return 2
    out = dict(command="JAX_PLATFORMS=cpu python -m benchmarks.aot "
               + " ".join(sys.argv[1:] if argv is None else argv),
               date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               commit=_git_head(), jax_version=jax.__version__,
               target=devices[0].device_kind, devices=len(devices),
               spec="benchmarks.h100" if args.spec is None else args.spec, rows=[])
    for mib in args.sizes_mib:
        elements = max(int(mib * 2**20) // 4 // 256 * 256, 256)
        for op in args.ops:
            for codec in args.codecs:
                row = measure(op, codec, elements, devices, args.hlo_dir)
                if not args.kernels:
                    row.pop("kernel_list")
                out["rows"].append(row)
                print(f"{mib:>6g} MiB {op:>12} {codec:>10}: {row['fusions']:3d} fusions, "
                      f"{len(row['custom_calls'])} custom calls, kernel I/O "
                      f"{row['kernel_io_per_operand_byte']:6.2f} B/B, "
                      f"{row['flops_per_element']:7.1f} flop/elt, "
                      f"async {len(row['async_collectives'])} sync {len(row['sync_collectives'])}"
                      f"{', HOST CALLBACK' if row['host_callback'] else ''}", flush=True)
    write_json(args.json, out)
    return 0


def write_json(path: str, out: dict) -> None:
    """A benchmark's results as JSON at `path` (no NaN or Inf), its folder made."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(out, f, indent=1, allow_nan=False)
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
