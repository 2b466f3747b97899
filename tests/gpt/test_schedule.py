"""Compression schedules: parsing, the policy in force at each step, and a tiny
training run whose collectives switch from uncompressed to compressed on time."""
import dataclasses
import json
import logging
import os
import subprocess
import sys

import pytest

from jcomp import codecs

from jcomp.gpt import hyperparams, messages, zero
from jcomp.gpt import policy as jpolicy
from jcomp.gpt import schedule

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HYBRID = jpolicy.preset("hybrid_paper")


def codec(pol, key):
    return str(pol[tuple(key.split("."))])


def tiny_config():
    if ROOT not in sys.path:  # configs/ is a package at the repository root
        sys.path.insert(0, ROOT)
    from configs import tiny
    return tiny.get_config()


# ------------------------------------------------------------------ parsing

def test_parse_keeps_items_in_order_and_bare_steps_as_the_base_codec():
    sched = schedule.parse({"data.grad": " bf16@0, int8@200 ,int4@1000", "tensor.act": "@500",
                            "pipeline.act": ""})
    assert str(sched) == "data.grad=bf16@0,int8@200,int4@1000; tensor.act=@500"
    assert [(a, k) for a, k, _ in sched.entries] == [("data", "grad"), ("tensor", "act")]
    assert schedule.change_steps(sched) == [200, 500, 1000]


BAD = [
    ({"data.grad": "int3@10"}, ValueError, "compression.schedule.data.grad", "unknown codec"),
    ({"data.grad": "int8@100,int4@100"}, ValueError, "compression.schedule.data.grad",
     "strictly increase"),
    ({"data.grad": "int8@100,int4@50"}, ValueError, "compression.schedule.data.grad",
     "strictly increase"),
    ({"tensor.act": "int8@-3"}, ValueError, "compression.schedule.tensor.act", ">= 0"),
    ({"tensor.act": "int8@1.5"}, ValueError, "compression.schedule.tensor.act", "not an integer"),
    ({"tensor.act": "int8"}, ValueError, "compression.schedule.tensor.act", "CODEC@STEP"),
    ({"tensor.act": "int8@1,"}, ValueError, "compression.schedule.tensor.act", "CODEC@STEP"),
    ({"tensor.act": "powersgd:rank=2@5"}, ValueError, "compression.schedule.tensor.act",
     "data.grad"),
    ({"data.grad": "int8@0,powersgd:rank=2@5"}, ValueError, "compression.schedule.data.grad",
     "only item"),
    ({"data.grad": "powersgd:rank=2@5,int8@9"}, ValueError, "compression.schedule.data.grad",
     "only item"),
    ({"data.gradient": "@5"}, ValueError, "compression.schedule.data.gradient", "no message of the step"),
    ({"data.grad": 5}, TypeError, "compression.schedule.data.grad", "string"),
]


@pytest.mark.parametrize("specs,error,field,why", BAD)
def test_parse_rejects_with_the_field_named(specs, error, field, why):
    with pytest.raises(error) as e:
        schedule.parse(specs, prefix="compression.")
    assert field in str(e.value) and why in str(e.value), str(e.value)


def test_a_bare_start_on_a_powersgd_base_must_be_the_only_item():
    base = jpolicy.build("hybrid_paper", {"data.grad": "powersgd:rank=2"})
    schedule.parse({"data.grad": "@5"}, base=base)  # a plain start step is fine
    with pytest.raises(ValueError, match="only item"):
        schedule.parse({"data.grad": "int8@0,@5"}, base=base)
    schedule.parse({"data.grad": "int8@0,@5"}, base=HYBRID)  # int4 base: no state of its own


def test_warmup_steps_is_a_start_step_on_every_entry_without_a_schedule():
    warm = schedule.parse({"data.grad": "int8@10,@20"}, warmup_steps=10)
    for a, k, items in warm.entries:
        assert items == (((10, None),) if (a, k) != ("data", "grad") else
                         ((10, codecs.parse("int8")), (20, None)))
    assert len(warm.entries) == len(jpolicy.MESSAGES)
    assert schedule.policy_at(HYBRID, warm, 9) == jpolicy.uniform("none", error_feedback=True)
    assert schedule.policy_at(HYBRID, warm, 20) == HYBRID
    with pytest.raises(ValueError, match=r"schedule\.tensor\.act.*warmup_steps=10"):
        schedule.parse({"tensor.act": "int8@5"}, warmup_steps=10)
    with pytest.raises(TypeError, match="warmup_steps"):
        schedule.parse({}, warmup_steps=True)


# ------------------------------------------------------- policy in force

def test_policy_at_switches_exactly_at_each_step():
    sched = schedule.parse({"data.grad": "bf16@0,int8@200,int4@1000", "tensor.act": "@50"})
    want = {0: ("bf16", "none"), 49: ("bf16", "none"), 50: ("bf16", "int8"),
            199: ("bf16", "int8"), 200: ("int8", "int8"), 999: ("int8", "int8"),
            1000: ("int4", "int8"), 10**9: ("int4", "int8")}
    for step, (grad, act) in want.items():
        pol = schedule.policy_at(HYBRID, sched, step)
        assert (codec(pol, "data.grad"), codec(pol, "tensor.act")) == (grad, act), step
        assert codec(pol, "data.param") == "int8" and pol.error_feedback  # unscheduled: base
    assert schedule.final_policy(HYBRID, sched) == HYBRID
    with pytest.raises(ValueError, match="step"):
        schedule.policy_at(HYBRID, sched, -1)


def test_phases_skip_changes_that_change_nothing():
    sched = schedule.parse({"data.grad": "int8@3,int8@5,int4@7"})
    got = [(s, codec(p, "data.grad")) for s, p in schedule.phases(HYBRID, sched)]
    assert got == [(0, "none"), (3, "int8"), (7, "int4")]
    phases = schedule.phases(HYBRID, sched)
    assert [codec(schedule.phase_at(phases, i), "data.grad") for i in (0, 2, 3, 6, 7, 99)] == \
        ["none", "none", "int8", "int8", "int4", "int4"]
    assert schedule.changes(phases[0][1], phases[1][1]) == "data.grad=none->int8"
    assert not schedule.is_compressed(jpolicy.preset("baseline"))
    assert schedule.is_compressed(phases[1][1])


def test_apply_updates_refuses_a_phase_powersgd_the_state_was_not_built_for():
    """Checked before any collective runs: outside shard_map is enough."""
    sizes = {"data": 2, "tensor": 1, "pipeline": 1}
    plan_of = lambda overrides: messages.plan(jpolicy.build("baseline", overrides), 1, sizes)
    layout = zero.for_plan(plan_of({"data.grad": "powersgd:rank=2"}))
    zstate = {"master": {}, "opt": (), "psgd_q": {}}
    kw = dict(tx=None, layout=layout, param_specs={})
    with pytest.raises(ValueError, match="PowerSGD state"):
        zero.apply_updates({}, {}, zstate, plan=plan_of({"data.grad": "powersgd:rank=4"}), **kw)
    # A plan's parameter gather cannot hold PowerSGD (the policy refuses it);
    # the optimizer checks it again for a plan built by hand.
    bad = plan_of({"data.grad": "powersgd:rank=2"})
    bad = dataclasses.replace(bad, param_gather=dataclasses.replace(
        bad.param_gather, codecs=(bad.grad_reduce.codec,)))
    with pytest.raises(ValueError, match="param_gather"):
        zero.apply_updates({}, {}, zstate, plan=bad, **kw)


@pytest.mark.parametrize("override,field,why", [
    ("schedule.data.grad=int8@10,int4@5", "compression.schedule.data.grad", "strictly increase"),
    ("layers.tensor.act=1-2", "compression.layers.tensor.act=2", "has 2 layers"),
    ("stages.pipeline.act=0-", "compression.stages.pipeline.act", "N or N-M"),
    ("stages.data.grad=0", "--config.compression.stages.data.grad", "has no field 'data'")])
@pytest.mark.e2e
def test_train_py_rejects_a_bad_schedule_or_place_in_one_line(tmp_path, override, field, why):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [sys.executable, "train.py", "--config=configs/tiny.py", f"--workdir={tmp_path / 'w'}",
         "--config.compression.policy=hybrid", f"--config.compression.{override}"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [l for l in proc.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and field in lines[0] and why in lines[0], proc.stderr
    assert not (tmp_path / "w").exists()


# ------------------------------------------------------------ training run

def _tiny(steps, layers_tensor_act="", **schedule_specs):
    cfg = tiny_config()
    cfg.train.update(steps=steps, log_every=1)
    cfg.data.update(val_permille=0)  # no eval: only the train-step variants compile
    cfg.checkpoint.update(every=100)
    cfg.optim.update(warmup_steps=0)
    # Without residuals the state layout is the plain run's, so every byte compares.
    cfg.compression.update(policy="baseline", error_feedback="off")
    cfg.compression.layers.tensor.act = layers_tensor_act
    for key, spec in schedule_specs.items():
        axis, kind = key.split("__")
        cfg.compression.schedule[axis][kind] = spec
    return cfg


def _records(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return {r["step"]: r for r in map(json.loads, f)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A plain uncompressed run, and the same with data.grad compressed from step
    index 1 (record 2) and tensor.act from index 2 (record 3), in layer 1 only
    (pipeline stage 1 of 2: stage 0 sends its tensor all-reduces raw). The
    scheduled run saves at steps 2 and 3."""
    from jcomp.train import loop as trainer
    base_dir = str(tmp_path_factory.mktemp("plain"))
    trainer.train_and_evaluate(_tiny(1), base_dir)
    sched_dir = str(tmp_path_factory.mktemp("scheduled"))
    handler = _Lines()
    log = logging.getLogger(trainer.__name__)
    old = log.level
    log.setLevel(logging.INFO)
    log.addHandler(handler)
    cfg = _tiny(3, layers_tensor_act="1", data__grad="bf16@1", tensor__act="int8@2")
    cfg.checkpoint.update(every=2)
    try:
        trainer.train_and_evaluate(cfg, sched_dir)
    finally:
        log.removeHandler(handler)
        log.setLevel(old)
    return _records(base_dir)[1], _records(sched_dir), handler.lines, (cfg, sched_dir)


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


@pytest.mark.e2e
def test_collectives_stay_uncompressed_until_each_entry_starts(runs):
    plain, rec, _, _ = runs
    wire = lambda r: (r["wire_bytes_data"], r["wire_bytes_tensor"], r["wire_bytes_pipeline"])
    d0, t0, p0 = wire(plain)
    assert wire(rec[1]) == (d0, t0, p0)
    d1, t1, p1 = wire(rec[2])
    assert d1 < d0 and (t1, p1) == (t0, p0)
    d2, t2, p2 = wire(rec[3])
    assert d2 == d1 and t2 < t0 and p2 == p0
    # Stage 1's layer compresses inside a conditional on the stage: charged to the
    # devices that take each branch, not counted as if both ran.
    assert "conditional" not in rec[3].get("wire_notes", ""), rec[3]["wire_notes"]


@pytest.mark.e2e
def test_each_phase_is_named_in_metrics_and_the_log_on_its_first_step(runs):
    _, rec, lines, _ = runs
    assert [rec[s].get("compression") for s in (1, 2, 3)] == [
        "none", "data.grad_reduce=bf16",
        # The embedding's all-reduce reads tensor.act too, in every layer selection.
        "data.grad_reduce=bf16 tensor.embed_sum=int8 tensor.block_exit=int8[layers 1]"]
    assert [rec[s].get("compression_changes") for s in (1, 2, 3)] == [
        None, "data.grad=none->bf16", "tensor.act=none->int8"]
    assert [rec[s]["compressed"] for s in (1, 2, 3)] == [False, True, True]
    assert any("step 2" in l and "data.grad=none->bf16" in l for l in lines), lines
    assert any("step 3" in l and "tensor.act=none->int8" in l for l in lines), lines



@pytest.mark.e2e
def test_resuming_mid_schedule_enters_the_phase_in_force_and_retraces_the_run(runs):
    """Resumed from step 2 (data.grad=bf16 since index 1), the next step is the
    one where tensor.act starts: it compiles that phase and reproduces the
    uninterrupted run's record bit for bit."""
    import shutil

    from jcomp.train import loop as trainer
    _, rec, _, (cfg, workdir) = runs
    shutil.rmtree(os.path.join(workdir, "checkpoints", "3"))
    trainer.train_and_evaluate(cfg, workdir)
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        resumed = [json.loads(line) for line in f][len(rec):]
    assert [r["step"] for r in resumed] == [3]
    assert resumed[0]["loss"] == rec[3]["loss"]
    assert resumed[0]["compression"] == rec[3]["compression"]
    assert all(resumed[0][k] == rec[3][k] for k in rec[3] if k.startswith("wire_bytes"))


def test_an_uncompressed_phase_flushes_residuals_into_the_sum():
    """One train step on hybrid's state (residuals present) in the phase before
    data.grad starts: the residuals it starts with are sent in full and none remain."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding

    from jcomp.gpt import mesh as mesh_lib
    from jcomp.gpt import model as gpt
    from jcomp.gpt import sharding, step
    model_cfg = gpt.ModelConfig(**tiny_config().model.to_dict())
    mesh = mesh_lib.make_mesh((2, 2, 2))
    tx = hyperparams.make_tx(lr=1e-2, warmup_steps=0, total_steps=10)
    params = gpt.init_params(model_cfg, jax.random.key(0))
    shapes = jax.eval_shape(lambda: params)
    layout = zero.for_plan(messages.plan(HYBRID, model_cfg.n_layers, dict(mesh.shape)))
    state = step.init_state(params, mesh, tx, layout)
    state["zero"]["ef"] = jax.tree.map(lambda r: r + 0.5, state["zero"]["ef"])
    phase = schedule.policy_at(HYBRID, schedule.parse({"data.grad": "@5"}), 0)
    plan = messages.plan(phase, model_cfg.n_layers, dict(mesh.shape))
    fn = step.make_train_step(model_cfg, mesh, plan, tx, shapes, layout=layout, microbatches=2,
                              clip_norm=1.0)
    rows = np.random.default_rng(0).integers(0, model_cfg.vocab_size, (8, 33), np.int32)
    batch = jax.device_put(rows, NamedSharding(mesh, sharding.BATCH_SPEC))
    new, m = fn(state, batch)
    assert bool(m["finite"]) and float(m["ef_norm"]) == 0.0
    assert all(not jnp.any(r) for r in jax.tree.leaves(new["zero"]["ef"]))



def test_a_set_dcn_entry_starts_with_its_data_entry():
    """dcn entries take no schedule: a set one sends none until its data entry's
    schedule (or the warm-up) starts; an unset one is the data entry."""
    base = jpolicy.preset("baseline").replace({"data.grad": "int8", "dcn.grad": "int4"})
    ph = schedule.phases(base, schedule.parse({}, base=base, warmup_steps=3))
    assert [(s, str(p["data", "grad"]), str(p["dcn", "grad"])) for s, p in ph] == [
        (0, "none", "none"), (3, "int8", "int4")]
    assert schedule.changes(ph[0][1], ph[1][1]) == "data.grad=none->int8 dcn.grad=none->int4"
    assert schedule.is_compressed(jpolicy.preset("baseline").replace({"dcn.grad": "int4"}))
    unset = jpolicy.preset("baseline").replace({"data.grad": "int8"})
    ph = schedule.phases(unset, schedule.parse({"data.grad": "bf16@0,int8@5"}, base=unset))
    assert [str(p["dcn", "grad"]) for _, p in ph] == ["bf16", "int8"]
    assert schedule.changes(ph[0][1], ph[1][1]) == "data.grad=bf16->int8"
