"""Writes the codec costs of a planning profile from the H100 compile of a
64 MiB psum over 8 (jcomp.tune.compiled: kernel I/O over HBM bandwidth at a
stated efficiency, plus kernels times a launch cost).

    JAX_PLATFORMS=cpu python -m benchmarks.aot --sizes-mib 64 --ops psum --kernels \\
        --json benchmarks/results/aot_h100_psum64.json
    python -m benchmarks.aot_profile [--aot benchmarks/results/aot_h100_psum64.json]
        [--profile configs/profiles/h100_8x_nvlink_400g.json]
        [--efficiency 0.5] [--launch-s 3e-6] [--hbm-bytes-per-s 3.35e12]

The profile's links and device are kept; its codecs are replaced by every
coded psum the compile holds, and its comment's sentence on codec costs says
where they come from. Needs no GPU and no plugin: it reads the JSON only.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from jcomp import tune
from jcomp.tune import compiled

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
AOT = os.path.join("benchmarks", "results", "aot_h100_psum64.json")
PROFILE = os.path.join("configs", "profiles", "h100_8x_nvlink_400g.json")
MARK = "Codec costs "


def codec_sentence(aot: dict, eff: float, launch_s: float, hbm: float, path: str) -> str:
    return (f"{MARK}are from the H100 compile of a 64 MiB float32 psum over 8 ({path}, "
            f"commit {aot.get('commit')}; regenerate with python -m benchmarks.aot_profile): "
            f"the kernel I/O and kernels the coded psum launches beyond plain psum's, "
            f"at {eff:g} of HBM3's {hbm / 1e12:.3g} TB/s and {launch_s * 1e6:g} us per "
            f"kernel (jcomp.tune.compiled: the constants' sources), split evenly between "
            f"encoding and decoding over the (3n+1)/n bytes per operand byte an all-reduce "
            f"codes. Not measured on a GPU.")


def regenerate(aot_path: str, profile_path: str, **constants) -> tune.Profile:
    with open(aot_path) as f:
        aot = json.load(f)
    costs = compiled.codec_costs(aot["rows"], **constants)
    prof = tune.load(profile_path)
    comment = prof.comment
    sentence = codec_sentence(aot, constants["efficiency"], constants["launch_s"],
                              constants["hbm_bytes_per_s"], aot_path)
    if MARK in comment:
        head, _, tail = comment.partition(MARK)
        # The old sentence on codec costs runs to the next "Replace" sentence.
        rest = tail[tail.find("Replace"):] if "Replace" in tail else ""
        comment = f"{head}{sentence} {rest}".strip()
    else:
        comment = f"{comment} {sentence}".strip()
    return tune.Profile(links=prof.links, codecs=costs, device=prof.device, comment=comment)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--aot", default=AOT)
    p.add_argument("--profile", default=PROFILE)
    p.add_argument("--efficiency", type=float, default=compiled.EFFICIENCY)
    p.add_argument("--launch-s", type=float, default=compiled.LAUNCH_S)
    p.add_argument("--hbm-bytes-per-s", type=float, default=compiled.HBM_BYTES_PER_S)
    args = p.parse_args(argv)
    try:
        prof = regenerate(args.aot, args.profile, efficiency=args.efficiency,
                          launch_s=args.launch_s, hbm_bytes_per_s=args.hbm_bytes_per_s)
    except (ValueError, TypeError, OSError, KeyError) as e:
        print(f"aot_profile.py: error: {e}", file=sys.stderr)
        return 2
    tune.save(prof, args.profile)
    for name, cost in prof.codecs.items():
        print(f"{name:>10}: {cost.encode_s_per_byte:.3e} s/B each way ({cost.comment})")
    print(f"wrote {args.profile}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
