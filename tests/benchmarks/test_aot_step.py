"""benchmarks/aot_step.py: the train step's H100 program, compiled without a GPU.

The HLO reading runs everywhere; the compile needs the CUDA plugin (the `aot`
extra) and skips without it."""
import os
import subprocess
import sys

from benchmarks import aot_step
from tests.benchmarks.test_aot import NEEDS_PLUGIN, ROOT

# A loop of 3 trips whose body overlaps an all-reduce with a gemm; after it, an
# all-gather with nothing between its start and done.
HLO = """HloModule m, is_scheduled=true

%gemm_computation (p0: f32[64,64], p1: f32[64,64]) -> f32[64,64] {
  %p0 = f32[64,64]{1,0} parameter(0)
  %p1 = f32[64,64]{1,0} parameter(1)
  ROOT %dot = f32[64,64]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%body (t: (s32[], f32[64,64])) -> (s32[], f32[64,64]) {
  %t = (s32[], f32[64,64]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %x = f32[64,64]{1,0} get-tuple-element(%t), index=1
  %ars = f32[64,64]{1,0} all-reduce-start(%x), channel_id=1, replica_groups={{0,1}}, to_apply=%add, metadata={op_name="jit(f)/jcomp_msg(block_exit,block_entry_grad)/psum"}
  %g = f32[64,64]{1,0} fusion(%x, %x), kind=kCustom, calls=%gemm_computation, backend_config={"fusion_backend_config":{"kind":"__triton_nested_gemm_fusion"}}
  %ard = f32[64,64]{1,0} all-reduce-done(%ars)
  %c = f32[64,64]{1,0} copy(%ard), metadata={op_name="jit(f)/jcomp_msg(block_exit,block_entry_grad)/convert"}
  ROOT %out = (s32[], f32[64,64]{1,0}) tuple(%i, %c)
}

%cond (t.1: (s32[], f32[64,64])) -> pred[] {
  %t.1 = (s32[], f32[64,64]{1,0}) parameter(0)
  ROOT %p = pred[] constant(true)
}

ENTRY %main (x.1: f32[64,64]) -> f32[128,64] {
  %x.1 = f32[64,64]{1,0} parameter(0)
  %z = s32[] constant(0)
  %init = (s32[], f32[64,64]{1,0}) tuple(%z, %x.1)
  %w = (s32[], f32[64,64]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  %y = f32[64,64]{1,0} get-tuple-element(%w), index=1
  %ags = (f32[64,64]{1,0}, f32[128,64]{1,0}) all-gather-start(%y), channel_id=2, replica_groups={{0,1}}, dimensions={0}
  ROOT %agd = f32[128,64]{1,0} all-gather-done(%ags)
}
"""


def test_reads_trips_messages_and_what_each_async_collective_overlaps():
    r = aot_step.read_step(HLO)
    buf = 64 * 64 * 4
    # Per trip: the all-reduce (in + out), the gemm (2 in + out), the copy (in + out).
    assert r["kernels"] == 3 * 3 + 1
    assert r["kernel_io"] == 3 * (2 + 3 + 2) * buf + 3 * buf
    assert r["gemm_io"] == 3 * 3 * buf
    assert r["collective_io"] == 3 * 2 * buf + 3 * buf
    assert r["async_collectives"] == 4 and r["sync_collectives"] == 0
    assert r["overlap"] == dict(with_gemm=3, with_kernels_only=0, with_nothing=1,
                                done_elsewhere=0)
    msg = r["by_message"]["block_exit"]
    assert msg == dict(collective_io=3 * 2 * buf, other_io=3 * 2 * buf, kernels=6)
    ar, ag = r["collectives"]
    assert ar["kind"] == "all-reduce" and ar["trips"] == 3 and ar["message"] == "block_exit"
    assert ar["overlap"]["gemms"] == 1 and ar["overlap"]["io"] == 3 * buf
    assert ag["kind"] == "all-gather" and ag["overlap"]["kernels"] == 0


def test_compare_prices_each_message_against_the_baseline():
    base = dict(kernel_io=100, wire_bytes=50, wire_by_message={"m": 40.0},
                by_message={"m": dict(collective_io=30, other_io=10, kernels=2)})
    coded = dict(kernel_io=120, wire_bytes=20, wire_by_message={"m": 10.0},
                 by_message={"m": dict(collective_io=8, other_io=40, kernels=6)})
    rows = {"baseline": base, "hybrid": coded}
    aot_step.compare(rows)
    assert coded["codec"]["m"] == dict(codec_io=30, collective_io_saved=22, wire_saved=30.0)
    assert coded["codec_io"] == 30 and coded["wire_saved"] == 30
    assert coded["kernel_io_vs_baseline"] == 1.2


@NEEDS_PLUGIN
def test_tiny_step_compiles_for_8_h100s_and_every_collective_is_async(tmp_path):
    # A process of its own: the plugin registers only under JAX_PLATFORMS=cpu.
    code = (
        "from benchmarks import aot, aot_step; import json, sys\n"
        "devs = aot.topology(8)\n"
        "cfg = aot_step.config('configs/tiny.py')\n"
        "rows = {p: aot_step.measure(aot_step.with_policy(cfg, p, 8), devs)\n"
        "        for p in ('baseline', 'hybrid')}\n"
        "aot_step.compare(rows)\n"
        "json.dump({p: {k: r[k] for k in ('sync_collectives', 'async_collectives', 'codec_io',\n"
        "  'wire_saved', 'wire_bytes', 'host_callback', 'overlap') if k in r}\n"
        "  for p, r in rows.items()}, sys.stdout)\n")
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    import json
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    for r in rows.values():
        assert r["sync_collectives"] == 0 and r["async_collectives"] > 0
        assert not r["host_callback"]
    hybrid = rows["hybrid"]
    assert 0 < hybrid["wire_bytes"] < rows["baseline"]["wire_bytes"]
    assert hybrid["wire_saved"] > 0 and hybrid["codec_io"] > 0
