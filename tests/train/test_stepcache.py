"""Tests for jcomp.train.state.stepcache: the global batch, and the train and eval
programs kept per compression phase, each built when its phase first comes up.
The builders are stood in for where only the cache is under test; one eval
program of configs/tiny.py is really compiled."""
import types

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding

from jcomp.gpt import mesh as mesh_lib
from jcomp.gpt import model as gpt
from jcomp.gpt import schedule as schedule_lib
from jcomp.gpt import sharding
from jcomp.train.settings import runspec
from jcomp.train.state import stepcache
from tests.train.tinyconfig import tiny_config

def _tiny_run(**overrides):
    return runspec.validate(tiny_config(**overrides), 8)


@pytest.fixture(scope="module")
def run():
    """Two phases: int8 data gradients (an update message) from step 0, then int8
    tensor activations (a forward message) from step 4 as well."""
    return _tiny_run(**{"compression.data.grad": "int8", "compression.tensor.act": "int8",
                        "compression.schedule.tensor.act": "@4"})


@pytest.fixture(scope="module")
def mesh(run):
    return mesh_lib.make_mesh(run.mesh_shape)


# ---------------------------------------------------------------- the global batch

def test_global_batch_is_int32_rows_split_over_data(mesh):
    rows = np.arange(8 * 5).reshape(8, 5)  # int64 here
    batch = stepcache.global_batch(mesh, rows, 8)
    assert batch.shape == (8, 5) and batch.dtype == np.int32
    np.testing.assert_array_equal(np.asarray(batch), rows)
    assert batch.sharding.is_equivalent_to(NamedSharding(mesh, sharding.BATCH_SPEC), 2)
    # data rank r holds rows [4r, 4r + 4), whatever its tensor and pipeline position
    data_axis = mesh.axis_names.index("data")
    rank = {dev: idx[data_axis] for idx, dev in np.ndenumerate(mesh.devices)}
    assert len(batch.addressable_shards) == 8
    for shard in batch.addressable_shards:
        r = rank[shard.device]
        np.testing.assert_array_equal(np.asarray(shard.data), rows[4 * r:4 * r + 4])


# ---------------------------------------------------------------- plans

def test_exact_plan_sends_every_message_of_the_run_uncompressed(run, mesh):
    exact = stepcache.StepCache(run, mesh, None, None).exact_plan()
    assert exact.describe() == "none" and not exact.error_feedback
    # the same model on the same mesh: the same messages exist
    assert [m.name for m in exact.messages()] == [m.name for m in run.plan(run.policy).messages()]
    assert all(not m.compressed() for m in exact.messages())


def test_forward_compressed_only_where_a_forward_message_is_coded(run, mesh):
    steps = stepcache.StepCache(run, mesh, None, None)
    first, last = (p for _, p in run.phases)
    # int8 gradients change the update, not the loss the forward computes
    assert schedule_lib.is_compressed(first) and not steps.forward_compressed(first)
    assert steps.forward_compressed(last)


@pytest.mark.parametrize("entry,forward", [
    ("tensor.act_grad", False),  # backward
    ("pipeline.act", True),  # a stage's activations, sent forward
    ("data.param", False),  # the optimizer's parameter gather
])
def test_forward_compressed_by_entry(mesh, entry, forward):
    run = _tiny_run(**{f"compression.{entry}": "int8"})
    assert stepcache.StepCache(run, mesh, None, None).forward_compressed(run.policy) is forward


# ---------------------------------------------------------------- the cache

def test_train_compiles_each_phase_once_when_it_first_comes_up(run, mesh, monkeypatch):
    built = []

    def make_train_step(model_cfg, mesh_, plan, tx, shapes, **options):
        built.append((model_cfg, mesh_, plan, tx, shapes, options))
        compiled = types.SimpleNamespace(plan=plan)
        lowered = types.SimpleNamespace(compile=lambda: compiled)
        return types.SimpleNamespace(lower=lambda state, batch: lowered)

    monkeypatch.setattr(stepcache.step, "make_train_step", make_train_step)
    monkeypatch.setattr(stepcache.wire, "measure_compiled", lambda exe, m: ("report", exe.plan))
    steps = stepcache.StepCache(run, mesh, "tx", "shapes")
    first, last = (p for _, p in run.phases)
    assert built == [] and steps.train_reports() == {}  # a phase not reached costs nothing
    exe, report = steps.train(first, "state", "batch")
    assert steps.train(first, "state", "batch") == (exe, report) and len(built) == 1
    assert exe.plan == run.plan(first) and report == ("report", run.plan(first))
    assert steps.train_report(first) == report and steps.train_reports() == {first: report}
    steps.train(last, "state", "batch")
    assert steps.train_reports() == {first: report, last: ("report", run.plan(last))}
    steps.train(first, "state", "batch")
    assert [b[2] for b in built] == [run.plan(first), run.plan(last)]
    assert all(b[:2] == (run.model, mesh) and b[3:5] == ("tx", "shapes") for b in built)
    assert all(b[5] == run.step_options() for b in built)


def test_val_loss_is_the_mean_over_global_batches_through_the_phase(run, mesh, monkeypatch):
    built = []

    def make_eval_step(model_cfg, mesh_, plan, shapes, *, microbatches):
        built.append((plan, microbatches))

        def loss(params, batch):  # each batch made global: all 8 rows, split over data
            assert batch.shape == (8, 33)
            assert batch.sharding.is_equivalent_to(NamedSharding(mesh, sharding.BATCH_SPEC), 2)
            return batch[0, 0]  # the batch's value, so the mean is checkable
        return loss

    monkeypatch.setattr(stepcache.step, "make_eval_step", make_eval_step)
    steps = stepcache.StepCache(run, mesh, None, "shapes")
    batches = [np.full((8, 33), 1), np.full((8, 33), 4)]
    assert steps.val_loss(None, "params", batches) == 2.5
    assert steps.val_loss(None, "params", batches[1:]) == 4.0
    last = run.phases[-1][1]
    assert steps.val_loss(last, "params", batches[:1]) == 1.0
    # None: the exact forward; a phase: its own plan; each built once
    assert built == [(steps.exact_plan(), 2), (run.plan(last), 2)]
    assert built[1][0].describe() != "none"


# ---------------------------------------------------------------- one real compile

def _params(shapes, mesh, std, seed=0):
    """Parameters of `shapes` on the mesh: normal(0, std), LayerNorm scales 1."""
    rng = np.random.default_rng(seed)

    def leaf(path, s):
        if std and jax.tree_util.keystr(path).endswith("['scale']"):
            return np.ones(s.shape, s.dtype)
        return (rng.normal(0.0, std, s.shape) if std else np.zeros(s.shape)).astype(s.dtype)

    return sharding.shard_params(jax.tree_util.tree_map_with_path(leaf, shapes), mesh)


def test_exact_val_loss_is_the_mean_loss_of_the_model(run, mesh, monkeypatch):
    """All-zero weights make every logit 0: the loss is ln 256 exactly. Small
    weights (std 0.02, as at initialisation) keep it near ln 256 and differ by
    batch; val_loss is the mean over batches. One program, built once."""
    builds = []
    real = stepcache.step.make_eval_step
    monkeypatch.setattr(stepcache.step, "make_eval_step",
                        lambda *a, **k: builds.append(1) or real(*a, **k))
    shapes = jax.eval_shape(lambda: gpt.init_params(run.model, jax.random.key(0)))
    steps = stepcache.StepCache(run, mesh, None, shapes)
    rng = np.random.default_rng(0)
    a, b = (rng.integers(0, 256, (8, run.data.seq_len + 1)) for _ in range(2))
    assert steps.val_loss(None, _params(shapes, mesh, 0.0), [a, b]) == pytest.approx(
        np.log(256), abs=1e-5)
    small = _params(shapes, mesh, 0.02)
    both = steps.val_loss(None, small, [a, b])
    alone = [steps.val_loss(None, small, [x]) for x in (a, b)]
    assert abs(both - np.log(256)) < 0.05
    assert alone[0] != alone[1] and both == pytest.approx(np.mean(alone), rel=1e-12)
    assert builds == [1]
