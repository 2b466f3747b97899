"""Codec costs from a compiled GPU program: a codec's device time read off the
kernels XLA made of a coded all-reduce, instead of measured on a device.

    rows = json.load(open("benchmarks/results/aot_h100_psum64.json"))["rows"]
    costs = codec_costs(rows)                 # {"int8": CodecCost(...), ...}

For a coded psum of B operand bytes per device over n devices, and the plain
psum of the same B beside it (benchmarks.aot's rows, kept with --kernels: each
launched kernel's bytes read plus written), the codec's time is

    t = max(io_c - io_p, 0) / (hbm_bytes_per_s * efficiency)
        + max(k_c - k_p, 0) * launch_s

where io is the kernel I/O of the kernels that are not collectives (the link's
time is priced apart, by the profile's Link) and k their count: what the coded
program launches and moves through HBM beyond what the plain one does. The
codec codes (n + 1) / n x B encoding and 2 B decoding in that all-reduce
(Traffic.codec_work), so encoding and decoding each cost t / ((3n + 1) / n x B)
per uncompressed byte: tune.predict then gives back t for that psum, and
scales it by bytes for every other message.

The constants' sources:
  HBM_BYTES_PER_S  H100 SXM5's HBM3, 3.35 TB/s (NVIDIA's H100 datasheet; the
                   same figure as benchmarks/h100.py's target description).
  EFFICIENCY       0.5 of that peak. A hand-written blockwise FP8 quantizer
                   (torchao) reaches 85-94% of achievable HBM bandwidth on H100;
                   an XLA-emitted block quantizer measured about 1 TB/s of
                   GB200's ~8 TB/s (about 12%, marin-community/marin #7282).
                   jcomp's codecs are XLA fusions and, for the rotated ones,
                   Triton kernels: between the two, and unmeasured on a GPU.
  LAUNCH_S         3 us per kernel: a kernel's launch and the gap before the
                   next on one stream, of the order NVIDIA reports for small
                   kernels launched from a stream (2-4 us; "Getting Started with
                   CUDA Graphs", NVIDIA developer blog, 2019).
Replace them with what benchmarks/gpu.py measures on the machine.
"""
from __future__ import annotations

import math
from typing import Mapping

from jcomp.tune.profile import CodecCost, codec_name

HBM_BYTES_PER_S = 3.35e12
EFFICIENCY = 0.5
LAUNCH_S = 3e-6


def _positive(value, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{where} must be a number; got {value!r}")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{where} must be a finite number > 0; got {value!r}")
    return float(value)


def program_costs(row: Mapping, where: str = "row") -> tuple[float, int]:
    """(kernel I/O bytes, kernels) of a compiled program's launched kernels that are
    not collectives, from a benchmarks.aot row kept with --kernels."""
    if not isinstance(row, Mapping):
        raise TypeError(f"{where} must be a mapping (a benchmarks.aot row); got {row!r}")
    kernels = row.get("kernel_list")
    if kernels is None:
        raise ValueError(f"{where} has no kernel_list: write the rows with "
                         "`python -m benchmarks.aot --kernels`")
    io, count = 0, 0
    for k in kernels:
        opcode, nbytes = k[1], k[3]
        if opcode.endswith("-start") or opcode in ("all-reduce", "all-gather", "all-to-all",
                                                   "reduce-scatter", "collective-permute"):
            continue
        io += nbytes
        count += 1
    return float(io), count


def codec_cost(coded: Mapping, plain: Mapping, *, hbm_bytes_per_s: float = HBM_BYTES_PER_S,
               efficiency: float = EFFICIENCY, launch_s: float = LAUNCH_S) -> CodecCost:
    """The CodecCost of `coded`'s codec from its psum row and the plain psum's
    (`plain`, codec "none", the same elements and devices): module doc."""
    hbm = _positive(hbm_bytes_per_s, "hbm_bytes_per_s")
    eff = _positive(efficiency, "efficiency")
    if eff > 1:
        raise ValueError(f"efficiency must be in (0, 1] (a share of peak); got {efficiency!r}")
    if isinstance(launch_s, bool) or not isinstance(launch_s, (int, float)) or not (
            math.isfinite(launch_s) and launch_s >= 0):
        raise ValueError(f"launch_s must be a finite number >= 0; got {launch_s!r}")
    for name, row in (("coded", coded), ("plain", plain)):
        if not isinstance(row, Mapping) or row.get("op") != "psum":
            raise ValueError(f"{name} must be a benchmarks.aot psum row; got op "
                             f"{row.get('op') if isinstance(row, Mapping) else row!r}")
    if plain.get("codec") != "none":
        raise ValueError(f"plain must be the row of codec 'none'; got {plain.get('codec')!r}")
    if (coded.get("elements"), coded.get("devices")) != (plain.get("elements"),
                                                        plain.get("devices")):
        raise ValueError("coded and plain must be psums of the same elements over the same "
                         f"devices; got {coded.get('elements')} x {coded.get('devices')} and "
                         f"{plain.get('elements')} x {plain.get('devices')}")
    io_c, k_c = program_costs(coded, "coded")
    io_p, k_p = program_costs(plain, "plain")
    n = int(coded["devices"])
    if n < 2:
        raise ValueError(f"coded: a psum over {n} device codes nothing; want >= 2 devices")
    operand = 4.0 * coded["elements"]  # float32
    seconds = max(io_c - io_p, 0.0) / (hbm * eff) + max(k_c - k_p, 0) * launch_s
    per_byte = seconds / ((3 * n + 1) / n * operand)
    comment = (f"compiled psum of {operand / 2**20:g} MiB over {n}: "
               f"{max(io_c - io_p, 0.0) / operand:.3g} B/B kernel I/O over plain at "
               f"{eff:g} x {hbm:.3g} B/s, {max(k_c - k_p, 0)} kernels x {launch_s:g} s")
    return CodecCost(encode_s_per_byte=per_byte, decode_s_per_byte=per_byte, comment=comment)


def codec_costs(rows, *, mib: float | None = None, **constants) -> dict:
    """{canonical codec: CodecCost} from benchmarks.aot rows: every coded psum that
    has the plain psum of its size beside it (only those of `mib` MiB, if given;
    else the largest size). `constants`: codec_cost's keywords."""
    if isinstance(rows, Mapping) or not hasattr(rows, "__iter__"):
        raise TypeError(f"rows must be a sequence of benchmarks.aot rows; got {rows!r}")
    psums = [r for r in rows if isinstance(r, Mapping) and r.get("op") == "psum"]
    if not psums:
        raise ValueError("rows holds no psum row (benchmarks.aot --ops psum)")
    sizes = sorted({r["elements"] for r in psums})
    if mib is None:
        elements = sizes[-1]
    else:
        elements = next((e for e in sizes if abs(4 * e / 2**20 - mib) < 1e-6 * max(mib, 1)),
                        None)
        if elements is None:
            raise ValueError(f"mib={mib!r}: no psum of that size; sizes: "
                             f"{[4 * e / 2**20 for e in sizes]} MiB")
    at = {r["codec"]: r for r in psums if r["elements"] == elements}
    if "none" not in at:
        raise ValueError("rows has no plain psum (codec 'none') of that size")
    return {codec_name(c, f"rows codec {c!r}"): codec_cost(r, at["none"], **constants)
            for c, r in at.items() if c != "none"}
