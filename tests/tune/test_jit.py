"""jcomp.tune for a jax.jit step: the gradient reduction's messages from the
parameters (tune.messages_from_grads), checked against the compiled programs'
bytes per axis, and the README's recipe run as written."""
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jcomp import collectives as cc
from jcomp import tune
from jcomp.meter import wire
from jcomp.tune import CodecCost, Link, Profile
from tests.collectives import tp_mlp

README = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "README.md")
# A slow data link and a fast tensor one; codec costs small beside the link.
PROFILE = Profile(links={"data": Link(1e-4, 1e8), "model": Link(1e-5, 1e12)},
                  codecs={c: CodecCost(1e-12, 1e-12) for c in ("bf16", "int8", "int4:rot")},
                  device="made up")


@pytest.fixture(scope="module")
def mlp():
    return tp_mlp.make()


def test_a_plain_steps_report_has_no_message_and_choose_says_what_to_pass(mlp):
    """XLA's gradient reduction carries no message name: messages_from on the
    plain step finds nothing, and choose({}) planned nothing, silently, until
    codec_dict("grad") failed far from the cause."""
    mesh, params, x, _ = mlp
    report = wire.measure(jax.jit(jax.value_and_grad(tp_mlp.loss)), params, x, mesh=mesh)
    assert report.by_mesh_axis()["data"] > 0
    assert tune.messages_from(report) == {}
    with pytest.raises(ValueError, match=r"messages is empty.*tune.messages_from_grads\("):
        tune.choose(PROFILE, {})


def test_gradient_messages_are_the_plain_programs_bytes_over_data(mlp):
    """Tensor-parallel kernels replicated over data: an all-reduce of each
    device's shard, 2(n-1)/n of it, which is what the plain program sends over
    "data" less its scalar loss; the tensor axis's activation reductions are no
    gradient message. Arrays, their own shardings and abstract shapes agree."""
    mesh, params, x, specs = mlp
    msgs = tune.messages_from_grads(params, specs, mesh=mesh, data_axes="data")
    assert set(msgs) == {("data", "grad")}
    t = msgs["data", "grad"]
    shard = sum(np.prod(s) for s in tp_mlp.SHAPES.values()) * 4 / 2
    assert t.raw_bytes == 2 * 3 / 4 * shard
    assert (t.op, t.n, t.dtype, t.collectives) == ("all-reduce", 4, "float32", 1)
    plain = wire.measure(jax.jit(jax.value_and_grad(tp_mlp.loss)), params, x,
                         mesh=mesh).by_mesh_axis()
    assert plain["data"] - t.raw_bytes == 2 * 3 / 4 * 4  # the loss, a float32 scalar
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype,
                                                           sharding=a.sharding), params)
    assert tune.messages_from_grads(params, mesh=mesh) == msgs
    assert tune.messages_from_grads(abstract, mesh=mesh) == msgs
    d = tune.choose(PROFILE, msgs, budget={"grad": "int8"})
    assert d.codec_dict("grad") == {"data": "int8"}


def test_fsdp_over_one_of_two_batch_axes_is_what_value_and_grad_sends():
    """w1, w2 split over "ici" (FSDP) and "tensor", b replicated; the batch over
    ("dcn", "ici"). cc.value_and_grad reduce-scatters w1, w2 over ici, all-reduces
    the pieces over dcn (b over both), and gathers w1, w2 over ici once: its
    uncoded program sends those bytes per axis, the float32 loss beside them.
    (XLA's own program sends more here: it gathers in the backward too.) The
    decision's dict names batch axes only, and cc.value_and_grad takes it."""
    mesh = jax.make_mesh((2, 2, 2), ("dcn", "ici", "tensor"), axis_types=(AxisType.Auto,) * 3)
    specs = {"w1": P("ici", "tensor"), "w2": P("tensor", "ici"), "b": P()}
    shapes = {"w1": (64, 512), "w2": (512, 64), "b": (64,)}
    loss = lambda p, x: jnp.mean((jnp.tanh(x @ p["w1"]) @ p["w2"] + p["b"]) ** 2)
    rng = np.random.default_rng(0)
    params = {k: jax.device_put(rng.standard_normal(shapes[k]).astype(np.float32),
                                NamedSharding(mesh, specs[k])) for k in specs}
    x = jax.device_put(rng.standard_normal((32, 64)).astype(np.float32),
                       NamedSharding(mesh, P(("dcn", "ici"))))
    axes = ("dcn", "ici")
    msgs = tune.messages_from_grads(params, specs, mesh=mesh, data_axes=axes)
    assert set(msgs) == {("dcn", "grad"), ("ici", "grad"), ("ici", "param")}
    local = 64 * 512 * 4 / 2  # w1's bytes per device over tensor, as w2's
    assert msgs["ici", "grad"].op == "reduce-scatter"
    assert msgs["ici", "param"].raw_bytes == 2 * local / 2
    assert msgs["dcn", "grad"].raw_bytes == 2 * local / 2 + 2 * 3 / 4 * 64 * 4
    ours = wire.measure(jax.jit(cc.value_and_grad(
        loss, mesh=mesh, param_specs=specs, data_axes=axes, mean_over="examples",
        check_bytes=False)), params, x, mesh=mesh).by_mesh_axis()
    loss_bytes = 2 * 3 / 4 * 4
    assert ours["dcn"] - msgs["dcn", "grad"].raw_bytes == loss_bytes
    assert ours["ici"] - msgs["ici", "grad"].raw_bytes - msgs["ici", "param"].raw_bytes \
        == loss_bytes
    prof = Profile(links={a: Link(1e-4, 1e8) for a in axes}, codecs=PROFILE.codecs,
                   device="made up")
    d = tune.choose(prof, msgs, budget={"grad": "int8"})
    codec = d.codec_dict("grad")
    assert codec == {"dcn": "int8", "ici": "int8"}
    assert d.codec_dict("param") == {"ici": "int8"}
    cc.value_and_grad(loss, mesh=mesh, param_specs=specs, data_axes=axes, codec=codec,
                      param_codec=d.codec_dict("param")["ici"], mean_over="examples")


def test_bad_arguments_are_named(mlp):
    mesh, params, _, specs = mlp
    with pytest.raises(ValueError, match=r"data_axes: 'batch' is not an axis"):
        tune.messages_from_grads(params, specs, mesh=mesh, data_axes="batch")
    with pytest.raises(TypeError, match="mesh must be a jax.sharding.Mesh"):
        tune.messages_from_grads(params, specs, mesh=(4, 2))
    with pytest.raises(ValueError, match="param_specs must have the parameters' tree"):
        tune.messages_from_grads(params, {"w": P()}, mesh=mesh)


def _readme_tune_block():
    text = open(README).read()
    section = text[text.index("## Let jcomp choose"):]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    found = [b for b in blocks if "tune.messages_from_grads" in b]
    assert len(found) == 1, "README's 'Let jcomp choose' has one tune recipe for jit programs"
    return found[0]


def test_the_readmes_jit_recipe_runs_as_written(mlp, monkeypatch):
    """The README's lines, with the names its jit section defines (mesh,
    params, specs, loss_fn) bound to a tensor-parallel MLP. The probe is
    replaced by a fixed profile with a slow data link: timed on a shared CPU
    its fit can come out flat, and the choice should not depend on it."""
    mesh, params, x, specs = mlp
    monkeypatch.setattr(tune, "probe", lambda mesh: PROFILE)
    env = {"cc": cc, "jax": jax, "mesh": mesh, "params": params, "specs": specs,
           "loss_fn": tp_mlp.loss}
    exec(compile(_readme_tune_block(), "README.md", "exec"), env)
    assert env["d"].codec_dict("grad") == {"data": "int8"}
    with jax.set_mesh(mesh):
        plain = jax.jit(jax.value_and_grad(tp_mlp.loss))(params, x)[1]
        grads = jax.jit(env["grads_of"])(params, x)[1]
    for k in specs:
        a, b = np.asarray(plain[k]), np.asarray(grads[k])
        assert 0 < np.abs(a - b).max() <= 0.02 * np.abs(a).max()  # int8's error
        assert grads[k].sharding.spec == specs[k]
