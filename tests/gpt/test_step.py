"""jcomp.gpt.step: the train step's randomness (codecs that draw random numbers get a
per-step, per-device key: deterministic runs that resume bit for bit) and its messages.
The hybrid step's message count against the baseline's: experiments/checks/test_step_long.py."""
import os
import shutil

import pytest

from tests.train.test_train import ROOT, TINY, losses, run

RANDOM = ["--config.compression.data.grad=randk:0.1", "--config.compression.error_feedback=on",
          "--config.compression.data.param=int8:sr"]


@pytest.mark.e2e
def test_random_codecs_train_and_resume_bitwise(tmp_path):
    """randk:0.1 gradients (with feedback) and stochastically rounded int8 parameter
    gathers: the run trains, and a resume from step 4 repeats steps 5..8 exactly."""
    full = str(tmp_path / "full")
    proc = run(full, *TINY, *RANDOM)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = losses(full)
    assert sorted(got) == list(range(1, 9)) and got[8] < got[1], got
    resumed = str(tmp_path / "resumed")
    shutil.copytree(full, resumed)
    shutil.rmtree(os.path.join(resumed, "checkpoints", "8"))
    os.remove(os.path.join(resumed, "metrics.jsonl"))
    proc = run(resumed, *TINY, *RANDOM)
    assert proc.returncode == 0, proc.stderr[-3000:]
    again = losses(resumed)
    assert sorted(again) == [5, 6, 7, 8], "did not resume from step 4"
    assert all(again[s] == got[s] for s in again), (again, got)


@pytest.mark.e2e
def test_random_codec_inside_the_model_is_refused_before_the_workdir(tmp_path):
    workdir = tmp_path / "never"
    proc = run(str(workdir), *TINY, "--config.compression.tensor.act=int8:sr")
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "compression.tensor.act" in lines[0] and "data.grad" in lines[0], \
        proc.stderr
    assert not workdir.exists()


def _compiled_report(pol_name, **kw):
    """WireReport of configs/tiny.py's train step on (2, 2, 2)."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding

    from configs import tiny
    from jcomp.gpt import mesh as jmesh
    from jcomp.gpt import model as gpt
    from jcomp.gpt import hyperparams, messages, sharding, step, zero
    from jcomp.meter import wire
    from jcomp.gpt import policy as policy_lib

    cfg = tiny.get_config()
    model_cfg = gpt.ModelConfig(**cfg.model.to_dict())
    mesh = jmesh.make_mesh((2, 2, 2))
    pol = policy_lib.preset(pol_name)
    tx = hyperparams.make_tx(lr=1e-3, warmup_steps=0, total_steps=10)
    params = gpt.init_params(model_cfg, jax.random.key(0))
    shapes = jax.eval_shape(lambda: params)
    plan = messages.plan(pol, model_cfg.n_layers, dict(mesh.shape))
    layout = zero.for_plan(plan, stage=1)
    state = jax.eval_shape(lambda: step.init_state(params, mesh, tx, layout))
    state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s.sharding),
                         state, step.abstract_state(shapes, mesh, tx, layout))
    batch = jax.ShapeDtypeStruct((cfg.train.batch_size, cfg.data.seq_len + 1), np.int32,
                                 sharding=NamedSharding(mesh, sharding.BATCH_SPEC))
    fn = step.make_train_step(model_cfg, mesh, plan, tx, shapes, layout=layout, microbatches=2,
                              clip_norm=1.0, **kw)
    return wire.measure_compiled(fn.lower(state, batch).compile(), mesh)


def _tiny_steps(dcn, n=2):
    """configs/tiny.py's train step on (4, 2, 1) split into dcn_data=dcn hops,
    every codec none, n steps on one batch -> (losses, params as numpy)."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding

    from configs import tiny
    from jcomp.gpt import hyperparams, messages, sharding, step, zero
    from jcomp.gpt import mesh as jmesh
    from jcomp.gpt import model as gpt
    from jcomp.gpt import policy as policy_lib

    cfg = tiny.get_config()
    model_cfg = gpt.ModelConfig(**cfg.model.to_dict())
    mesh = jmesh.make_mesh((4, 2, 1), dcn_data=dcn)
    tx = hyperparams.make_tx(lr=1e-2, warmup_steps=0, total_steps=10)
    params = gpt.init_params(model_cfg, jax.random.key(0))
    plan = messages.plan(policy_lib.preset("baseline"), model_cfg.n_layers, dict(mesh.shape))
    layout = zero.for_plan(plan, stage=1)
    state = jax.block_until_ready(step.init_state(params, mesh, tx, layout))
    fn = step.make_train_step(model_cfg, mesh, plan, tx, jax.eval_shape(lambda: params),
                              layout=layout, microbatches=2, clip_norm=1.0)
    rows = np.random.default_rng(0).integers(0, model_cfg.vocab_size, (8, 33), np.int32)
    batch = jax.device_put(rows, NamedSharding(mesh, sharding.batch_spec(plan.data_axes)))
    losses = []
    for _ in range(n):
        state, m = fn(state, batch)
        losses.append(float(m["loss"]))  # waiting on each step (emulated devices)
    return losses, jax.tree.map(np.asarray, state["params"])


def _two_hop_steps_in_a_child(tmp_path, n=2):
    """_tiny_steps(2, n) in a child process -> (losses, params as numpy), or the
    test fails with the child's stderr. A child, because XLA's CPU runtime ends
    the process when a collective waits too long, and that must fail a test
    rather than end the test worker."""
    import subprocess
    import sys

    import numpy as np

    out = str(tmp_path / "two_hops.npz")
    code = ("import sys, jax, numpy as np; sys.path.insert(0, %r); "
            "from tests.gpt.test_step import _tiny_steps; losses, params = _tiny_steps(2, %d); "
            "np.savez(%r, np.asarray(losses), *jax.tree.leaves(params))") % (ROOT, n, out)
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    z = np.load(out)
    return list(z["arr_0"]), [z[f"arr_{i}"] for i in range(1, len(z.files))]


@pytest.mark.slow
def test_two_hop_step_runs_150_steps_without_stopping(tmp_path):
    """The two-hop step (tiny model, 2 microbatches, (dcn 2, data 2, tensor 2))
    for 150 steps in one process, under the XLA_FLAGS the suite and train.py
    set (jcomp/collectives/cpu.py). With XLA's default CPU scheduler it stopped
    in its collectives, each device waiting in a different one, in 2 of 2 such
    runs on an idle machine and in 6 of 6 of 200 steps on a loaded one."""
    import numpy as np

    from jcomp.collectives import cpu
    assert cpu.FLAG in os.environ["XLA_FLAGS"]
    losses, _ = _two_hop_steps_in_a_child(tmp_path, n=150)
    assert len(losses) == 150 and all(np.isfinite(losses))


@pytest.mark.slow
def test_two_hops_uncompressed_match_one_hop(tmp_path):
    """dcn_data=2 (batch over ('dcn', 'data'), the loss mean and the ZeRO
    messages hop by hop) with every codec none is the one-hop step up to the
    order of float32 sums: losses within 1e-6 relative, and after two AdamW
    steps (lr 1e-2) every parameter within 1e-4 of the farthest AdamW moves one
    in two steps (2 lr). Not relative to each leaf: AdamW divides by the
    gradient's own scale, so a bias that starts at zero and has tiny gradients
    moves by ~lr either way (seen: 3e-7 apart on a leaf of largest entry 0.02)."""
    import jax
    import numpy as np
    one, two = _tiny_steps(1), _two_hop_steps_in_a_child(tmp_path)
    np.testing.assert_allclose(two[0], one[0], rtol=1e-6)
    assert len(two[1]) == len(jax.tree.leaves(one[1]))
    worst = max(float(np.abs(a - b).max()) for a, b in zip(two[1], jax.tree.leaves(one[1])))
    assert worst <= 1e-4 * 2 * 1e-2, worst
