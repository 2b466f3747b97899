"""The long form of tests/gpt/test_autoencoder.py: a short run of train.py saves
the autoencoder's weights and a resume restores them."""
import jax
import numpy as np
import pytest

from jcomp.gpt import autoencoder
from jcomp.gpt import mesh as jmesh
from jcomp.gpt import model as gpt


@pytest.mark.e2e
def test_training_checkpoints_and_restores_the_autoencoder(tmp_path):
    """A short run saves the autoencoder weights, they moved from their
    initial values, and a resumed run continues from them."""
    import os
    import shutil
    import sys
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    from configs import tiny
    from jcomp.train.run import checkpoint
    from jcomp.train.settings import runspec
    from jcomp.train import loop as trainer
    from jcomp.gpt import step

    cfg = tiny.get_config()
    cfg.train.steps, cfg.checkpoint.every, cfg.train.eval_every = 4, 2, 100
    cfg.optim.warmup_steps = 1
    cfg.compression.tensor.act = "ae:dim=8"
    cfg.compression.tensor.act_grad = "ae:dim=8"
    workdir = str(tmp_path / "ae")
    first = trainer.train_and_evaluate(cfg, workdir)
    assert first["step"] == 4

    run = runspec.validate(cfg, jax.device_count())
    mesh = jmesh.make_mesh(run.mesh_shape)
    init = gpt.init_params(run.model, jax.random.key(cfg.seed),
                           coders=autoencoder.coders(run.policy))
    abstract = step.abstract_state(jax.eval_shape(lambda: init), mesh,
                                   run.optim.tx(run.train.steps), run.zero)
    ckpt_dir = os.path.join(workdir, "checkpoints")
    with checkpoint.Checkpointer(ckpt_dir, save_every=2, keep=3) as ck:
        saved = ck.restore(abstract, step=2).state["params"]["layers"]
    names = sorted(n for n in saved if "_ae_" in n)
    assert len(names) == 8
    assert all(not np.array_equal(saved[n], init["layers"][n]) for n in names)

    # Resuming from step 2 restores them: steps 3 and 4 repeat bit for bit.
    shutil.rmtree(os.path.join(ckpt_dir, "4"))
    resumed = trainer.train_and_evaluate(cfg, workdir)
    assert resumed["step"] == 4 and resumed["loss"] == first["loss"]
