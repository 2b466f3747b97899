"""Loss and data-mean gradients of the 3-D model as one jitted function: the
reference the parallel layout is tested against (the train step itself reduces
gradients in the ZeRO optimizer)."""
import jax
from jax import lax
from jax.sharding import PartitionSpec as P

from jcomp import collectives as cc
from jcomp.gpt import messages, parallel, sharding

DATA = sharding.DATA


def reduce_grads(grads, pol, key=None):
    """Mean of the gradients over data with policy[data, grad] (no error feedback)."""
    n = lax.axis_size(DATA)
    summed = cc.psum(grads, DATA, codec=pol[DATA, "grad"], key=key)
    return jax.tree.map(lambda g: g / n, summed)


def make_loss_and_grad(cfg, mesh, pol, microbatches: int, remat: bool = False):
    """A jitted fn(params, batch) -> (mean loss, data-mean gradients) over the mesh.

    `params` carry `param_specs` shardings; `batch` is [B, L+1] int32 split over
    data. The returned gradients have the parameters' shardings.
    """
    plan = messages.plan(pol, cfg.n_layers, dict(mesh.shape))

    def step(params, batch):
        specs = sharding.param_specs(params)

        def body(params, batch):
            loss, grads = parallel.local_value_and_grad(params, batch, cfg, plan, microbatches,
                                                        remat)
            return lax.pmean(loss, DATA), reduce_grads(grads, pol)

        fn = jax.shard_map(body, mesh=mesh, in_specs=(specs, sharding.BATCH_SPEC),
                           out_specs=(P(), specs), check_vma=True)
        return fn(params, batch)

    return jax.jit(step)
