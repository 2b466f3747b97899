"""What compression.auto would choose for a model on a mesh, from a profile,
without devices: message plans and sizes from shapes only, nothing compiled.

    python -m jcomp.train.plan --profile=configs/profiles/h100_8x_nvlink_400g.json \\
        --config=configs/neox20b.py [--devices=192] [--mesh data=12,tensor=4,pipeline=4]
        [--budget=grad=int8] [--overlap=0.3]

Prints per (mesh axis, kind) the link, the codec chosen, the bytes per step
raw -> coded and the predicted communication time vs uncompressed, beside the
hybrid_paper preset's codec and predicted time (Xu et al.'s hybrid), then the
totals against two baselines: jcomp's own uncompressed step (float32
gradients and master parameters, the embedding and head on every pipeline
stage, the pipeline's output all-reduce), and a standard bf16 step sending
the same model (`standard_bf16`: bf16 gradients and parameters, the embedding
on the first stage and the head on the last, no output all-reduce), so that
auto's saving is not partly one a bf16 setup has already. --devices is the machine the config's mesh is resolved for (a size of
-1 takes the rest): 192, the paper's GPU count, by default. Exit 2 with one
line on bad input.
"""
from __future__ import annotations

import argparse
import importlib.util
import math
import os
import sys
import traceback


def _config(path: str):
    if not os.path.isfile(path):
        raise ValueError(f"--config={path}: no such file")
    # A config imports its siblings as `configs.base`: the folder above the
    # config's own makes that import work from an installed wheel too, where the
    # package's location says nothing about where the configs are.
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(path))))
    try:
        spec = importlib.util.spec_from_file_location("_plan_config", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        cfg = module.get_config()
    except Exception as e:  # noqa: BLE001  (the config file's own code may raise anything)
        raise ValueError(f"--config={path}: {_raised_by(e, path)}") from None
    import ml_collections
    if not isinstance(cfg, ml_collections.ConfigDict):
        got = "None (a missing return statement?)" if cfg is None else type(cfg).__name__
        raise ValueError(f"--config={path}: get_config() returned {got}, not a ConfigDict")
    return cfg


def _raised_by(e: BaseException, path: str) -> str:
    """What went wrong inside the config file, in train.py's words for it."""
    path = os.path.abspath(path)
    if isinstance(e, SyntaxError) and e.filename and os.path.abspath(e.filename) == path:
        return f"{type(e).__name__} at line {e.lineno}: {e.msg}"
    frames = [f for f in traceback.extract_tb(e.__traceback__)
              if os.path.abspath(f.filename) == path]
    if not frames:
        return f"{type(e).__name__}: {e}"
    f = frames[-1]
    raiser = f"{f.name}() raised" if f.name != "<module>" else "raised"
    return f"{raiser} {type(e).__name__}: {e} (line {f.lineno})"


def _mesh_sizes(axes, text: str) -> dict:
    """--mesh "data=6,dcn_data=2" -> {"data": 6, "dcn_data": 2}, each axis one of `axes`."""
    sizes = {}
    for item in text.split(",") if text else ():
        axis, eq, size = item.partition("=")
        if not eq or axis.strip() not in axes or not size.strip().lstrip("-").isdigit():
            raise ValueError(f"--mesh: want AXIS=SIZE,... with AXIS in {', '.join(axes)}; "
                             f"got {item!r}")
        sizes[axis.strip()] = int(size)
    return sizes


def plan_text(settings, profile, budget, overlap: float) -> str:
    """The plan of `settings` (jcomp.train.settings.runspec.Settings) on `profile`."""
    import jax.numpy as jnp

    from jcomp import tune
    from jcomp.gpt import policy as policy_lib
    from jcomp.train.auto import decide as auto, stepbytes
    from jcomp.train.settings import runspec
    run = runspec.build(settings.uncompressed())
    summary = auto.choose(run, profile, budget, overlap, "planned from shapes")
    paper = policy_lib.preset("hybrid_paper")
    msgs = stepbytes.by_entry(run)
    rows = [("entry", "link", "auto", "raw -> coded /step", "ms", "raw ms", "hybrid_paper", "ms")]
    paper_total = []
    for entry, e in summary["entries"].items():
        axis, _, kind = entry.partition(".")
        codec = str(paper[axis, kind])
        try:
            t = tune.predict(profile, axis, msgs[axis, kind], codec, overlap)
        except ValueError as err:
            raise ValueError(f"the profile cannot price hybrid_paper's {entry}={codec}: {err}")
        paper_total.append(t)
        rows.append((entry, f"{e['latency_s'] * 1e6:.3g} us, {e['bytes_per_s'] / 1e9:.3g} GB/s",
                     e["codec"], f"{_h(e['raw_bytes'])} -> {_h(e['coded_bytes'])}",
                     f"{e['seconds'] * 1e3:.4g}", f"{e['raw_seconds'] * 1e3:.4g}", codec,
                     f"{t * 1e3:.4g}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    sizes = ", ".join(f"{a}={n}" for a, n in run.mesh_sizes().items())
    lines = [f"compression.auto plan: {run.model.n_layers} layers, d_model {run.model.d_model}, "
             f"{jnp.dtype(run.model.compute_dtype).name}; mesh {sizes}; profile: {profile.device}"]
    lines += ["  " + "  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows]
    raw, now, hp = summary["raw_seconds"], summary["seconds"], math.fsum(paper_total)
    lines.append(f"predicted communication per step (overlap {overlap:g}): "
                 f"auto {now * 1e3:.4g} ms, "
                 f"hybrid_paper {hp * 1e3:.4g} ms, uncompressed {raw * 1e3:.4g} ms "
                 f"(auto {now / raw:.2f}x, hybrid_paper {hp / raw:.2f}x of uncompressed)")
    std = math.fsum(tune.predict(profile, axis, t, "none", overlap)
                    for (axis, _), t in standard_bf16(run).items())
    lines.append(f"baselines: uncompressed = jcomp's step (float32 gradients and masters, "
                 f"embedding and head on every stage, output all-reduce) {raw * 1e3:.4g} ms; "
                 f"standard bf16 step (bf16 gradients and parameters, embedding and head "
                 f"on one stage each) {std * 1e3:.4g} ms: auto {now / std:.2f}x, "
                 f"hybrid_paper {hp / std:.2f}x of standard bf16")
    lines.append("Bytes from shapes (jcomp.train.auto.stepbytes); times from the profile "
                 "(jcomp.tune.choose's model); compute, congestion and loss are not modelled.")
    return "\n".join(lines)


# The messages a standard pipeline step does not send: jcomp's last stage
# all-reduces its output over the pipeline axis (and its gradient back), where
# a standard step keeps the loss on the last stage.
_OUTPUT_SUMS = ("last_stage_sum", "first_stage_grad")
# Sent by the stage holding the embedding (or head) only, in a standard step.
_ONE_STAGE = ("embed_sum", "head_entry_grad")


def standard_bf16(run) -> dict:
    """{(mesh axis, kind): tune.Traffic} of a standard bf16 step of `run`'s model
    and mesh (uncompressed): gradients reduced and parameters gathered in bf16,
    the leaves jcomp keeps on every pipeline stage (embedding, head, final norm)
    on one stage each, no pipeline output all-reduce; tensor and pipeline sends
    as jcomp's. Per device per step, averaged over the mesh as
    jcomp.train.auto.stepbytes counts."""
    import dataclasses

    from jcomp.train.auto import stepbytes
    p = run.plan_sizes().get("pipeline", 1)
    groups = stepbytes.param_groups(run)
    staged = sum(b for axes, b in groups.items() if "pipeline" in axes)
    everywhere = sum(b for axes, b in groups.items() if "pipeline" not in axes)
    # bf16 instead of float32, and each everywhere-leaf on 1 of p stages.
    data_share = 0.5 * (staged + everywhere / p) / (staged + everywhere) \
        if staged + everywhere else 0.0
    per = stepbytes.by_message(run)
    plan = run.plan(run.phases[-1][1])
    entry = {m.name: m.entry for m in plan.messages()}
    jcomp_msgs = stepbytes.by_entry(run)
    sums: dict = {}
    for name, (nbytes, count, _, _) in per.items():
        key = tuple(entry[name].partition(".")[::2])
        if name in _OUTPUT_SUMS:
            nbytes, count = 0.0, 0.0
        elif name in _ONE_STAGE:
            nbytes, count = nbytes / p, count / p
        elif key[0] in ("data", "dcn"):
            nbytes = nbytes * data_share
        b, c = sums.get(key, (0.0, 0.0))
        sums[key] = (b + nbytes, c + count)
    out = {}
    for key, (nbytes, count) in sums.items():
        t = jcomp_msgs[key]
        dtype = "bfloat16" if key[0] in ("data", "dcn") else t.dtype
        out[key] = dataclasses.replace(t, raw_bytes=float(nbytes), collectives=float(count),
                                       dtype=dtype)
    return out


def _h(n):
    from jcomp.train.run.traffic import human
    return human(n)


# The most devices a plan resolves a config for: over ten times the largest
# GPU clusters built. Sizes derived from more only make every count slower.
MAX_DEVICES = 1 << 20


class _Parser(argparse.ArgumentParser):
    """argparse, with its errors in one line (its usage text makes several)."""

    def error(self, message):
        sys.exit(_error(message))


def _error(message: str) -> int:
    print(f"plan: error: {message.splitlines()[0] if message else 'bad input'}",
          file=sys.stderr)
    return 2


def main(argv=None) -> int:
    p = _Parser(prog="python -m jcomp.train.plan", description=__doc__.splitlines()[0])
    p.add_argument("--profile", required=True, help="a profile JSON (jcomp.tune.save)")
    p.add_argument("--config", required=True, help="a trainer config file, e.g. configs/neox20b.py")
    p.add_argument("--devices", type=int, default=192)
    p.add_argument("--mesh", default="", help="mesh sizes to set, e.g. data=6,dcn_data=2")
    p.add_argument("--budget", default=None, help="as compression.budget (default: the config's)")
    p.add_argument("--overlap", type=float, default=None,
                   help="as compression.overlap (default: the config's)")
    args = p.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # shapes only: no accelerator is used
    try:
        from jcomp.train.auto import basis as auto_basis
        from jcomp.train.settings import auto as auto_settings
        from jcomp.train.settings import runspec
        if not 1 <= args.devices <= MAX_DEVICES:
            raise ValueError(f"--devices={args.devices}; allowed: 1 to {MAX_DEVICES}")
        profile = auto_basis.load_profile(args.profile, "--profile")
        cfg = _config(args.config)
        for axis, size in _mesh_sizes(list(cfg.mesh), args.mesh).items():
            cfg.mesh[axis] = size
        budget = auto_settings.parse_budget(
            cfg.compression.get("budget", "") if args.budget is None else args.budget)
        overlap = auto_settings.check_overlap(
            cfg.compression.get("overlap", 0.0) if args.overlap is None else args.overlap)
        text = plan_text(runspec.read(cfg, args.devices), profile, budget, overlap)
    except (ValueError, TypeError, OSError) as e:
        return _error(str(e) or type(e).__name__)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
