"""Benchmark of the full 3-D parallel train step per mesh shape and policy.

    python -m benchmarks.parallel [--shapes 8,1,1 2,2,2 1,2,4] [--policies baseline hybrid naive]
                                  [--microbatches 1 2 4] [--repeats 5] [--json PATH] [--quick]
                                  [--d-model 128 --layers 4 --heads 4 --seq 128 --batch 16]

For every mesh shape (data, tensor, pipeline) x policy x microbatch count M it
builds `jcomp.gpt.step.make_train_step` (ZeRO stage 1, AdamW, global-norm
clipping), compiles it ahead of time and reports:
  - the median wall time of that compiled step, and its ratio to the baseline
    policy on the same mesh and M. All compiled steps are timed round-robin in
    one loop, so load on a shared machine slows them alike; every call waits
    for its result (queued calls deadlock emulated CPU devices);
  - parameter and optimizer-state bytes on the first device, measured from the
    arrays (`step.device_bytes`);
  - bytes one device sends per step over each mesh axis, read by `jcomp.meter.wire`
    from the same compiled executable that is timed;
  - the pipeline bubble. Predicted: GPipe's (P - 1) / (M + P - 1). Measured
    (baseline policy only, so compression costs are not counted as bubble):

        measured_bubble = 1 - (t_ref / P) / t

    where t is the step time on the (d, t, P) mesh and t_ref the step time of
    the same model, batch, M and policy on a (d, t, 1) mesh built from the
    first d*t devices. t_ref / P is what the step would take if the P stages
    split the layer work with no one waiting; the rest of t is the bubble plus
    pipeline traffic and the head that every stage computes. Meshes with
    pipeline 1 run M = 1 only (without a pipeline, microbatches only serialize).

On emulated CPU devices all devices share the host's cores: an idle stage
frees no compute (it even computes a masked tick of its own), and a mesh with
fewer devices gets the same cores. So the measured bubble there is not what a
GPU cluster would show; only the predicted column and the byte columns carry
over. Without a device count in XLA_FLAGS the host is split into 8 devices.
"""
import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8").strip()

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402

from jcomp.gpt import mesh as jmesh  # noqa: E402
from jcomp.gpt import model as gpt  # noqa: E402
from jcomp.gpt import hyperparams, messages, pipeline, sharding, step, zero  # noqa: E402
from jcomp.gpt import policy as policy_lib  # noqa: E402
from jcomp.meter import wire  # noqa: E402

AXES = jmesh.AXES
DEFAULTS = dict(shapes=[(8, 1, 1), (2, 2, 2), (1, 2, 4)], policies=["baseline", "hybrid", "naive"],
                microbatches=[1, 2, 4], repeats=5, reference=True, d_model=128, layers=4,
                heads=4, d_ff=512, vocab=256, seq=128, batch=16)
QUICK = dict(shapes=[(8, 1, 1), (1, 2, 4)], policies=["baseline", "hybrid"], microbatches=[2],
             repeats=1, reference=False, d_model=32, layers=4, heads=4, d_ff=64, vocab=64,
             seq=16, batch=8)
CPU_NOTE = ("emulated CPU devices share the host's cores: idle pipeline stages free no compute, "
            "so the measured bubble is not the one a GPU cluster would show")


def predicted_bubble(n_stages: int, microbatches: int) -> float:
    """GPipe's idle fraction (P - 1) / (M + P - 1)."""
    return pipeline.predicted_bubble(n_stages, microbatches)


def measured_bubble(t: float, t_ref: float, n_stages: int) -> float:
    """1 - (t_ref / P) / t: the share of the step beyond the un-pipelined time split P ways."""
    if not (t > 0 and t_ref > 0):
        raise ValueError(f"step times must be > 0; got t={t}, t_ref={t_ref}")
    return 1.0 - (t_ref / n_stages) / t


def plan(shapes, policies, microbatches, cfg, batch, reference=True):
    """-> (cases, skipped). A case is a dict(shape, policy, microbatches, role); role
    'reference' marks the (d, t, 1) runs behind the measured bubble."""
    cases, skipped = [], []

    def add(shape, pol, m, role):
        case = dict(shape=tuple(shape), policy=pol, microbatches=m, role=role)
        if case in cases:
            return
        try:
            sharding.check_layout(cfg, dict(zip(AXES, shape)), batch, m)
        except ValueError as e:
            skipped.append(dict(case, shape=list(shape), reason=str(e)))
            return
        cases.append(case)

    for shape in shapes:
        if reference and shape[1] == shape[2] == 1 and "baseline" in policies:
            add(shape, JIT_DP, 1, "jit")
        ms = microbatches if shape[2] > 1 else [1]
        for m in ms:
            for pol in policies:
                add(shape, pol, m, "main")
            if reference and shape[2] > 1 and "baseline" in policies:
                add((shape[0], shape[1], 1), "baseline", m, "reference")
    return cases, skipped


def inputs(cfg, batch: int, seq: int):
    """-> (AdamW, host params, host tokens [batch, seq+1]) shared by every case.
    Host copies: every case places its own, so donating one case's state cannot
    delete buffers another case shares."""
    tx = hyperparams.make_tx(lr=1e-3, warmup_steps=0, total_steps=1000, weight_decay=0.1,
                             decay_mask=hyperparams.decay_mask)
    params = jax.tree.map(np.asarray, gpt.init_params(cfg, jax.random.key(0)))
    tokens_BxL1 = np.random.default_rng(0).integers(
        0, cfg.vocab_size, (batch, seq + 1)).astype(np.int32)
    return tx, params, tokens_BxL1


def flat_activations(plan):
    """`plan` with every activation message coded as flat blocks across tokens
    (rows="flat"), as the step sent them before blocks were kept within a token:
    the reference a row-local plan's bytes and codec time are measured against."""
    return dataclasses.replace(plan, **{
        m.name: dataclasses.replace(m, rows="flat") for m in plan.messages()
        if m.direction in ("forward", "backward")})


def compile_step(pol, shape, microbatches, cfg, tx, params, tokens_BxL1, rows=None) -> dict:
    """The ZeRO-1 train step of `pol` (a Policy) on a mesh of `shape`, compiled;
    rows="flat": its activation messages coded across tokens (`flat_activations`).
    -> dict(exe, state, batch, mesh, plan)."""
    mesh = jmesh.make_mesh(shape, devices=jax.devices()[:math.prod(shape)])
    plan = messages.plan(pol, cfg.n_layers, dict(mesh.shape))
    layout = zero.for_plan(plan, stage=1)
    state = step.init_state(params, mesh, tx, layout)
    batch = jax.device_put(tokens_BxL1, NamedSharding(mesh, sharding.BATCH_SPEC))
    if rows == "flat":
        plan = flat_activations(plan)
    fn = step.make_train_step(cfg, mesh, plan, tx, jax.eval_shape(lambda: params), layout=layout,
                              microbatches=microbatches, clip_norm=1.0)
    return dict(exe=fn.lower(state, batch).compile(), state=state, batch=batch, mesh=mesh,
                plan=plan)


def build(case, cfg, tx, params, tokens_BxL1):
    """Compiles one case. -> dict(exe, state, batch, report, param_bytes, opt_bytes)."""
    run = compile_step(policy_lib.preset(case["policy"]), case["shape"], case["microbatches"],
                       cfg, tx, params, tokens_BxL1)
    state = run["state"]
    return dict(exe=run["exe"], state=state, batch=run["batch"],
                report=wire.measure_compiled(run["exe"], run["mesh"]),
                param_bytes=step.device_bytes(state["params"]),
                opt_bytes=step.device_bytes(state["zero"]))


JIT_DP = "jax.jit dp"  # the reference policy name: a plain jitted data-parallel step


def build_jit_dp(case, cfg, tx, params, tokens_BxL1):
    """The same model, batch, AdamW and global-norm clipping as a plain `jax.jit`
    data-parallel step: parameters and optimizer state replicated, the batch split
    over 'data', XLA's own gradient all-reduce. The reference jcomp's baseline
    policy (ZeRO stage 1, explicit reduction) is timed against."""
    shape = case["shape"]
    mesh = jmesh.make_mesh(shape, devices=jax.devices()[:math.prod(shape)])
    replicated = NamedSharding(mesh, jax.sharding.PartitionSpec())
    clipped = optax.chain(optax.clip_by_global_norm(1.0), tx)
    params_r = jax.device_put(params, replicated)
    state = (params_r, jax.jit(clipped.init, out_shardings=replicated)(params_r))

    def train_step(state, batch):
        p, opt = state
        loss, grads = jax.value_and_grad(gpt.loss_fn)(p, batch, cfg)
        updates, opt = clipped.update(grads, opt, p)
        return (optax.apply_updates(p, updates), opt), {"loss": loss}

    batch = jax.device_put(tokens_BxL1, NamedSharding(mesh, sharding.BATCH_SPEC))
    fn = jax.jit(train_step, donate_argnums=0, out_shardings=((replicated, replicated),
                                                              {"loss": replicated}))
    exe = fn.lower(state, batch).compile()
    return dict(exe=exe, state=state, batch=batch, report=wire.measure_compiled(exe, mesh),
                param_bytes=step.device_bytes(state[0]), opt_bytes=step.device_bytes(state[1]))


def run_once(run) -> tuple[float, float]:
    """One train step of a built case, waited for. -> (seconds, loss)."""
    t0 = time.perf_counter()
    run["state"], metrics = run["exe"](run["state"], run["batch"])
    jax.block_until_ready((run["state"], metrics))
    return time.perf_counter() - t0, float(metrics["loss"])


def time_interleaved(runs: list, repeats: int) -> tuple[list, list]:
    """-> ([first-step loss per run], [[seconds per step] per run]): one warm-up step
    each, then `repeats` rounds stepping every run once in turn."""
    first = [run_once(r)[1] for r in runs]
    times = [[] for _ in runs]
    for _ in range(repeats):
        for i, r in enumerate(runs):
            times[i].append(run_once(r)[0])
    return first, times


def make_rows(cases, built, first, times) -> list[dict]:
    """Result rows with ratios to the baseline policy and the pipeline bubble."""
    rows = []
    for case, b, loss, ts in zip(cases, built, first, times):
        d, t, p = case["shape"]
        rows.append(dict(
            shape=[d, t, p], mesh=dict(zip(AXES, case["shape"])), policy=case["policy"],
            microbatches=case["microbatches"], role=case["role"], devices=d * t * p,
            time_s=statistics.median(ts), times_s=ts, first_loss=loss,
            param_bytes_per_device=b["param_bytes"], opt_state_bytes_per_device=b["opt_bytes"],
            wire_bytes_by_axis=b["report"].by_axis(), wire_bytes_total=b["report"].total(),
            wire_notes=list(b["report"].notes),
            predicted_bubble=predicted_bubble(p, case["microbatches"])))
    key = lambda r: (tuple(r["shape"]), r["microbatches"])
    base = {key(r): r for r in rows if r["policy"] == "baseline"}
    for r in rows:
        b = base.get(key(r))
        r["time_ratio"] = r["time_s"] / b["time_s"] if b else None
        jit = next((j for j in rows if j["policy"] == JIT_DP and key(j) == key(r)), None)
        r["baseline_vs_jit_dp"] = (b["time_s"] / jit["time_s"]
                                   if r is jit and b else None)
        r["wire_ratio"] = (r["wire_bytes_total"] / b["wire_bytes_total"]
                           if b and b["wire_bytes_total"] else None)
        ref = base.get(((r["shape"][0], r["shape"][1], 1), r["microbatches"]))
        pipelined = r["shape"][2] > 1 and r["policy"] == "baseline" and r["role"] == "main"
        r["reference_time_s"] = ref["time_s"] if pipelined and ref else None
        r["measured_bubble"] = (measured_bubble(r["time_s"], ref["time_s"], r["shape"][2])
                                if r["reference_time_s"] else None)
    return rows


def _mib(n) -> str:
    return f"{n / 2**20:.3f}"


def table(rows) -> str:
    """Fixed-width table of the rows; wire columns in MiB per device per step."""
    head = ("mesh d,t,p", "devs", "policy", "M", "ms", "time x", "param MiB", "opt MiB",
            "wire data", "wire tensor", "wire pipe", "wire total", "bubble pred", "bubble meas")
    lines = [head]
    for r in rows:
        w = r["wire_bytes_by_axis"]
        lines.append((
            ",".join(map(str, r["shape"])) + (" (ref)" if r["role"] == "reference" else ""),
            str(r["devices"]), r["policy"], str(r["microbatches"]), f"{r['time_s'] * 1e3:.1f}",
            "-" if r["time_ratio"] is None else f"{r['time_ratio']:.2f}",
            _mib(r["param_bytes_per_device"]), _mib(r["opt_state_bytes_per_device"]),
            *(_mib(w.get(a, 0.0)) for a in AXES), _mib(r["wire_bytes_total"]),
            f"{r['predicted_bubble']:.3f}",
            "-" if r["measured_bubble"] is None else f"{r['measured_bubble']:.3f}"))
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    return "\n".join("  ".join(v.rjust(w) if i > 2 else v.ljust(w)
                               for i, (v, w) in enumerate(zip(line, widths))).rstrip()
                     for line in lines)


def parse_shape(text: str) -> tuple[int, int, int]:
    """'2,2,2' -> (data, tensor, pipeline), each a positive int."""
    parts = text.split(",")
    if len(parts) != 3 or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(
            f"--shapes: {text!r} is not data,tensor,pipeline with positive sizes (e.g. 2,2,2)")
    return tuple(int(p) for p in parts)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", nargs="+", type=parse_shape, help="data,tensor,pipeline sizes")
    ap.add_argument("--policies", nargs="+", choices=list(policy_lib.PRESETS),
                    help="'baseline' is always run: ratios and the bubble are taken against it")
    ap.add_argument("--microbatches", nargs="+", type=int, help="M for meshes with pipeline > 1")
    ap.add_argument("--repeats", type=int, help="timed steps per case (default 5)")
    add_model_args(ap)
    ap.add_argument("--reference", action=argparse.BooleanOptionalAction, default=None,
                    help="run the (data, tensor, 1) meshes behind the measured bubble "
                         "(default: on; off with --quick)")
    ap.add_argument("--json", default="benchmarks/results/parallel.json")
    ap.add_argument("--quick", action="store_true", help=f"smoke run: {QUICK} unless given")
    args = ap.parse_args(argv)
    for name, value in (QUICK if args.quick else DEFAULTS).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.policies = ["baseline"] + [p for p in dict.fromkeys(args.policies) if p != "baseline"]
    args.shapes = list(dict.fromkeys(args.shapes))
    args.microbatches = list(dict.fromkeys(args.microbatches))
    check_positive(args, ap, ("repeats",) + MODEL_FIELDS)
    if min(args.microbatches) < 1:
        ap.error(f"--microbatches must be >= 1; got {args.microbatches}")
    n = jax.device_count()
    bad = [s for s in args.shapes if math.prod(s) != n]
    if bad:
        ap.error(f"--shapes must use all {n} devices (data x tensor x pipeline = {n}); got "
                 + " ".join(",".join(map(str, s)) for s in bad))
    args.model = model_config(args, ap)
    return args, ap


MODEL_FIELDS = ("d_model", "layers", "heads", "d_ff", "vocab", "seq", "batch")


def add_model_args(ap):
    """--d-model, --layers, --heads, --d-ff, --vocab, --seq, --batch (ints)."""
    for name in MODEL_FIELDS:
        ap.add_argument("--" + name.replace("_", "-"), type=int, dest=name)


def check_positive(args, ap, names):
    for name in names:
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1; got {getattr(args, name)}")


def model_config(args, ap) -> gpt.ModelConfig:
    """The model of the parsed MODEL_FIELDS; ap.error (exit 2) if it is invalid."""
    try:
        return gpt.ModelConfig(vocab_size=args.vocab, d_model=args.d_model, n_heads=args.heads,
                               n_layers=args.layers, d_ff=args.d_ff, max_seq_len=args.seq)
    except (TypeError, ValueError) as e:
        ap.error(f"model: {e}")


def main(argv=None):
    args, ap = parse_args(argv)
    cfg = args.model
    cases, skipped = plan(args.shapes, args.policies, args.microbatches, cfg, args.batch,
                          args.reference)
    for s in skipped:
        print(f"SKIP mesh {s['shape']} policy {s['policy']} M={s['microbatches']}: {s['reason']}")
    if not cases:
        ap.error("no mesh shape and microbatch count fits the model and batch")
    print(f"jax {jax.__version__}, backend {jax.default_backend()}, {jax.device_count()} devices, "
          f"model {cfg}, batch {args.batch}, seq {args.seq}, repeats {args.repeats}", flush=True)
    tx, params, tokens_BxL1 = inputs(cfg, args.batch, args.seq)
    built = []
    for c in cases:
        t0 = time.perf_counter()
        make = build_jit_dp if c["policy"] == JIT_DP else build
        built.append(make(c, cfg, tx, params, tokens_BxL1))
        print(f"  compiled {c['shape']} {c['policy']} M={c['microbatches']} ({c['role']}) "
              f"in {time.perf_counter() - t0:.1f} s", flush=True)
    first, times = time_interleaved(built, args.repeats)
    rows = make_rows(cases, built, first, times)
    print(table(rows))
    print("bubble meas = 1 - (t(d,t,1) / P) / t(d,t,P), baseline policy, same M and batch")
    for r in rows:
        if r["baseline_vs_jit_dp"] is not None:
            print(f"baseline / {JIT_DP} step time on mesh {r['shape']}: "
                  f"{r['baseline_vs_jit_dp']:.3f}x (medians, timed side by side)")
    notes = list(dict.fromkeys(n for r in rows for n in r["wire_notes"]))
    if jax.default_backend() == "cpu":
        notes.insert(0, CPU_NOTE)
    for n in notes:
        print(f"NOTE {n}")
    out = dict(jax_version=jax.__version__, backend=jax.default_backend(),
               device_kind=jax.devices()[0].device_kind, device_count=jax.device_count(),
               xla_flags=os.environ.get("XLA_FLAGS", ""),
               date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               model=dict(vocab_size=cfg.vocab_size, d_model=cfg.d_model, n_heads=cfg.n_heads,
                          n_layers=cfg.n_layers, d_ff=cfg.d_ff), batch=args.batch, seq=args.seq,
               repeats=args.repeats, zero_stage=1,
               bubble_definition="measured_bubble = 1 - (t_ref / P) / t; t_ref: same model, "
                                 "batch, M, baseline policy on the (data, tensor, 1) mesh of "
                                 "the first data*tensor devices",
               rows=rows, skipped=skipped, notes=notes)
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
