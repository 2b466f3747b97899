"""Where the GPT's arrays live on the ('data', 'tensor', 'pipeline') mesh: the
parameters' PartitionSpecs (from their logical axes), the batch's, and the
checks that the model and batch divide over the mesh.

A mesh whose data axis is split into two hops (jcomp.gpt.mesh, dcn_data > 1)
has the data-parallel axes ('dcn', 'data'): `data_axes` names them, and
everything split or reduced over data uses that tuple."""
from __future__ import annotations

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jcomp.gpt import autoencoder
from jcomp.gpt import model as gpt

DATA, TENSOR, PIPE = "data", "tensor", "pipeline"
DCN = "dcn"
BATCH_SPEC = P(DATA)  # tokens [B, L+1]: rows split over data, replicated elsewhere


def data_axes(mesh) -> tuple:
    """The data-parallel axes of a mesh (a Mesh, or its axis names or {axis: size}):
    ('data',), or ('dcn', 'data') on a mesh with a slow hop (slow factor first,
    so data rank r = dcn_index * |data| + data_index)."""
    names = tuple(getattr(mesh, "axis_names", mesh))
    return (DCN, DATA) if DCN in names else (DATA,)


def data_entry(axes: tuple):
    """A PartitionSpec entry for the data axes: 'data' alone, or the tuple."""
    return axes[0] if len(axes) == 1 else tuple(axes)


def batch_spec(axes: tuple = (DATA,)) -> P:
    """tokens [B, L+1]: rows split over the data axes, replicated elsewhere."""
    return P(data_entry(axes))


# Logical axis (jcomp.gpt.model.PARAM_AXES) -> the mesh axis it is split over; the
# others are replicated. Stacked layers lead with "layers".
AXIS_RULES = {"layers": PIPE, **{a: TENSOR for a in gpt.TENSOR_SPLIT}}
_PARAM_AXES = {**gpt.PARAM_AXES, **autoencoder.PARAM_AXES}


def check_layout(cfg: gpt.ModelConfig, mesh_shape: dict, global_batch: int, microbatches: int):
    """Raises ValueError naming the config field (model.*, mesh.*, train.*) when
    the model or the batch does not divide over the mesh."""
    d = 1
    for a in data_axes(mesh_shape):
        d *= mesh_shape[a]
    t, p = mesh_shape[TENSOR], mesh_shape[PIPE]
    rules = [
        ("model.n_heads", cfg.n_heads, "mesh.tensor", t),
        ("model.d_ff", cfg.d_ff, "mesh.tensor", t),
        ("model.vocab_size", cfg.vocab_size, "mesh.tensor", t),
        ("model.n_layers", cfg.n_layers, "mesh.pipeline", p),
    ]
    for field, value, axis, size in rules:
        if value % size:
            raise ValueError(f"{field}={value} is not divisible by {axis}={size}")
    if microbatches < 1:
        raise ValueError(f"train.microbatches={microbatches} must be >= 1")
    if global_batch % (d * microbatches):
        raise ValueError(f"train.batch_size={global_batch} is not divisible by mesh.data x "
                         f"train.microbatches = {d} x {microbatches} = {d * microbatches}")


def spec_of(logical_axes) -> P:
    """("layers", "embed", "mlp") -> P("pipeline", None, "tensor")."""
    return P(*(AXIS_RULES.get(a) for a in logical_axes))


def _layer_spec(path, leaf) -> P:
    """Stacked layer leaf [N, ...]: layers over pipeline, the Megatron dim over tensor."""
    key = tuple(getattr(k, "key", getattr(k, "name", k)) for k in path)
    axes = ("layers",) + _PARAM_AXES[key]
    if len(axes) != leaf.ndim:
        raise ValueError(f"layer parameter {'/'.join(map(str, key))} has shape {leaf.shape}; "
                         f"its logical axes are {axes}")
    return spec_of(axes)


def param_specs(params) -> dict:
    """PartitionSpecs of the global parameter tree (see the module docstring)."""
    specs = {
        "embed": spec_of(gpt.EMBED_AXES),
        "layers": jax.tree_util.tree_map_with_path(_layer_spec, params["layers"]),
        "final_ln": jax.tree.map(lambda _: P(), params["final_ln"]),
    }
    if "head" in params:
        specs["head"] = spec_of(gpt.EMBED_AXES)
    return specs


def shard_params(params, mesh):
    """Places a global parameter tree on the mesh."""
    specs = param_specs(params)
    return jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), params, specs)
