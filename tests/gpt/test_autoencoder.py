"""jcomp.gpt.autoencoder: the learned linear codec on tensor-parallel activations.
A run of train.py that saves and restores it: experiments/checks/test_autoencoder_long.py."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from tests.gpt import loss_and_grad
from jcomp.gpt import autoencoder
from jcomp import codecs
from jcomp import collectives as cc
from jcomp.gpt import mesh as jmesh
from jcomp.gpt import model as gpt
from jcomp.gpt import messages, policy, sharding, tensor
from jcomp.meter import wire

CFG = gpt.ModelConfig(vocab_size=64, d_model=32, n_heads=4, n_layers=4, d_ff=64, max_seq_len=16)
A = 8
BATCH, SEQ = 8, 8
AE_POLICY = policy.preset("baseline").replace({"tensor.act": f"ae:dim={A}",
                                               "tensor.act_grad": f"ae:dim={A}"})


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)


# ------------------------------------------------------------------ spec

def test_parse_and_print_roundtrip():
    ae = codecs.parse("AE:dim=16:init=normal:rest=int8")
    assert (ae.dim, ae.init, ae.rest, ae.kind) == (16, "normal", "int8", "learned")
    assert str(ae) == "ae:dim=16:init=normal:rest=int8"
    assert codecs.parse(str(ae)) == ae and str(codecs.parse("ae:dim=4")) == "ae:dim=4"
    for rest in ("mxfp8", "mxfp4", "nvfp4"):  # the microscaling codecs code the rest too
        assert codecs.parse(codecs.parse(f"ae:dim=4:rest={rest}").rest).name == rest


@pytest.mark.parametrize("spec, phrase", [
    ("ae", "dim is missing"), ("ae:dim=0", "dim must be an int >= 1"),
    ("ae:dim=x", "dim must be an int"), ("ae:dim=4:init=pca", "init must be one of"),
    ("ae:dim=4:rest=topk", "rest must be one of"), ("ae:dim=4:dim=5", "given twice"),
    ("ae:size=4", "unknown option"),
])
def test_bad_specs_name_the_problem(spec, phrase):
    with pytest.raises(ValueError, match=phrase):
        codecs.parse(spec)


@pytest.mark.parametrize("key", ["data.grad", "data.param", "pipeline.act", "tensor.grad"])
def test_policy_refuses_it_outside_tensor_activations(key):
    with pytest.raises(ValueError, match="tensor.act, tensor.act_grad"):
        policy.preset("baseline").replace({key: "ae:dim=4"})


def test_collectives_refuse_it_loudly():
    m = jmesh.make_mesh((1, 8, 1))
    fn = jax.shard_map(lambda x: cc.psum(x, "tensor", codec="ae:dim=4"), mesh=m,
                       in_specs=P("tensor"), out_specs=P())
    with pytest.raises(ValueError, match="learned autoencoder"):
        jax.jit(fn)(jnp.ones((8, 4)))


def test_dims_and_orthogonal_init():
    assert autoencoder.dims(AE_POLICY) == {"out_dim": A, "in_dim": A, "init": "orthogonal"}
    assert autoencoder.dims(policy.preset("hybrid"))["out_dim"] == 0
    enc, dec = autoencoder.init_pair(jax.random.key(0), 32, A, "orthogonal")
    np.testing.assert_allclose(enc.T @ enc, np.eye(A), atol=1e-5)
    np.testing.assert_array_equal(dec, enc.T)
    with pytest.raises(ValueError, match="must not exceed model.d_model"):
        autoencoder.init_pair(jax.random.key(0), 32, 33, "orthogonal")


# --------------------------------------------------------- in the model

@pytest.fixture(scope="module")
def reference():
    """Parameters with trained-looking (non-projection) autoencoders, and the
    single-device loss and gradients of the same bottlenecked model."""
    normal = policy.preset("baseline").replace({"tensor.act": f"ae:dim={A}:init=normal",
                                                "tensor.act_grad": f"ae:dim={A}:init=normal"})
    coders = autoencoder.coders(normal)
    params = gpt.init_params(CFG, jax.random.key(0), coders=coders)
    batch = jax.random.randint(jax.random.key(1), (BATCH, SEQ + 1), 0, CFG.vocab_size)
    loss_fn = functools.partial(gpt.loss_fn, cfg=CFG, coders=coders)
    loss, grads = jax.jit(jax.value_and_grad(loss_fn))(params, batch)
    return params, batch, loss, grads


def _run(mesh, pol, params, batch):
    fn = loss_and_grad.make_loss_and_grad(CFG, mesh, pol, microbatches=2)
    placed = (sharding.shard_params(params, mesh),
              jax.device_put(batch, NamedSharding(mesh, sharding.BATCH_SPEC)))
    return fn, placed


def test_parallel_model_equals_the_reference_and_every_weight_gets_its_gradient(reference):
    """Linear codes sum correctly: on a (2, 2, 2) mesh the loss and every
    gradient, the autoencoders' included, equal the single-device model's."""
    params, batch, ref_loss, ref_grads = reference
    m = jmesh.make_mesh((2, 2, 2))
    fn, placed = _run(m, AE_POLICY, params, batch)
    loss, grads = fn(*placed)
    assert abs(float(loss) - float(ref_loss)) <= 1e-5 * abs(float(ref_loss))
    names = [n for n in grads["layers"] if "_ae_" in n]
    assert len(names) == 8
    for n in names:
        g = np.asarray(grads["layers"][n])
        assert np.linalg.norm(g) > 0, n
        assert _rel(g, ref_grads["layers"][n]) <= 1e-4, (n, _rel(g, ref_grads["layers"][n]))
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        assert _rel(g, r) <= 1e-4


def test_weights_present_but_not_in_the_policy_are_skipped(reference):
    """Before a scheduled start the policy says "none": the model runs without
    its bottleneck, as if the weights were absent, and they get zero gradients."""
    params, batch, _, _ = reference
    plain = {**params, "layers": {n: v for n, v in params["layers"].items() if "_ae_" not in n}}
    ref_loss = jax.jit(gpt.loss_fn, static_argnums=2)(plain, batch, CFG)
    m = jmesh.make_mesh((2, 2, 2))
    fn, placed = _run(m, policy.preset("baseline"), params, batch)
    loss, grads = fn(*placed)
    assert abs(float(loss) - float(ref_loss)) <= 1e-5 * abs(float(ref_loss))
    assert all(not np.any(grads["layers"][n]) for n in params["layers"] if "_ae_" in n)


def test_autoencoder_parameters_have_partition_dims():
    """Every Block parameter the autoencoder's coders create has logical axes,
    none of them split (each tensor rank holds it whole), so sharding.param_specs
    lays it out; without coders the model creates none of them."""
    keys = lambda layers: {tuple(getattr(k, "key", k) for k in p)
                           for p, _ in jax.tree_util.tree_leaves_with_path(layers)}
    with_ae = gpt.init_params(CFG, jax.random.key(0), coders=autoencoder.coders(AE_POLICY))
    plain = gpt.init_params(CFG, jax.random.key(0))
    assert keys(plain["layers"]) == set(gpt.PARAM_AXES)
    assert keys(with_ae["layers"]) == set(gpt.PARAM_AXES) | set(autoencoder.PARAM_AXES)
    specs = sharding.param_specs(with_ae)["layers"]
    assert all(tuple(specs[k[0]]) == ("pipeline", None, None) for k in autoencoder.PARAM_AXES)


def test_tensor_traffic_of_the_blocks_shrinks_to_dim_over_d_model():
    """Forward and backward through the layers alone on the tensor axis: every
    all-reduce carries A instead of D numbers per token, so the bytes are A/D."""
    m = jmesh.make_mesh((1, 8, 1))
    cfg = gpt.ModelConfig(vocab_size=64, d_model=32, n_heads=8, n_layers=2, d_ff=64,
                          max_seq_len=16)
    x = jax.random.normal(jax.random.key(2), (4, SEQ, cfg.d_model))

    def traffic(pol):
        layers = gpt.init_params(cfg, jax.random.key(0), coders=autoencoder.coders(pol))["layers"]
        specs = jax.tree_util.tree_map_with_path(sharding._layer_spec, layers)
        specs = jax.tree.map(lambda s: P(None, *s[1:]), specs)  # no pipeline axis here
        pl = messages.plan(pol, cfg.n_layers, {"data": 1, "tensor": 8, "pipeline": 1})
        enter, leave, coders = tensor.tp_hooks(codecs.parse(pol["tensor", "act"]),
                                                  codecs.parse(pol["tensor", "act_grad"]),
                                                  pl.block_exit, pl.block_entry_grad)

        def body(layers, x):
            f = functools.partial(gpt.apply_layers, cfg=cfg, tp_enter=enter, tp_exit=leave,
                                  coders=coders)
            return jax.grad(lambda x: f(layers, x).sum())(x)

        fn = jax.jit(jax.shard_map(body, mesh=m, in_specs=(specs, P()), out_specs=P()))
        placed = jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(m, s)), layers, specs)
        return wire.measure(fn, placed, x, mesh=m).by_axis()["tensor"]

    base = traffic(policy.preset("baseline"))
    coded = traffic(AE_POLICY)
    assert base > 0 and coded == base * A // cfg.d_model, (coded, base)


