"""An Equinox step on a (data 4, model 2) mesh of Auto axes: a two-layer
Megatron MLP (`eqx.nn.Linear`, the first split over "model" on its output,
the second on its input) trained by `eqx.filter_jit`, the batch over "data".

`step(codec)` is the plain step with `codec=None` (`jax.value_and_grad`) and
jcomp's otherwise: the one gradient line changed, the specs read from the
parameters' own shardings outside jit (inside, Auto axes' shardings are not
in the traced types)."""
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jcomp import collectives as cc

D, HIDDEN, BATCH = 64, 256, 32


class MLP(eqx.Module):
    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.up = eqx.nn.Linear(D, HIDDEN, key=k1)
        self.down = eqx.nn.Linear(HIDDEN, D, key=k2)

    def __call__(self, x):
        return self.down(jax.nn.gelu(self.up(x)))


def megatron_specs(params):
    """Linear weights are (out, in): up split on its output, down on its input."""
    return eqx.tree_at(lambda m: (m.up.weight, m.up.bias, m.down.weight, m.down.bias),
                       jax.tree.map(lambda _: P(), params),
                       (P("model", None), P("model"), P(None, "model"), P()))


def init(mesh):
    """-> (model placed on the mesh, optax AdamW, its state, batch)."""
    model = MLP(jax.random.key(0))
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s),
                             megatron_specs(eqx.filter(model, eqx.is_array)),
                             is_leaf=lambda x: isinstance(x, P))
    model = eqx.filter_shard(model, shardings)
    tx = optax.adamw(3e-3)
    opt_state = tx.init(eqx.filter(model, eqx.is_array))
    rng = np.random.default_rng(0)
    batch = {k: jax.device_put(rng.standard_normal((BATCH, D)).astype(np.float32),
                               NamedSharding(mesh, P("data"))) for k in ("x", "y")}
    return model, tx, opt_state, batch


def make_mesh():
    return jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)


def loss_fn(params, static, batch):
    model = eqx.combine(params, static)
    return jnp.mean((jax.vmap(model)(batch["x"]) - batch["y"]) ** 2)


def step(mesh, model, tx, codec=None, param_specs="own"):
    """The filter_jit step; param_specs="own" reads them from `model`'s arrays."""
    params, static = eqx.partition(model, eqx.is_array)
    if param_specs == "own":
        param_specs = jax.tree.map(lambda x: x.sharding.spec, params)
    loss = lambda p, b: loss_fn(p, static, b)
    grads_of = (jax.value_and_grad(loss) if codec is None else cc.value_and_grad(
        loss, mesh=mesh, param_specs=param_specs, mean_over="examples", codec=codec))

    @eqx.filter_jit
    def run(model, opt_state, batch):
        params, static = eqx.partition(model, eqx.is_array)
        value, grads = grads_of(params, batch)  # was: jax.value_and_grad(loss)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return eqx.combine(optax.apply_updates(params, updates), static), opt_state, value, grads

    return run
