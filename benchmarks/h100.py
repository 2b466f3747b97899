"""An H100 SXM5 80 GB described for XLA's GPU compiler: the GpuTargetConfigProto
text that `jax.experimental.topologies.get_topology_desc(platform="cuda",
target_config=...)` takes to compile for GPUs that are not attached.

Written from NVIDIA's published figures for the part. The fields are the
device facts XLA's GPU pipeline reads to fuse, tile and schedule; the
optimized HLO of benchmarks.aot's collectives and of a bf16 matmul compiled
with this description was checked identical to the one from XLA's own H100
target spec (jax-cuda12-plugin 0.10.2).
"""
from __future__ import annotations

# compute capability 9.0 (sm_90a); 132 SMs of 128 FP32 units; 1.98 GHz boost;
# 50 MiB L2; 80 GB HBM3 (84,942,979,072 B usable) at 3.35 TB/s; 228 KiB of
# shared memory per SM, of which one block may opt in to 227 KiB (48 KiB by
# default); 64 Ki 32-bit registers per SM and per block; 2,048 resident
# threads per SM, 1,024 per block, warps of 32; grid limits as CUDA's.
H100_SXM = dict(
    threads_per_block_limit=1024, threads_per_warp=32, shared_memory_per_block=48 * 1024,
    shared_memory_per_core=228 * 1024, threads_per_core_limit=2048, core_count=132,
    fpus_per_core=128, block_dim_limit_x=2 ** 31 - 1, block_dim_limit_y=65535,
    block_dim_limit_z=65535, memory_bandwidth=3_352_320_000_000, l2_cache_size=50 * 2 ** 20,
    clock_rate_ghz=1.98, device_memory_size=84_942_979_072,
    shared_memory_per_block_optin=227 * 1024, registers_per_core_limit=65536,
    registers_per_block_limit=65536)
NAME = "NVIDIA H100 80GB HBM3"
COMPUTE_CAPABILITY = (9, 0)
CUDNN = (9, 1, 0)


def target_config(device: dict = H100_SXM, name: str = NAME,
                  capability: tuple = COMPUTE_CAPABILITY, cudnn: tuple = CUDNN) -> str:
    """The GpuTargetConfigProto text of one GPU."""
    fields = "".join(f"  {k}: {v}\n" for k, v in device.items())
    major, minor = capability
    return (f"gpu_device_info {{\n{fields}"
            f"  cuda_compute_capability {{\n    major: {major}\n    minor: {minor}\n"
            "    feature_extension: ACCELERATED_FEATURES\n  }\n}\n"
            'platform_name: "CUDA"\n'
            f"dnn_version_info {{\n  major: {cudnn[0]}\n  minor: {cudnn[1]}\n"
            f"  patch: {cudnn[2]}\n}}\n"
            f'device_description_str: "{name}"\n')
