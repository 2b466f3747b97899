"""cc.value_and_grad on two train steps written from public sources, each changed
in its one gradient line: a MaxText-shaped step (maxtext_step.py: a
('data', 'fsdp', 'tensor') mesh, logical rules, an embedding gather over a
table split over fsdp, activation constraints naming the batch axes, scanned
remat layers, bf16, a token-weighted loss with uneven padding, aux counts) and
a nanoDO-shaped one (nanodo_step.py: FSDP over "data", boxed parameters, a
loss closing over the batch).

Bounds, measured here: with codec "none" the gradients equal the plain step's
to rounding, at most 2e-6 of each leaf's largest in float32 (seen 2e-7
MaxText-shaped, 1.2e-6 nanoDO-shaped: the per-rank program sums in another
order) and 2e-2 with bf16 compute (seen 9e-3; bf16's own step is 8e-3)."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from benchmarks.jit_step import bytes_over
from jcomp import collectives as cc
from jcomp.collectives.jit import specs as jitspecs
from jcomp.meter import wire
from tests.collectives import maxtext_step as ms
from tests.collectives import nanodo_step as nd


def _rel_err(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.abs(a - b).max() / np.abs(a).max())


# ---------------------------------------------------------------- MaxText-shaped

MT_TOKENS = lambda batch: jnp.sum(batch["targets_segmentation"] != 0)


def _mt_grads_of(mesh, specs, codec="none", mean_over=MT_TOKENS, data_axes=("data", "fsdp")):
    """MaxText's gradient line, changed: jax.value_and_grad -> cc.value_and_grad."""
    return cc.value_and_grad(ms.loss_fn, mesh=mesh, param_specs=specs, mean_over=mean_over,
                             has_aux=True, aux="sum", data_axes=data_axes, codec=codec)


@pytest.fixture(scope="module")
def mt():
    mesh = ms.make_mesh()
    with jax.set_mesh(mesh), nn.logical_axis_rules(ms.RULES):
        params, logical, tx, opt_state = ms.init(mesh)
        batch = next(ms.batches(mesh, 1))
    return mesh, params, ms.param_specs(logical), tx, opt_state, batch


def _mt_run(mt, grads_of):
    mesh, params, _, _, _, batch = mt
    with jax.set_mesh(mesh), nn.logical_axis_rules(ms.RULES):  # a new jit: DTYPE may change
        return jax.jit(lambda p, b: grads_of(p, b))(params, batch)


@pytest.mark.slow
def test_maxtext_none_gives_the_plain_gradients_and_aux(mt, monkeypatch):
    """The token-weighted loss over unevenly padded ranks, its aux counts and every
    gradient, as the plain step computes them: the int32 token count whole and
    int32, the loss to 1e-6, gradients within the module's bounds. A mean of
    per-rank means (mean_over="examples") is visibly another gradient here, so
    the check can tell the two apart."""
    mesh, params, specs, *_ = mt
    plain = _mt_run(mt, ms.plain_grads_of)
    ours = _mt_run(mt, _mt_grads_of(mesh, specs))
    (loss_p, aux_p), g_p = plain
    (loss_o, aux_o), g_o = ours
    assert aux_o["total_weights"].dtype == aux_p["total_weights"].dtype == jnp.int32
    assert int(aux_o["total_weights"]) == int(aux_p["total_weights"])
    for py_float in ("moe_lb_loss", "mtp_loss"):  # Python 0.0 in MaxText's loss_fn
        assert aux_o[py_float].dtype == aux_p[py_float].dtype
        assert float(aux_o[py_float]) == float(aux_p[py_float]) == 0.0
    np.testing.assert_allclose(float(aux_o["total_loss"]), float(aux_p["total_loss"]), rtol=1e-6)
    np.testing.assert_allclose(float(loss_o), float(loss_p), rtol=1e-6)
    for a, b, w in zip(jax.tree.leaves(g_p), jax.tree.leaves(g_o), jax.tree.leaves(params)):
        # A split parameter's own layout; a replicated one's sum as XLA lays it
        # out in the plain step.
        want = w.sharding if jitspecs.axes_in(w.sharding.spec) else a.sharding
        assert b.sharding.is_equivalent_to(want, w.ndim), (b.sharding, want)
        assert _rel_err(a, b) <= 2e-2
    monkeypatch.setattr(ms, "DTYPE", jnp.dtype(jnp.float32))
    plain32 = _mt_run(mt, ms.plain_grads_of)[1]
    ours32 = _mt_run(mt, _mt_grads_of(mesh, specs))[1]
    per_rank_means = _mt_run(mt, _mt_grads_of(mesh, specs, mean_over="examples"))[1]
    errs = [_rel_err(a, b) for a, b in zip(jax.tree.leaves(plain32), jax.tree.leaves(ours32))]
    assert max(errs) <= 2e-6, errs
    assert max(_rel_err(a, b) for a, b in zip(jax.tree.leaves(plain32),
                                              jax.tree.leaves(per_rank_means))) > 0.05


def test_maxtext_fsdp_left_automatic_is_named_before_compiling(mt):
    """data_axes=("data",) leaves MaxText's fsdp to XLA inside the per-rank map, a
    layout whose embedding gather aborts XLA's partitioner: a ValueError at trace
    time names the axis and the fix instead."""
    mesh, _, specs, *_ = mt
    with pytest.raises(ValueError, match=r"splits the batch over \['fsdp'\].*"
                                         r"data_axes=\('data', 'fsdp'\)"):
        _mt_run(mt, _mt_grads_of(mesh, specs, data_axes=("data",)))


def _near(losses, plain, rel=0.05):
    """The mean of the last three losses within `rel` of the plain run's (one step's
    loss is noisy: batches differ in their padding), after the plain run learned."""
    tail, plain_tail = np.mean(losses[-3:]), np.mean(plain[-3:])
    assert plain_tail < 0.85 * plain[0], plain  # it learns, so `rel` says something
    assert abs(tail / plain_tail - 1) < rel, (losses, plain)


def _train(make_step, params, opt_state, batches):
    losses = []
    for batch in batches:
        params, opt_state, loss, _ = make_step(params, opt_state, batch)
        losses.append(float(loss))  # waits on the step (emulated devices)
    return losses


@pytest.fixture(scope="module")
def mt_runs(mt):
    """codec -> (10 AdamW steps' losses, the step's wire report); None: plain."""
    mesh, params, specs, tx, opt_state, _ = mt
    out = {}
    for codec in (None, "none", "int8", "int4:rot"):
        grads_of = ms.plain_grads_of if codec is None else _mt_grads_of(mesh, specs, codec)
        with jax.set_mesh(mesh), nn.logical_axis_rules(ms.RULES):
            p, o = jax.tree.map(jnp.copy, (params, opt_state))
            step = jax.jit(lambda p, o, b: ms.train_step(p, o, b, tx=tx, grads_of=grads_of),
                           donate_argnums=(0, 1))
            data = list(ms.batches(mesh, 10, seed=1))
            report = wire.measure(step, p, o, data[0], mesh=mesh)
            out[codec] = (_train(step, p, o, data), report)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("codec", ["int8", "int4:rot"])
def test_maxtext_compressed_steps_train_as_plain_and_send_less(mt_runs, codec):
    """10 AdamW steps: the last losses within 5% of the plain step's; the
    batch axes (data, fsdp) carry fewer bytes than the plain step's, and no mesh
    axis carries more than the plain step's +1% (bytes of every collective that
    crosses the axis, read from the compiled steps)."""
    plain_losses, plain = mt_runs[None]
    losses, ours = mt_runs[codec]
    _near(losses, plain_losses)
    p, o = bytes_over(plain), bytes_over(ours)
    for axis in p:
        assert o.get(axis, 0.0) <= 1.01 * p[axis], (axis, o, p)
    for axis in ("data", "fsdp"):
        assert o[axis] < 0.6 * p[axis], (axis, o, p)
    assert not [n for n in ours.notes if "raw" in n.lower()], ours.notes


@pytest.mark.slow
def test_maxtext_none_sends_no_more_than_plain_on_any_axis(mt_runs):
    p, o = bytes_over(mt_runs[None][1]), bytes_over(mt_runs["none"][1])
    for axis in p:
        assert o.get(axis, 0.0) <= 1.01 * p[axis], (axis, o, p)


# ---------------------------------------------------------------- nanoDO-shaped

ND_TOKENS = lambda in_BxL: jnp.sum(in_BxL[:, 1:] != nd.PAD)
ND_AUX = nd.LossAuxData(ntokens="sum", state="sum", log_perplexity="weighted")


def _nd_line(apply_fn, mesh, codec):
    """nanoDO's gradient line, changed: the loss factory and the batch go to
    cc.value_and_grad; boxed parameters bring their own specs."""
    return lambda in_BxL, params: cc.value_and_grad(
        lambda p, b: nd.get_loss_fn(b, apply_fn)(p), mesh=mesh, mean_over=ND_TOKENS,
        has_aux=True, aux=ND_AUX, codec=codec)(params, in_BxL)


@pytest.fixture(scope="module")
def ndo():
    mesh = nd.make_mesh()
    params, shardings, tx, opt_state = nd.init(mesh)
    return mesh, params, shardings, tx, opt_state


@pytest.mark.slow
def test_nanodo_none_gives_the_plain_gradients_boxes_and_shardings(ndo):
    """FSDP over the batch axis, parameters boxed as flax makes them: the gradients
    come back boxed, sharded as the parameters, within 2e-6 of the plain step's;
    the aux token count int32 and whole."""
    mesh, params, _, _, _ = ndo
    apply_fn = nd.TransformerDo().apply
    batch = next(nd.batches(mesh, 1))
    constrain = lambda b: jax.lax.with_sharding_constraint(b, NamedSharding(mesh, P("data")))
    plain = jax.jit(lambda p, b: nd.plain_line(apply_fn)(constrain(b), p))(params, batch)
    ours = jax.jit(lambda p, b: _nd_line(apply_fn, mesh, "none")(constrain(b), p))(params, batch)
    (loss_p, aux_p), g_p = plain
    (loss_o, aux_o), g_o = ours
    assert jax.tree.structure(g_o) == jax.tree.structure(g_p) == jax.tree.structure(params)
    assert aux_o.ntokens.dtype == jnp.int32 and int(aux_o.ntokens) == int(aux_p.ntokens)
    np.testing.assert_allclose(float(loss_o), float(loss_p), rtol=1e-6)
    np.testing.assert_allclose(float(aux_o.log_perplexity), float(aux_p.log_perplexity),
                               rtol=1e-6)
    for a, b, w in zip(jax.tree.leaves(g_p), jax.tree.leaves(g_o), jax.tree.leaves(params)):
        assert b.sharding.is_equivalent_to(w.sharding, w.ndim)
        assert _rel_err(a, b) <= 2e-6


@pytest.fixture(scope="module")
def nd_runs(ndo):
    mesh, params, shardings, tx, opt_state = ndo
    apply_fn = nd.TransformerDo().apply
    out = {}
    for codec in (None, "int8", "int4:rot"):
        line = nd.plain_line(apply_fn) if codec is None else _nd_line(apply_fn, mesh, codec)
        step = nd.make_train_step(mesh, shardings, tx, line)
        p, o = jax.tree.map(jnp.copy, (params, opt_state))
        data = list(nd.batches(mesh, 10, seed=1))
        report = wire.measure(step, p, o, data[0], mesh=mesh)
        losses = []
        for batch in data:
            p, o, loss, _ = step(p, o, batch)
            losses.append(float(loss))
        out[codec] = (losses, report, o)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("codec", ["int8", "int4:rot"])
def test_nanodo_compressed_steps_train_as_plain_and_send_less(ndo, nd_runs, codec):
    """10 AdamW steps with FSDP over data: the last losses within 5% of the plain step's,
    fewer bytes over data, and the optimizer state keeps the parameters'
    shardings."""
    plain_losses, plain, _ = nd_runs[None]
    losses, ours, opt_state = nd_runs[codec]
    _near(losses, plain_losses)
    assert bytes_over(ours)["data"] < 0.5 * bytes_over(plain)["data"]
    _, params, _, _, opt0 = ndo
    for a, b in zip(jax.tree.leaves(opt0), jax.tree.leaves(opt_state)):
        if a.ndim:  # the moments; the step count is a scalar
            assert b.sharding.is_equivalent_to(a.sharding, a.ndim)
