"""Projected step time of GPT-NeoX-20B on a GPU cluster with and without compression.

    python -m experiments.projection [--clusters lassen h100-ndr] [--gpus 192]
        [--measured experiments/results/convergence/summary.json]
        [--placement tensor=intra pipeline=inter data=inter] [--json PATH]
        [--network experiments/results/network.json] [--calibration-rate 100mbit]

With --network (read when the file exists), the model also meets a real link:
experiments/linkprofile.py calibrates a profile of experiments/network.py's
throttled loopback from that sweep's unthrottled rows and one throttled run,
predicts every other row, and prints predicted beside measured with their
ratio, for the additive model used below and for one that lets compute and
communication overlap; then each policy's crossover rate, measured and predicted.

The model (alpha-beta, no overlap of communication with compute):

  step time = compute + sum over messages of (collective time + codec time)

  compute     = hardware FLOPs per GPU / (peak FLOP/s * efficiency) * (M + P - 1) / M
                hardware FLOPs per step = (6 N + 12 L S d) * tokens, times 4/3 with
                activation recomputation (one more forward); N parameters, L layers,
                S sequence length, d model width. The last factor is GPipe's bubble
                with P pipeline stages and M microbatches.
  collective  = alpha * steps + wire bytes / beta, on an axis of n GPUs, with B the
                per-GPU buffer (the all-gather's output, the others' input):
                  all-reduce (ring)   2(n-1) steps, 2(n-1)/n * B bytes
                  reduce-scatter       (n-1) steps,  (n-1)/n * B bytes
                  all-gather           (n-1) steps,  (n-1)/n * B bytes
                  p2p (send/recv)          1 step,          B bytes
                alpha, beta: latency and per-GPU bandwidth of the link the axis uses.
                An axis placed "intra" stays inside a node (NVLink); "inter" crosses
                nodes, where the GPUs of a node share the node's NICs, so beta is the
                node's injection bandwidth / GPUs per node.
  codec       = uncompressed bytes coded / codec throughput, for each compressed
                message; an all-reduce codes twice (before the all-to-all and
                again before the all-gather of the sums).

Wire bytes per message for the 20B model: element counts come analytically from
configs/neox20b.py (below); bytes per element are 2 (its bf16) uncompressed, and
4 * r_axis compressed, where r_axis is the byte ratio policy / baseline that
jcomp.meter.wire measured on the compiled train step of the small model
(experiments/convergence.py's summary.json, float32 there, hence the 4). That
ratio already carries the codec's block scales and any message the policy
leaves uncompressed on that axis. Messages per training step, per GPU:

  data      gradient all-reduce (ZeRO stage 1; a reduce-scatter at stage 2) and
            the parameter all-gather, each of N / (tensor * pipeline) elements
  tensor    Megatron: per microbatch and layer of the stage, 2 all-reduces
            forward, 2 backward, 2 more forward under recomputation; plus 2 per
            microbatch for the vocab-parallel embedding and loss; each of
            (micro batch * S * d) elements
  pipeline  per microbatch one activation send forward and one gradient send
            backward, of (micro batch * S * d) elements

What the model leaves out: overlap of communication with compute (which would
shrink every gain), congestion, stragglers, the optimizer step's own time, and
compression error. The paper's TFLOPS and samples/s gains differ from each
other; here both come from one step time, so they are equal.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

AXES = ("data", "tensor", "pipeline")
POLICIES = ("baseline", "naive", "hybrid")
DEFAULT_MEASURED = os.path.join("experiments", "results", "convergence", "summary.json")
DEFAULT_JSON = os.path.join("experiments", "results", "projection.json")
DEFAULT_NETWORK = os.path.join("experiments", "results", "network.json")
# Xu et al., CCGrid 2024, GPT-NeoX-20B on 192 V100s of Lassen, gains over no compression.
PAPER = {"naive": {"tflops_gain_pct": 22.5, "samples_gain_pct": 23.6},
         "hybrid": {"tflops_gain_pct": 17.3, "samples_gain_pct": 12.7}}


@dataclasses.dataclass(frozen=True)
class Cluster:
    """Per-GPU figures; bandwidths in bytes/s per direction, latencies in seconds."""

    name: str
    gpus_per_node: int
    peak_flops: float
    efficiency: float      # achieved share of peak on the matmuls
    intra_bw: float        # GPU to GPU inside a node
    intra_latency: float
    inter_bw_node: float   # the node's network injection bandwidth, all NICs
    inter_latency: float
    codec_bw: float        # bytes of uncompressed input coded per second

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name != "name" and not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise ValueError(f"Cluster.{f.name} must be a finite number > 0; got {v!r}")
        if self.efficiency > 1:
            raise ValueError(f"Cluster.efficiency must be <= 1; got {self.efficiency}")

    def link(self, placement: str) -> tuple[float, float]:
        """(latency s, bandwidth bytes/s per GPU) of an axis placed intra or inter node."""
        if placement == "intra":
            return self.intra_latency, self.intra_bw
        if placement == "inter":
            return self.inter_latency, self.inter_bw_node / self.gpus_per_node
        raise ValueError(f"placement must be 'intra' or 'inter'; got {placement!r}")


# Approximate public figures, rounded; the latencies and codec rates are assumptions.
CLUSTERS = {
    # Lassen (LLNL): IBM AC922 nodes, 4 x V100 16GB (125 TFLOP/s fp16 tensor-core peak),
    # NVLink2 between GPUs ~75 GB/s per direction, dual-rail EDR InfiniBand
    # (2 x 100 Gb/s = 25 GB/s per node). Efficiency 0.3: Megatron-style runs on
    # V100 report roughly 30% of peak. Codec rate: a memory-bound pass over HBM2
    # (~900 GB/s) reading and writing, taken as 200 GB/s.
    "lassen": Cluster("lassen", gpus_per_node=4, peak_flops=125e12, efficiency=0.3,
                      intra_bw=75e9, intra_latency=5e-6, inter_bw_node=25e9,
                      inter_latency=10e-6, codec_bw=200e9),
    # DGX/HGX H100: 8 x H100 SXM (989 TFLOP/s dense bf16), NVLink4 ~450 GB/s per
    # direction, 8 x NDR 400 Gb/s (50 GB/s each) per node. Efficiency 0.4.
    # Codec rate from HBM3 (~3.3 TB/s) as above: 800 GB/s.
    "h100-ndr": Cluster("h100-ndr", gpus_per_node=8, peak_flops=989e12, efficiency=0.4,
                        intra_bw=450e9, intra_latency=3e-6, inter_bw_node=400e9,
                        inter_latency=5e-6, codec_bw=800e9),
}


# ---------------------------------------------------------------- alpha-beta

def _check_axis(n: int, nbytes: float, bw: float, latency: float):
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n (GPUs on the axis) must be an int >= 1; got {n!r}")
    if not (math.isfinite(nbytes) and nbytes >= 0):
        raise ValueError(f"nbytes must be finite and >= 0; got {nbytes}")
    if not (math.isfinite(bw) and bw > 0):
        raise ValueError(f"bandwidth must be finite and > 0; got {bw}")
    if not (math.isfinite(latency) and latency >= 0):
        raise ValueError(f"latency must be finite and >= 0; got {latency}")


COLLECTIVES = {  # kind -> (latency steps, bus-bytes factor) for n GPUs
    "all-reduce": lambda n: (2 * (n - 1), 2 * (n - 1) / n),
    "reduce-scatter": lambda n: (n - 1, (n - 1) / n),
    "all-gather": lambda n: (n - 1, (n - 1) / n),
    "p2p": lambda n: (1 if n > 1 else 0, 1.0 if n > 1 else 0.0),
}


def collective_time(kind: str, n: int, nbytes: float, bw: float, latency: float) -> float:
    """Seconds for one collective over n GPUs with a per-GPU buffer of `nbytes`."""
    if kind not in COLLECTIVES:
        raise ValueError(f"kind must be one of {', '.join(COLLECTIVES)}; got {kind!r}")
    _check_axis(n, nbytes, bw, latency)
    steps, factor = COLLECTIVES[kind](n)
    return latency * steps + factor * nbytes / bw


# ---------------------------------------------------------------- the model

def param_count(model: dict) -> int:
    """GPT-NeoX style: per layer 4 d^2 + 4 d (attention) + 2 d f + f + d (MLP) + 4 d
    (two LayerNorms); embeddings V d (twice if untied); final LayerNorm 2 d."""
    d, f, L, V = model["d_model"], model["d_ff"], model["n_layers"], model["vocab_size"]
    per_layer = 4 * d * d + 4 * d + 2 * d * f + f + d + 4 * d
    embed = V * d * (1 if model.get("tie_embeddings", True) else 2)
    return L * per_layer + embed + 2 * d


def step_flops(model: dict, tokens: int, remat: bool) -> tuple[float, float]:
    """(model FLOPs, hardware FLOPs) of one training step over `tokens` tokens."""
    per_token = 6 * param_count(model) + 12 * model["n_layers"] * model["seq_len"] * model["d_model"]
    model_flops = per_token * tokens
    return model_flops, model_flops * (4 / 3 if remat else 1)


def messages(model: dict, mesh: dict, batch: int, microbatches: int, remat: bool,
             zero_stage: int) -> list[dict]:
    """Per GPU per step: [{axis, kind, collective, elements, count}] (see module doc)."""
    t, p, dp = mesh["tensor"], mesh["pipeline"], mesh["data"]
    if batch % (dp * microbatches):
        raise ValueError(f"batch={batch} is not divisible by data={dp} x microbatches={microbatches}")
    if model["n_layers"] % p:
        raise ValueError(f"n_layers={model['n_layers']} is not divisible by pipeline={p}")
    act = batch // (dp * microbatches) * model["seq_len"] * model["d_model"]
    shard = param_count(model) / (t * p)
    per_layer = 4 + (2 if remat else 0)
    return [
        dict(axis="data", kind="grad", collective="all-reduce" if zero_stage == 1 else "reduce-scatter",
             elements=shard, count=1),
        dict(axis="data", kind="param", collective="all-gather", elements=shard, count=1),
        dict(axis="tensor", kind="act", collective="all-reduce", elements=act,
             count=microbatches * (model["n_layers"] // p * per_layer + 2)),
        dict(axis="pipeline", kind="act", collective="p2p", elements=act, count=2 * microbatches),
    ]


def step_time(cluster: Cluster, mesh: dict, placement: dict, msgs: list[dict],
              ratio_by_axis: dict, hw_flops: float, microbatches: int,
              elem_bytes: float = 2.0) -> dict:
    """{compute_s, comm_s {axis}, codec_s, total_s} for one step. ratio_by_axis:
    compressed bytes per element / 4 (the measured byte ratio vs float32); 1 means
    uncompressed, sent at `elem_bytes` per element."""
    n_gpus = math.prod(mesh[a] for a in AXES)
    bubble = (microbatches + mesh["pipeline"] - 1) / microbatches
    compute = hw_flops / n_gpus / (cluster.peak_flops * cluster.efficiency) * bubble
    comm = {a: 0.0 for a in AXES}
    codec = 0.0
    for m in msgs:
        axis = m["axis"]
        r = ratio_by_axis.get(axis, 1.0)
        if r is None or not (math.isfinite(r) and r > 0):
            raise ValueError(f"ratio_by_axis[{axis!r}] must be a finite number > 0; got {r!r}")
        compressed = r < 1.0
        per_elem = 4.0 * r if compressed else elem_bytes
        latency, bw = cluster.link(placement[axis])
        comm[axis] += m["count"] * collective_time(m["collective"], mesh[axis],
                                                   m["elements"] * per_elem, bw, latency)
        if compressed and mesh[axis] > 1:
            passes = 2 if m["collective"] == "all-reduce" else 1
            codec += m["count"] * passes * m["elements"] * elem_bytes / cluster.codec_bw
    return dict(compute_s=compute, comm_s=comm, codec_s=codec,
                total_s=compute + sum(comm.values()) + codec)


def gain_pct(t_base: float, t: float) -> float:
    """Throughput gain of a step taking t over one taking t_base, in percent."""
    if not (t_base > 0 and t > 0):
        raise ValueError(f"step times must be > 0; got t_base={t_base}, t={t}")
    return 100.0 * (t_base / t - 1.0)


# ---------------------------------------------------------------- inputs

def neox20b(gpus: int) -> dict:
    """configs/neox20b.py as plain values, the data axis filling `gpus`."""
    from configs import neox20b as cfg_mod
    c = cfg_mod.get_config()
    t, p = c.mesh.tensor, c.mesh.pipeline
    if gpus % (t * p):
        raise ValueError(f"--gpus={gpus} is not divisible by tensor*pipeline={t * p}")
    model = dict(c.model.to_dict(), seq_len=c.data.seq_len)
    return dict(model=model, mesh={"data": gpus // (t * p), "tensor": t, "pipeline": p},
                batch=c.train.batch_size, microbatches=c.train.microbatches,
                remat=bool(c.train.remat), zero_stage=c.optim.zero_stage,
                elem_bytes=4.0 if model["dtype"] == "float32" else 2.0)


def measured_ratios(path: str) -> dict:
    """{policy: {axis: byte ratio vs baseline}} from convergence.py's summary, for
    baseline and whichever of naive and hybrid it holds."""
    with open(path) as f:
        summary = json.load(f)
    runs = {r["name"]: r for r in summary.get("runs", [])}
    present = [p for p in POLICIES if p in runs]
    if "baseline" not in runs or len(present) < 2:
        raise ValueError(f"{path} needs the baseline run and naive or hybrid: "
                         "run python -m experiments.convergence --suite main first")
    out = {}
    for p in present:
        by_axis = runs[p]["byte_ratio_by_axis"]
        out[p] = {a: 1.0 if by_axis.get(a) is None else float(by_axis[a]) for a in AXES}
    return out


def project(cluster: Cluster, shape: dict, placement: dict, ratios: dict) -> dict:
    """Rows per policy for one cluster, with gains over baseline beside the paper's."""
    m = shape["model"]
    n_gpus = math.prod(shape["mesh"].values())
    tokens = shape["batch"] * m["seq_len"]
    model_flops, hw_flops = step_flops(m, tokens, shape["remat"])
    msgs = messages(m, shape["mesh"], shape["batch"], shape["microbatches"], shape["remat"],
                    shape["zero_stage"])
    rows = {}
    for policy, ratio in ratios.items():
        t = step_time(cluster, shape["mesh"], placement, msgs, ratio, hw_flops,
                      shape["microbatches"], shape.get("elem_bytes", 2.0))
        rows[policy] = dict(t, tflops_per_gpu=model_flops / n_gpus / t["total_s"] / 1e12,
                            samples_per_s=shape["batch"] / t["total_s"], byte_ratio_by_axis=ratio)
    for policy, row in rows.items():
        row["gain_pct"] = gain_pct(rows["baseline"]["total_s"], row["total_s"])
        row["paper"] = PAPER.get(policy)
    return dict(cluster=dataclasses.asdict(cluster), gpus=n_gpus, placement=placement,
                model_flops_per_step=model_flops, hardware_flops_per_step=hw_flops,
                params=param_count(m), messages=msgs, policies=rows)


def parse_placement(items) -> dict:
    out = {"tensor": "intra", "pipeline": "inter", "data": "inter"}
    for item in items or ():
        axis, _, where = item.partition("=")
        if axis not in AXES or where not in ("intra", "inter"):
            raise ValueError(f"--placement {item!r}: want AXIS=intra|inter with AXIS in "
                             f"{', '.join(AXES)}")
        out[axis] = where
    return out


def print_link(link: dict):
    prof = link["profile"]
    print(f"link profile (network.json at {link['commit'][:7]}): beta {prof['beta_bytes_per_s'] / 1e6:.2f} "
          f"MB/s, alpha additive {prof['alpha_s']['additive'] * 1e3:+.3f} ms, overlapped "
          f"{prof['alpha_s']['overlapped'] * 1e3:+.3f} ms per collective (calibrated on the "
          f"baseline at {prof['calibration_rate']})")
    for r in link["rows"]:
        pred, ratio = r["predicted_s"], r["ratio"]
        print(f"{r['rate']:>11} {r['policy']:>8}: measured {r['measured_s']:.3f} s, additive "
              f"{pred['additive']:.3f} s (x{ratio['additive']:.2f}), overlapped "
              f"{pred['overlapped']:.3f} s (x{ratio['overlapped']:.2f}) [{r['role']}]")
    for policy, c in link["crossover"].items():
        m = c["measured"]
        print(f"crossover {policy}: measured beats the baseline up to "
              f"{m['beats_baseline_up_to'] or 'no swept rate'}"
              + (f", not at {m['loses_from']}" if m.get("loses_from") else "")
              + f"; predicted up to {c['predicted']['overlapped']} (overlapped), "
              f"{c['predicted']['additive']} (additive)")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clusters", nargs="+", default=list(CLUSTERS))
    p.add_argument("--gpus", type=int, default=192)
    p.add_argument("--measured", default=DEFAULT_MEASURED)
    p.add_argument("--placement", nargs="*", default=None)
    p.add_argument("--json", default=DEFAULT_JSON)
    p.add_argument("--network", default=DEFAULT_NETWORK)
    p.add_argument("--calibration-rate", default="100mbit")
    args = p.parse_args(argv)
    try:
        unknown = [c for c in args.clusters if c not in CLUSTERS]
        if unknown:
            raise ValueError(f"--clusters: unknown {unknown}; known: {', '.join(CLUSTERS)}")
        placement = parse_placement(args.placement)
        shape = neox20b(args.gpus)
        ratios = measured_ratios(args.measured)
        link = None
        if os.path.exists(args.network):
            from experiments import linkprofile
            with open(args.network) as f:
                link = linkprofile.link_report(json.load(f), args.calibration_rate)
            link["network_from"] = os.path.relpath(os.path.abspath(args.network), ROOT)
    except (ValueError, OSError) as e:
        print(f"projection.py: error: {e}", file=sys.stderr)
        return 2
    result = dict(command="python -m experiments.projection " + " ".join(argv or sys.argv[1:]),
                  measured_from=os.path.relpath(os.path.abspath(args.measured), ROOT),
                  shape=shape, paper=PAPER,
                  clusters={c: project(CLUSTERS[c], shape, placement, ratios) for c in args.clusters})
    if link:
        result["link"] = link
        print_link(link)
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1, allow_nan=False)
    for name, res in result["clusters"].items():
        for policy, row in res["policies"].items():
            print(f"{name:>9} {policy:>8}: step {row['total_s']:.3f} s, "
                  f"{row['tflops_per_gpu']:.1f} TFLOPS/GPU, {row['samples_per_s']:.2f} samples/s, "
                  f"gain {row['gain_pct']:+.1f}%")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
