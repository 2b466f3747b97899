"""A MaxText-shaped `jax.jit` train step, plain and with jcomp's gradient reduction.

    python -m benchmarks.jit_step [--codec int8] [--microbatches 1] [--fsdp] [--repeats 5]
                                  [--steps 20] [--out benchmarks/results/jit_step/CODEC.json]

The step: a Flax model whose parameters carry logical axis names, mapped to
a (data 4, model 2) Auto mesh by logical axis rules (with --fsdp, "embed" maps
to "data" too: every parameter with an embed dimension is split over the
batch axis, FSDP as nanoDO writes it); bf16 parameters (the
MLP's) beside float32 ones (embedding, norms, output); the MLP blocks under
`nn.remat`; optax AdamW; the batch split over "data". No shard_map in the
model: XLA inserts every collective of the plain step. The jcomp step differs
in one call, `cc.value_and_grad` in place of `jax.value_and_grad`.

Prints and writes, for each side: bytes per mesh axis read from the compiled
step (jcomp.meter.wire), the count of reductions over "data", the median step time
of --repeats timed runs of --steps steps (the two sides alternate, so drift on
a shared machine hits both; a compile inside a timed run raises), and the loss
after --steps steps. The task: map each token to a fixed random permutation of
the vocabulary.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time

if __name__ == "__main__":
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    from jcomp.collectives import cpu  # the README's CPU scheduler option, as train.py sets it
    cpu.add_flag(os.environ)

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from jcomp import collectives as cc
from jcomp.meter import wire

RULES = (("batch", "data"), ("embed", None), ("mlp", "model"), ("vocab", "model"))
FSDP_RULES = (("batch", "data"), ("embed", "data"), ("mlp", "model"), ("vocab", "model"))
VOCAB, EMBED, MLP, LAYERS, SEQ = 256, 128, 512, 2, 8
MLP_DTYPE = jnp.bfloat16  # the MLP's parameters and compute; the rest float32
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"  # jax's monitoring event


class Block(nn.Module):
    @nn.compact
    def __call__(self, x_BxLxD):
        h = nn.LayerNorm(scale_init=nn.with_logical_partitioning(nn.initializers.ones, ("embed",)),
                         bias_init=nn.with_logical_partitioning(nn.initializers.zeros, ("embed",)))(x_BxLxD)
        dense = lambda feats, axes, name: nn.Dense(
            feats, name=name, dtype=MLP_DTYPE, param_dtype=MLP_DTYPE,
            kernel_init=nn.with_logical_partitioning(nn.initializers.lecun_normal(), axes),
            bias_init=nn.with_logical_partitioning(nn.initializers.zeros, (axes[1],)))
        h_BxLxF = nn.gelu(dense(MLP, ("embed", "mlp"), "wi")(h))
        return x_BxLxD + dense(EMBED, ("mlp", "embed"), "wo")(h_BxLxF).astype(x_BxLxD.dtype)


class Model(nn.Module):
    @nn.compact
    def __call__(self, tokens_BxL):
        x = nn.Embed(VOCAB, EMBED, embedding_init=nn.with_logical_partitioning(
            nn.initializers.normal(1.0), ("vocab", "embed")))(tokens_BxL)
        for i in range(LAYERS):
            x = nn.remat(Block)(name=f"block{i}")(x)
        return nn.Dense(VOCAB, kernel_init=nn.with_logical_partitioning(
            nn.initializers.lecun_normal(), ("embed", "vocab")),
            bias_init=nn.with_logical_partitioning(nn.initializers.zeros, ("vocab",)))(x)


def make_mesh(data=4, model=2):
    return jax.make_mesh((data, model), ("data", "model"), axis_types=(AxisType.Auto,) * 2)


def loss_fn(params, batch):
    logits = Model().apply({"params": params}, batch["x"]).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def init(mesh, seed=0, fsdp=False):
    """-> (params, param_specs (mesh axes), optimizer, opt_state), placed on the mesh."""
    abstract = jax.eval_shape(lambda: Model().init(jax.random.key(seed), jnp.zeros((1, SEQ), jnp.int32)))
    logical = nn.get_partition_spec(abstract)["params"]
    specs = nn.logical_to_mesh(logical, FSDP_RULES if fsdp else RULES)
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs)
    params = jax.jit(lambda: nn.unbox(Model().init(jax.random.key(seed),
                                                   jnp.zeros((1, SEQ), jnp.int32))["params"]),
                     out_shardings=shardings)()
    tx = optax.adamw(1e-3, weight_decay=0.01)
    # The state's moments laid out as their parameters (the step's own output
    # layout), so the first step's program is the one every step runs.
    opt_shardings = optax.tree_map_params(
        tx, lambda _, s: s, jax.eval_shape(tx.init, params), shardings,
        transform_non_params=lambda _: NamedSharding(mesh, P()))
    return params, specs, tx, jax.jit(tx.init, out_shardings=opt_shardings)(params)


def batches(mesh, steps, batch_size=64, seed=0):
    perm = np.random.default_rng(1234).permutation(VOCAB)
    rng = np.random.default_rng(seed)
    sharding = NamedSharding(mesh, P("data"))
    for _ in range(steps):
        x = rng.integers(0, VOCAB, (batch_size, SEQ), dtype=np.int32)
        yield jax.device_put({"x": x, "y": perm[x].astype(np.int32)}, sharding)


def make_step(mesh, specs, tx, *, codec=None, microbatches=1, scatter=False):
    """The jit train step: plain (codec None: jax.value_and_grad, XLA's reduction)
    or jcomp's (cc.value_and_grad with `codec`)."""
    if codec is None:
        def grads_of(params, batch):
            if microbatches == 1:
                return jax.value_and_grad(loss_fn)(params, batch)
            return _plain_accumulate(params, batch, microbatches)
    else:
        grads_of = cc.value_and_grad(loss_fn, mesh=mesh, param_specs=specs, codec=codec,
                                     mean_over="examples", microbatches=microbatches)

    def step(params, opt_state, batch):
        loss, grads = grads_of(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return jax.jit(step, donate_argnums=(0, 1))


def _plain_accumulate(params, batch, k):
    """The plain program's accumulation: lax.scan over k microbatches, each split
    over "data" as the batch is (MaxText's constraint), float32 sum."""
    micro = jax.tree.map(lambda x: jax.lax.with_sharding_constraint(
        x.reshape((k, x.shape[0] // k) + x.shape[1:]), P(None, "data")), batch)  # set_mesh
    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)

    def body(carry, mb):
        loss_sum, acc = carry
        loss, g = jax.value_and_grad(loss_fn)(params, mb)
        return (loss_sum + loss, jax.tree.map(lambda a, x: a + x.astype(jnp.float32), acc, g)), None

    (loss_sum, acc), _ = jax.lax.scan(body, (jnp.zeros((), jnp.float32), zeros), micro)
    return loss_sum / k, jax.tree.map(lambda a, p: (a / k).astype(p.dtype), acc, params)


def train(mesh, codec=None, steps=20, microbatches=1, seed=0, fsdp=False):
    """-> (final params, losses per step, the compiled step's wire report)."""
    with jax.set_mesh(mesh):  # the program's mesh context, as MaxText sets it
        params, specs, tx, opt_state = init(mesh, seed, fsdp)
        step = make_step(mesh, specs, tx, codec=codec, microbatches=microbatches)
        report, losses = None, []
        for batch in batches(mesh, steps, seed=seed):
            if report is None:
                report = wire.measure(step, params, opt_state, batch, mesh=mesh)
            params, opt_state, loss = step(params, opt_state, batch)
            losses.append(float(loss))  # waits on the step (emulated devices: JAX_NOTES)
    return params, losses, report


def data_collectives(report) -> int:
    """Executions per step of the collectives over "data" alone."""
    return sum(c.count for c in report.collectives if c.axes == ("data",))


def bytes_over(report) -> dict:
    """Bytes per device and step of the collectives that cross each mesh axis (a
    collective over several axes counts for each): what each axis's links carry."""
    return report.by_mesh_axis()


def _timed(mesh, codec, steps, microbatches, fsdp=False):
    with jax.set_mesh(mesh):
        return _timed_in(mesh, codec, steps, microbatches, fsdp)


def _timed_in(mesh, codec, steps, microbatches, fsdp):
    params, specs, tx, opt_state = init(mesh, fsdp=fsdp)
    step = make_step(mesh, specs, tx, codec=codec, microbatches=microbatches)
    data = list(batches(mesh, steps + 1))
    params, opt_state, loss = step(params, opt_state, data[0])  # compile
    loss.block_until_ready()
    compiles = []
    listen = lambda event, secs, **_: compiles.append(secs) if event == COMPILE_EVENT else None
    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        t0 = time.perf_counter()
        for batch in data[1:]:
            params, opt_state, loss = step(params, opt_state, batch)
            loss.block_until_ready()
        elapsed = time.perf_counter() - t0
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    if compiles:  # e.g. inputs laid out unlike the step's outputs: a second program
        raise RuntimeError(f"the step compiled {len(compiles)} more time(s) inside the timed "
                           f"loop ({sum(compiles):.2f} s): its time would not be a step's")
    return elapsed / steps


def _commit() -> str:
    """HEAD, with "-dirty" where jcomp/ or this script differ from it."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    run = lambda *a: subprocess.run(["git", *a], cwd=root, capture_output=True, text=True)
    head = run("rev-parse", "HEAD").stdout.strip() or "unknown"
    dirty = run("status", "--porcelain", "jcomp", "benchmarks/jit_step.py").stdout.strip()
    return head + ("-dirty" if dirty else "")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--codec", default="int8")
    ap.add_argument("--microbatches", type=int, default=1)
    ap.add_argument("--fsdp", action="store_true",
                    help="split the parameters over the batch axis too (FSDP over data)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    mesh = make_mesh()
    out = {"codec": args.codec, "microbatches": args.microbatches, "fsdp": args.fsdp,
           "steps": args.steps,
           "mesh": dict(mesh.shape), "jax": jax.__version__, "git_commit": _commit()}
    for name, codec in (("plain", None), ("jcomp", args.codec)):
        _, losses, report = train(mesh, codec, args.steps, args.microbatches, fsdp=args.fsdp)
        out[name] = {"bytes_by_axis": report.by_axis(), "bytes_over_axis": bytes_over(report),
                     "total_bytes": report.total(), "collectives": len(report.collectives),
                     "data_collectives": data_collectives(report), "final_loss": losses[-1],
                     "notes": report.notes}
    times = {"plain": [], "jcomp": []}
    for _ in range(args.repeats):
        for name, codec in (("plain", None), ("jcomp", args.codec)):
            times[name].append(_timed(mesh, codec, args.steps, args.microbatches, args.fsdp))
    for name in times:
        out[name]["step_s"] = times[name]
        out[name]["median_step_s"] = statistics.median(times[name])
    p, j = out["plain"], out["jcomp"]
    print(f"codec {args.codec}, microbatches {args.microbatches}, "
          f"{'FSDP over data, ' if args.fsdp else ''}mesh {out['mesh']}, "
          f"{args.repeats} repeats of {args.steps} steps")
    for axis in sorted(set(p["bytes_over_axis"]) | set(j["bytes_over_axis"])):
        a, b = p["bytes_over_axis"].get(axis, 0.0), j["bytes_over_axis"].get(axis, 0.0)
        print(f"  bytes over {axis:<12} plain {a:>12.0f}  jcomp {b:>12.0f}  "
              f"ratio {b / a if a else float('nan'):.3f}")
    print(f"  bytes in all         plain {p['total_bytes']:>12.0f}  jcomp {j['total_bytes']:>12.0f}"
          f"  ratio {j['total_bytes'] / p['total_bytes']:.3f}")
    print(f"  collectives over data per step: plain {p['data_collectives']}, "
          f"jcomp {j['data_collectives']}; collectives in the program: plain "
          f"{p['collectives']}, jcomp {j['collectives']}")
    print(f"  median step: plain {p['median_step_s'] * 1e3:.2f} ms, jcomp "
          f"{j['median_step_s'] * 1e3:.2f} ms, ratio {j['median_step_s'] / p['median_step_s']:.3f}")
    print(f"  loss after {args.steps} steps: plain {p['final_loss']:.4f}, "
          f"jcomp {j['final_loss']:.4f} ({(j['final_loss'] / p['final_loss'] - 1) * 100:+.2f}%)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
