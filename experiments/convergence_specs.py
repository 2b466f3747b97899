"""The runs of experiments/convergence.py: every setting a suite trains, and the
train.py flags and workdir name of one run.

run_specs() lists every known run (its suite, the plot group it belongs to, the
compression policy, per-axis codec overrides, error feedback and any extra
train.py flags); select() picks a suite's runs, the baseline always first;
train_args() and workdir_name() turn one run at one seed into train.py's flags
and its folder under --out. The suites are described in convergence.py's
module doc.
"""
from __future__ import annotations

SUITES = ("main", "ablation", "sweep", "variants", "places", "seeds", "ef", "hops", "outer")
GRAD_SWEEP = ("int8", "int4", "int4:rot", "int2", "topk:0.1", "topk:0.01")
ACT_SWEEP = ("int8", "int4", "int2")
PSGD = "powersgd:rank=4"
PLACES_CODEC = "int2"
AE_DIM = 32  # a quarter of configs/base.py's d_model: int8's byte ratio, in float32


def _tp_act(spec: str) -> dict:
    return {f"{a}.{k}": spec for a in ("tensor", "pipeline") for k in ("act", "act_grad")}


# (every, fragments, codec, error feedback, slug, outer lr, outer momentum[, delay]) of the
# outer suite's runs. sparseloco_k* are the runs made with the uint16-position,
# three-level coder (coder=index), sparseloco_packed_k* those of the packed one. The outer step is the islands' mean (lr 1, no momentum):
# at H=10, the first 120 steps of seed 0 reached val_loss 1.970 so, against
# 2.090 with Nesterov momentum 0.5 and 2.084 with DiLoCo's (lr 0.7, momentum
# 0.9), whose two "nesterov" runs here show what it does over 600 steps.
OUTER_RUNS = tuple((h, 1, codec, ef, slug, 1.0, 0.0) for h in (10, 50)
                   for codec, ef, slug in (("none", "off", "none"), ("int4:rot", "off", "int4rot"),
                                           ("topk:0.03", "on", "topk3_ef"))) \
    + tuple((h, 2, "int4:rot", "off", "int4rot", 1.0, 0.0) for h in (50, 10)) \
    + tuple((10, 1, f"sparseloco:k={k}:chunk=4096:beta=0.95:coder=index", "on",
             f"sparseloco_k{k}", 1.0, 0.0) for k in (64, 256)) \
    + tuple((10, 1, f"sparseloco:k={k}:chunk=4096:beta=0.95", "on",
             f"sparseloco_packed_k{k}", 1.0, 0.0) for k in (128, 256)) \
    + tuple((10, 1, codec, "off", f"nesterov_{slug}", 0.7, 0.9)
            for codec, slug in (("none", "none"), ("int4:rot", "int4rot"))) \
    + tuple((10, 1, "none", "off", f"lr{lr:g}_m{m:g}_none", lr, m)
            for lr, m in ((0.5, 0.5), (0.3, 0.7), (1.0, 0.9)))
# Streaming SparseLoCo (packed coder, k=256): 2 fragments synced in turn, each
# merged at once (delay 0) or one step after its sync started (delay 1, the
# islands keeping outer.mix=0.5 of their own).
OUTER_RUNS = tuple(r + (0,) for r in OUTER_RUNS) + tuple(
    (10, 2, "sparseloco:k=256:chunk=4096:beta=0.95", "on", "sparseloco_packed_k256", 1.0, 0.0, d)
    for d in (0, 1))
# The outer lr x momentum table (docs/experiments.md) is outer_h10_none (lr 1,
# momentum 0), the nesterov_none run (DiLoCo's 0.7, 0.9) and these three.
SGD_FLAGS = ("--config.optim.name=sgd", "--config.optim.lr=0.3")
EF_RUNS = ("baseline", "grad_int4_efon", "grad_int4_efoff")
PAPER_HYBRID = {"data.grad": "int4", "data.param": "int8", **_tp_act("int8")}
# The settings the README's loss claims rest on, run at several seeds.
SEED_RUNS = ("baseline", "naive", "hybrid_paper", "hybrid_grad_int8_tensor_ag_int4",
             "grad_int4_efoff", "grad_int4rot_efoff", "hybrid_rot4", "hybrid_rot4_grad_rot4",
             "hybrid_rot4_pipe_int8", "mx_mxfp4rot", "mx_nvfp4", "mx_nvfp4rot")


def run_specs() -> list[dict]:
    """Every known run: {name, suite, group, policy, overrides {"axis.kind": codec},
    error_feedback "auto"|"on"|"off"}. `group` names the plot a run belongs to."""
    runs = [dict(name=p, suite="main", group="main", policy=p, overrides={}, error_feedback="auto")
            for p in ("baseline", "naive", "hybrid")]
    # The CCGrid 2024 recipe, spelled out so that the name keeps its meaning
    # whatever the hybrid preset becomes.
    runs.append(dict(name="hybrid_paper", suite="main", group="main", policy="baseline",
                     overrides=PAPER_HYBRID, error_feedback="on"))
    for axis, ov in (("data", {"data.grad": "int4", "data.param": "int8"}),
                     ("tensor", {"tensor.act": "int8", "tensor.act_grad": "int8"}),
                     ("pipeline", {"pipeline.act": "int8", "pipeline.act_grad": "int8"})):
        runs.append(dict(name=f"only_{axis}", suite="ablation", group="ablation", policy="baseline",
                         overrides=ov, error_feedback="on" if axis == "data" else "off"))
    for spec in GRAD_SWEEP:
        for ef in ("on", "off"):
            runs.append(dict(name=f"grad_{_slug(spec)}_ef{ef}", suite="sweep", group="sweep_grad",
                             policy="baseline", overrides={"data.grad": spec}, error_feedback=ef))
    runs.append(dict(name=f"grad_{_slug(PSGD)}", suite="sweep", group="sweep_grad",
                     policy="baseline", overrides={"data.grad": PSGD}, error_feedback="on"))
    for spec in ACT_SWEEP:
        runs.append(dict(name=f"act_{_slug(spec)}", suite="sweep", group="sweep_act",
                         policy="baseline", overrides=_tp_act(spec), error_feedback="off"))
    # The learned autoencoder codes tensor activations (and their gradients) only.
    runs.append(dict(name=f"act_ae{AE_DIM}", suite="sweep", group="sweep_act", policy="baseline",
                     overrides={f"tensor.{k}": f"ae:dim={AE_DIM}" for k in ("act", "act_grad")},
                     error_feedback="off"))
    # hybrid with other data-gradient codecs: the candidates for a hybrid that keeps
    # the baseline's loss within a quarter of its bytes.
    for name, extra, ef in (("hybrid_psgd", {"data.grad": PSGD}, "on"),
                            ("hybrid_grad_int8", {"data.grad": "int8"}, "off"),
                            ("hybrid_grad_int8_pipe_ag_int4",
                             {"data.grad": "int8", "pipeline.act_grad": "int4"}, "off"),
                            ("hybrid_grad_int8_tensor_ag_int4",
                             {"data.grad": "int8", "tensor.act_grad": "int4"}, "off")):
        runs.append(dict(name=name, suite="variants", group="main", policy="baseline",
                         overrides={**PAPER_HYBRID, **extra}, error_feedback=ef))
    # Which layers and stages to compress: int2 (strong enough to hurt in a short
    # run) everywhere on one axis, then on half of its layers or stages.
    half = {"tensor": ("layers", ("0-1", "2-3")), "pipeline": ("stages", ("0", "1"))}
    for axis, (place, parts) in half.items():
        codec = {f"{axis}.{k}": PLACES_CODEC for k in ("act", "act_grad")}
        runs.append(dict(name=f"{axis}_{PLACES_CODEC}", suite="places", group="places",
                         policy="baseline", overrides=codec, error_feedback="off"))
        for part in parts:
            where = {f"{place}.{axis}.{k}": part for k in ("act", "act_grad")}
            runs.append(dict(name=f"{axis}_{PLACES_CODEC}_{place}_{part}", suite="places",
                             group="places", policy="baseline", overrides={**codec, **where},
                             error_feedback="off"))
    # Error feedback: a warm-up before compression, and a linear optimizer.
    for ef in ("on", "off"):
        runs.append(dict(name=f"grad_int4_ef{ef}_warm50", suite="ef", group="ef",
                         policy="baseline", overrides={"data.grad": "int4", "warmup_steps": "50"},
                         error_feedback=ef))
    for name, ov, ef in (("sgd_baseline", {}, "auto"), ("sgd_grad_int4_efon", {"data.grad": "int4"}, "on"),
                         ("sgd_grad_int4_efoff", {"data.grad": "int4"}, "off")):
        runs.append(dict(name=name, suite="ef", group="ef", policy="baseline", overrides=ov,
                         error_feedback=ef, extra=SGD_FLAGS))
    # Candidates for the hybrid preset at <= 1/6 of the baseline's bytes: int4 with
    # a Hadamard rotation on every model-parallel message.
    for name, extra in (("hybrid_rot4", {"data.grad": "int8"}),
                        ("hybrid_rot4_grad_rot4", {"data.grad": "int4:rot"})):
        runs.append(dict(name=name, suite="variants", group="main", policy="baseline",
                         overrides={"data.param": "int8", **extra, **_tp_act("int4:rot")},
                         error_feedback="off"))
    # The same with int8 on the pipeline sends, whose int4:rot saves 2% of the
    # baseline's bytes: with it, the network sweep's hybrid was 1.07x the
    # baseline's step on an unthrottled link (0158114), where codec time is not
    # hidden behind transfer.
    runs.append(dict(name="hybrid_rot4_pipe_int8", suite="variants", group="main",
                     policy="baseline", error_feedback="off",
                     overrides={"data.param": "int8", "data.grad": "int4:rot",
                                "tensor.act": "int4:rot", "tensor.act_grad": "int4:rot",
                                "pipeline.act": "int8", "pipeline.act_grad": "int8"}))
    # Microscaling formats on the 4-bit messages, at <= 1/6 of the baseline's
    # bytes. All-MX: mxfp4 data gradients, mxfp4:rot tensor messages, mxfp8
    # pipeline sends. NVFP4 (4.75 bits per element on rows of 128, with its
    # f32 row scale, against int4:rot's 4.25) fits 1/6 only with the pipeline's
    # backward sends in nvfp4 too; its two settings differ only in :rot.
    runs.append(dict(name="mx_mxfp4rot", suite="variants", group="main", policy="baseline",
                     error_feedback="off",
                     overrides={"data.param": "int8", "data.grad": "mxfp4",
                                "tensor.act": "mxfp4:rot", "tensor.act_grad": "mxfp4:rot",
                                "pipeline.act": "mxfp8", "pipeline.act_grad": "mxfp8"}))
    for name, fp4 in (("mx_nvfp4", "nvfp4"), ("mx_nvfp4rot", "nvfp4:rot")):
        runs.append(dict(name=name, suite="variants", group="main", policy="baseline",
                         error_feedback="off",
                         overrides={"data.param": "int8", "data.grad": "int4:rot",
                                    "tensor.act": fp4, "tensor.act_grad": fp4,
                                    "pipeline.act": "int8", "pipeline.act_grad": "nvfp4"}))
    # Per hop: the data messages coded on the slow hop alone (raw on the fast
    # one) against the same codecs on the whole data axis. The rig's "perhop"
    # policy (experiments/network.py) is hop_perhop.
    flat = {"data.grad": "int4:rot", "data.param": "int8"}
    runs.append(dict(name="hop_flat", suite="hops", group="main", policy="baseline",
                     overrides=flat, error_feedback="off"))
    runs.append(dict(name="hop_perhop", suite="hops", group="main", policy="baseline",
                     overrides={k.replace("data.", "dcn."): v for k, v in flat.items()},
                     error_feedback="off", extra=("--config.mesh.dcn_data=2",)))
    # The most coded of compression.auto's choices at 100 Mbit/s on the two-hop rig
    # (experiments/results/network_auto.json: its three runs chose hop_flat's
    # codecs, this, and this without int8 gradients inside a process).
    runs.append(dict(name="hop_auto100mbit", suite="hops", group="main", policy="baseline",
                     overrides={"data.grad": "int8", "data.param": "int8",
                                "dcn.grad": "int4:rot", "dcn.param": "int8"},
                     error_feedback="off", extra=("--config.mesh.dcn_data=2",)))
    # Its two other choices at 100 Mbit/s with a 6-step trial
    # (experiments/results/network_auto_trial6.json): int4:rot/int8 across with
    # int8 on data.param inside, or on the tensor messages instead.
    across = {"dcn.grad": "int4:rot", "dcn.param": "int8"}
    runs.append(dict(name="hop_auto_param8", suite="hops", group="main", policy="baseline",
                     overrides={"data.param": "int8", **across},
                     error_feedback="off", extra=("--config.mesh.dcn_data=2",)))
    runs.append(dict(name="hop_auto_act8", suite="hops", group="main", policy="baseline",
                     overrides={"tensor.act": "int8", "tensor.act_grad": "int8", **across},
                     error_feedback="off", extra=("--config.mesh.dcn_data=2",)))
    # And both at once, one of its choices with the probe of four sizes
    # (experiments/results/network_auto_sizes4.json).
    runs.append(dict(name="hop_auto_act8_param8", suite="hops", group="main", policy="baseline",
                     overrides={"tensor.act": "int8", "tensor.act_grad": "int8",
                                "data.param": "int8", **across},
                     error_feedback="off", extra=("--config.mesh.dcn_data=2",)))
    # Each route at compression.auto's most compressed default codecs, which its
    # trial now weighs ("as given, fewest bytes" and "per hop (...), fewest
    # bytes"; experiments/results/network_auto_fewest.json).
    act8 = {"tensor.act": "int8", "tensor.act_grad": "int8"}
    runs.append(dict(name="hop_flat_act8", suite="hops", group="main", policy="baseline",
                     overrides={**flat, **act8}, error_feedback="off"))
    runs.append(dict(name="hop_perhop_fewest", suite="hops", group="main", policy="baseline",
                     overrides={**flat, **act8, **across}, error_feedback="off",
                     extra=("--config.mesh.dcn_data=2",)))
    # The outer loop across the same slow hop (jcomp/train/outer/islands.py).
    runs.append(dict(name="hop_raw", suite="outer", group="main", policy="baseline",
                     overrides={}, error_feedback="off", extra=("--config.mesh.dcn_data=2",)))
    for every, fragments, codec, ef, slug, lr, momentum, delay in OUTER_RUNS:
        name = (f"outer_h{every}" + (f"_f{fragments}" if fragments > 1 else "")
                + (f"_d{delay}" if delay else "") + f"_{slug}")
        runs.append(dict(name=name, suite="outer", group="outer", policy="baseline",
                         overrides={}, error_feedback="auto",
                         extra=("--config.mesh.dcn_data=2", f"--config.outer.every={every}",
                                f"--config.outer.fragments={fragments}",
                                f"--config.outer.codec={codec}",
                                f"--config.outer.error_feedback={ef}",
                                f"--config.outer.lr={lr}",
                                f"--config.outer.momentum={momentum}")
                         + ((f"--config.outer.delay={delay}",) if delay else ())))
    return runs


def _slug(spec: str) -> str:
    return spec.replace("powersgd:rank=", "powersgd_r").replace(":", "").replace(".", "p")


def select(suite: str, only=None) -> list[dict]:
    """The runs of `suite` ("all" for every one), baseline always first; `only`
    narrows them to the named runs (baseline stays)."""
    if suite not in SUITES + ("all",):
        raise ValueError(f"suite must be one of {', '.join(SUITES + ('all',))}; got {suite!r}")
    specs = run_specs()
    names = {s["name"] for s in specs}
    for name in only or ():
        if name not in names:
            raise ValueError(f"--only: unknown run {name!r}; known: {', '.join(sorted(names))}")
    def in_suite(s):
        if suite == "all":
            return True
        return s["name"] in {"seeds": SEED_RUNS, "ef": EF_RUNS}.get(suite, ()) or s["suite"] == suite

    chosen = [s for s in specs if s["name"] == "baseline"
              or (in_suite(s) and (not only or s["name"] in only))]
    return chosen


def workdir_name(spec: dict, steps: int, seed: int = 0) -> str:
    return f"{spec['name']}-{steps}steps" + (f"-seed{seed}" if seed else "")


def train_args(spec: dict, config: str, steps: int, eval_every: int, warmup: int,
               seed: int = 0) -> list[str]:
    """train.py's flags for one run (without --workdir)."""
    args = [f"--config={config}", f"--config.seed={seed}", f"--config.train.steps={steps}",
            f"--config.train.eval_every={eval_every}", f"--config.optim.warmup_steps={warmup}",
            f"--config.checkpoint.every={max(steps // 4, min(steps, 10))}",
            f"--config.compression.policy={spec['policy']}",
            f"--config.compression.error_feedback={spec['error_feedback']}"]
    args += [f"--config.compression.{key}={codec}" for key, codec in spec["overrides"].items()]
    return args + list(spec.get("extra", ()))
