"""benchmarks/aot.py: the H100 program of a coded psum, compiled without a GPU.

The HLO reading runs everywhere; the compile needs the CUDA plugin (the `aot`
extra) and skips without it."""
import json
import os
import subprocess
import sys

import pytest

from benchmarks import aot

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

NEEDS_PLUGIN = pytest.mark.skipif(
    not aot.plugin_installed(),
    reason=f"the CUDA plugin's compile-only H100 topology is not installed: {aot.PLUGIN_HINT}")

# A fused slice of a parameter, an async all-gather, a Triton kernel, a copy.
HLO = """HloModule m, is_scheduled=true

%fused_slice (param_0: f32[8,1024]) -> f32[8,128] {
  %param_0 = f32[8,1024]{1,0} parameter(0)
  ROOT %slice.1 = f32[8,128]{1,0} slice(%param_0), slice={[0:8], [0:128]}
}

%fused_add (param_0.1: f32[8,1024], param_1: f32[8,1024]) -> f32[8,1024] {
  %param_0.1 = f32[8,1024]{1,0} parameter(0)
  %param_1 = f32[8,1024]{1,0} parameter(1)
  ROOT %add.2 = f32[8,1024]{1,0} add(%param_0.1, %param_1)
}

ENTRY %main (p: f32[8,1024]) -> f32[64,128] {
  %p = f32[8,1024]{1,0} parameter(0)
  %copy.1 = f32[8,1024]{1,0} copy(%p)
  %loop_slice_fusion = f32[8,128]{1,0} fusion(%copy.1), kind=kLoop, calls=%fused_slice
  %loop_add_fusion = f32[8,1024]{1,0} fusion(%copy.1, %p), kind=kLoop, calls=%fused_add
  %ags = (f32[8,128]{1,0}, f32[64,128]{1,0}) all-gather-start(%loop_slice_fusion), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}
  %agd = f32[64,128]{1,0} all-gather-done(%ags)
  %k = f32[64,128]{1,0} custom-call(%agd), custom_call_target="__gpu$xla.gpu.triton"
  ROOT %out = f32[64,128]{1,0} custom-call(%k), custom_call_target="xla_ffi_python_gpu_callback"
}
"""


def test_reads_kernels_bytes_and_collectives_from_hlo():
    r = aot.read_program(HLO)
    assert r["fusions"] == 2 and r["kernels"] == 6
    assert r["custom_calls"] == ["__gpu$xla.gpu.triton", "xla_ffi_python_gpu_callback"]
    assert r["async_collectives"] == ["all-gather"] and r["sync_collectives"] == []
    assert r["host_callback"]
    f32 = 4
    io = {name: b for name, _, _, b in r["kernel_list"]}
    assert io["copy.1"] == 2 * 8 * 1024 * f32
    assert io["loop_slice_fusion"] == 2 * 8 * 128 * f32  # reads only the slice
    assert io["loop_add_fusion"] == 3 * 8 * 1024 * f32
    assert io["ags"] == (8 + 64) * 128 * f32  # counted at its start only
    assert r["kernel_io_bytes"] == sum(io.values())


@NEEDS_PLUGIN
def test_coded_psum_compiles_for_8_h100s_without_a_gpu(tmp_path):
    # A process of its own: JAX reads JAX_PLATFORMS when it is imported, and
    # the plugin registers only under JAX_PLATFORMS=cpu on a machine without CUDA.
    out = tmp_path / "aot.json"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-m", "benchmarks.aot", "--sizes-mib", "1", "--ops",
                           "psum", "--codecs", "none", "int8", "int4:rot", "--json", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["devices"] == 8 and "H100" in res["target"]
    rows = {r["codec"]: r for r in res["rows"]}
    plain = rows.pop("none")
    assert plain["elements"] == 1 << 18  # 1 MiB of float32 per device
    assert plain["kernel_io_per_operand_byte"] == pytest.approx(4.0)
    for r in rows.values():
        assert not r["host_callback"], r["custom_calls"]
        assert r["sync_collectives"] == [] and len(r["async_collectives"]) == 2, r
        assert r["kernel_io_bytes"] <= 1.5 * plain["kernel_io_bytes"], r
    # The rotation runs inside the codec's two Triton kernels: no gemm re-read.
    rot = rows["int4:rot"]
    assert rot["kernel_io_per_operand_byte"] <= 6.0
    assert rot["custom_calls"] == ["__gpu$xla.gpu.triton"] * 2 and rot["triton_gemms"] == 0
