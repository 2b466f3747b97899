"""A two-kernel Megatron MLP on a (data 4, model 2) mesh of Auto axes, for tests
of gradient reductions beside tensor parallelism: the first kernel split over
"model" on its output, the second on its input, the batch over "data"."""
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

SPECS = {"w": P(None, "model"), "v": P("model", None)}
SHAPES = {"w": (64, 512), "v": (512, 64)}


def make():
    """-> (mesh, params, batch x, SPECS), placed on the mesh."""
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    rng = np.random.default_rng(0)
    with jax.set_mesh(mesh):
        params = {k: jax.device_put(rng.standard_normal(SHAPES[k]).astype(np.float32),
                                    NamedSharding(mesh, SPECS[k])) for k in SPECS}
        x = jax.device_put(rng.standard_normal((32, 64)).astype(np.float32),
                           NamedSharding(mesh, P("data")))
    return mesh, params, x, SPECS


def loss(p, b):
    return jnp.mean((jnp.tanh(b @ p["w"]) @ p["v"]) ** 2)
