"""The 3-D parallel GPT against the single-device reference, and its traffic. More
mesh shapes, and a layer selection with and without pipeline stages:
experiments/checks/test_parallel_long.py."""
import jax
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding

from tests.gpt import loss_and_grad
from jcomp.gpt import mesh as jmesh
from jcomp.gpt import model as gpt
from jcomp.gpt import parallel, pipeline, policy, sharding
from jcomp.meter import wire

CFG = gpt.ModelConfig(vocab_size=64, d_model=32, n_heads=8, n_layers=8, d_ff=64, max_seq_len=16)
BATCH, SEQ = 16, 8


@pytest.fixture(scope="module")
def reference():
    params = gpt.init_params(CFG, jax.random.key(0))
    batch = jax.random.randint(jax.random.key(1), (BATCH, SEQ + 1), 0, CFG.vocab_size)
    loss, grads = jax.jit(jax.value_and_grad(gpt.loss_fn), static_argnums=2)(params, batch, CFG)
    return params, batch, loss, grads


def _mesh(shape):
    n = int(np.prod(shape))
    return jmesh.make_mesh(shape, devices=jax.devices()[:n])


def _place(m, params, batch):
    return (sharding.shard_params(params, m),
            jax.device_put(batch, NamedSharding(m, sharding.BATCH_SPEC)))


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)


# Every axis at once, and a deep pipeline with tensor parallelism; the other shapes
# are in experiments/checks/test_parallel_long.py.
SHAPES = [(1, 1, 1), (2, 2, 2), (1, 2, 4)]
SHAPES_LONG = [(8, 1, 1), (1, 8, 1), (1, 1, 8), (2, 4, 1), (4, 1, 2)]


@pytest.mark.parametrize("shape", SHAPES)
def test_baseline_matches_single_device_loss_and_gradients(reference, shape):
    params, batch, ref_loss, ref_grads = reference
    m = _mesh(shape)
    fn = loss_and_grad.make_loss_and_grad(CFG, m, policy.preset("baseline"), microbatches=2)
    loss, grads = fn(*_place(m, params, batch))
    assert abs(float(loss) - float(ref_loss)) <= 1e-5 * abs(float(ref_loss))
    for path, g, r in zip(jax.tree_util.tree_leaves_with_path(grads),
                          jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        assert g.shape == r.shape
        assert _rel(g, r) <= 1e-5, (shape, jax.tree_util.keystr(path[0]), _rel(g, r))


def _compiled_report(m, pol, params, batch, microbatches=2):
    fn = loss_and_grad.make_loss_and_grad(CFG, m, pol, microbatches)
    return wire.measure(fn, *_place(m, params, batch), mesh=m)


def test_int8_on_tensor_and_pipeline_moves_int8_there(reference):
    params, batch, _, _ = reference
    m = _mesh((2, 2, 2))
    pol = policy.preset("baseline").replace({f"{a}.{k}": "int8" for a in ("tensor", "pipeline")
                                             for k in ("act", "act_grad")})
    report = _compiled_report(m, pol, params, batch)
    base = _compiled_report(m, policy.preset("baseline"), params, batch)
    # One microbatch's activation [b, L, D] in float32, per device. The only float32
    # traffic allowed on these axes is the cross-entropy's per-token statistics
    # (two numbers per token of the whole local batch: D / (2 M) = 8 times smaller
    # than one microbatch's activations here) and block scales.
    act_bytes = (BATCH // 2 // 2) * SEQ * CFG.d_model * 4
    for axis in ("tensor", "pipeline"):
        on_axis = [c for c in report.collectives if c.axes == (axis,)]
        assert any(c.dtype in ("u8", "s8") for c in on_axis), report.table()
        big_f32 = [c for c in on_axis if c.dtype == "f32" and c.bytes_per_device > act_bytes / 8]
        assert not big_f32, report.table()
        assert report.by_axis()[axis] < 0.35 * base.by_axis()[axis], (report.table(), base.table())


def test_no_implicit_full_precision_gradient_reduction(reference):
    """With every axis compressed, no float32 collective of a parameter's or an
    activation's size remains anywhere: JAX's implicit gradient psums are gone."""
    params, batch, _, _ = reference
    m = _mesh((2, 2, 2))
    report = _compiled_report(m, policy.uniform("int8"), params, batch)
    # What may stay float32: the vocab-parallel cross-entropy's two per-token
    # statistics over the local batch, and block scales / scalars below that.
    # Any gradient psum JAX inserted would carry whole weight matrices (the
    # tuple of all gradients over data is ~74 KB here) or [b, L, D] activations.
    stats_bytes = 2 * (BATCH // 2) * SEQ * 4
    assert stats_bytes < (BATCH // 2 // 2) * SEQ * CFG.d_model * 4
    big_f32 = [c for c in report.collectives
               if c.dtype == "f32" and c.bytes_per_device > stats_bytes]
    assert not big_f32, report.table()


@pytest.mark.slow
def test_compressed_training_tracks_baseline(reference):
    """A few Adam steps with int8 on tensor and pipeline stay within 1% of the baseline loss."""
    params, batch, _, _ = reference
    m = _mesh((2, 2, 2))
    pol = policy.preset("baseline").replace({f"{a}.{k}": "int8" for a in ("tensor", "pipeline")
                                             for k in ("act", "act_grad")})

    def train(pol, steps=6):
        fn = loss_and_grad.make_loss_and_grad(CFG, m, pol, microbatches=2)
        p, b = _place(m, params, batch)
        tx = optax.adam(3e-3)
        opt = tx.init(p)
        losses = []
        for _ in range(steps):
            loss, g = fn(p, b)
            losses.append(float(loss))
            updates, opt = tx.update(g, opt, p)
            p = optax.apply_updates(p, updates)
        return losses

    base, comp = train(policy.preset("baseline")), train(pol)
    assert base[-1] < base[0] - 0.05, base  # the run actually trains
    assert abs(comp[-1] - base[-1]) <= 0.01 * base[-1], (comp, base)


def _bytes_on_device0(tree):
    return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree))


@pytest.mark.parametrize("shape", [(8, 1, 1), (2, 2, 2), (1, 2, 4), (1, 8, 1)])
def test_parameter_bytes_fall_as_one_over_tensor_times_pipeline(reference, shape):
    params, _, _, _ = reference
    m = _mesh(shape)
    placed = sharding.shard_params(params, m)
    _, t, p = shape
    layers_total = sum(x.nbytes for x in jax.tree.leaves(params["layers"]))
    # Layer-wise LayerNorm params and row-parallel biases are replicated over tensor.
    replicated = sum(x.nbytes for k, x in jax.tree_util.tree_leaves_with_path(params["layers"])
                     if not set(gpt.PARAM_AXES[tuple(getattr(e, "key", e) for e in k)]) & set(
                         gpt.TENSOR_SPLIT))
    assert _bytes_on_device0(placed["layers"]) == (layers_total - replicated) // (t * p) + replicated // p
    # The embedding is split over tensor and replicated over pipeline (see parallel.py).
    assert _bytes_on_device0(placed["embed"]) == params["embed"].nbytes // t


@pytest.mark.parametrize("field,cfg_kw,shape,batch,micro", [
    ("model.n_heads", dict(n_heads=6, d_model=36), (1, 4, 2), 16, 2),
    ("model.n_layers", dict(n_layers=6), (1, 2, 4), 16, 2),
    ("batch_size", {}, (4, 1, 2), 12, 2),
    ("model.vocab_size", dict(vocab_size=66), (1, 4, 2), 16, 2),
])
def test_bad_layouts_name_the_field(field, cfg_kw, shape, batch, micro):
    cfg = gpt.ModelConfig(**{**dict(vocab_size=64, d_model=32, n_heads=8, n_layers=8, d_ff=64,
                                    max_seq_len=16), **cfg_kw})
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        sharding.check_layout(cfg, dict(zip(jmesh.AXES, shape)), batch, micro)


def test_predicted_bubble():
    assert pipeline.predicted_bubble(1, 4) == 0.0
    assert pipeline.predicted_bubble(4, 4) == pytest.approx(3 / 7)


def _loss_and_grads(pol, shape, reference, remat=False):
    params, batch, _, _ = reference
    m = _mesh(shape)
    fn = loss_and_grad.make_loss_and_grad(CFG, m, pol, microbatches=2, remat=remat)
    loss, grads = fn(*_place(m, params, batch))
    return float(loss), jax.tree.leaves(grads)


@pytest.mark.slow
def test_layer_selection_bytes_are_exactly_the_selected_layers(reference):
    """Tensor bytes grow by the same amount for every layer left uncompressed,
    whether its stages agree (static scan) or not (a conditional on the stage,
    each branch charged to the devices that take it). D2 is two layers' worth,
    measured on a selection both stages share (local layer 0 on each)."""
    params, batch, _, _ = reference
    m = _mesh((2, 2, 2))
    int8 = policy.preset("baseline").replace({"tensor.act": "int8", "tensor.act_grad": "int8"})
    rep = lambda sel: _compiled_report(m, int8.restrict(sel), params, batch)
    every = rep({}).by_axis()["tensor"]
    d2 = rep({"tensor.act": "1-3,5-7"}).by_axis()["tensor"] - every
    assert d2 > 0
    for sel, off in [({"tensor.act": "0,7"}, 6)]:
        r = rep(sel)
        assert not [n for n in r.notes if "conditional" in n], r.notes
        assert r.by_axis()["tensor"] == pytest.approx(every + off / 2 * d2, rel=1e-12), sel


@pytest.mark.slow
def test_stage_selection_sends_compressed_only_from_the_selected_stages(reference):
    """Pipeline of 4 stages. A stage's messages are its forward send (the last
    stage: the output all-reduce) and its backward send (the first stage: the
    embedding-gradient all-reduce). Each (stage, kind) message is compressed in
    exactly one of two complementary selections, so their bytes add up to the
    all-compressed run's plus the uncompressed one's. A selected boundary
    travels in a permute of its own, charged to its senders."""
    params, batch, _, _ = reference
    m = _mesh((1, 2, 4))
    int8 = policy.preset("baseline").replace({"pipeline.act": "int8",
                                              "pipeline.act_grad": "int8"})
    pipe = lambda pol: _compiled_report(m, pol, params, batch).by_axis()["pipeline"]
    none, every = pipe(policy.preset("baseline")), pipe(int8)
    one = pipe(int8.restrict({"pipeline.act": "0,3", "pipeline.act_grad": "1-2"}))
    other = pipe(int8.restrict({"pipeline.act": "1-2", "pipeline.act_grad": "0,3"}))
    assert none > one > every and none > other > every
    assert one + other == pytest.approx(every + none, rel=1e-12)
    r = _compiled_report(m, int8.restrict({"pipeline.act": "1", "pipeline.act_grad": "2"}),
                         params, batch)
    permutes = sorted((c.dtype, c.share) for c in r.collectives if c.kind == "collective-permute")
    # Forward 1->2 and backward 2->1 carry int8 codes with their scales in one u8
    # buffer, from 2 of the 8 devices each; the other boundaries' raw f32 sends come from 4.
    assert permutes == [("f32", 0.5)] * 2 + [("u8", 0.25)] * 2


def _tiny_logits_fn(pol):
    """configs/tiny.py's model on its (2, 2, 2) mesh: jitted fn(params, tokens) ->
    global logits [B, L, V], through the train step's compressed forward."""
    from jax.sharding import PartitionSpec as P

    from configs import tiny
    from jcomp.gpt import autoencoder, messages
    from jcomp.train.settings import runspec

    cfg = tiny.get_config()
    model_cfg = runspec.read(cfg, 8).sections.model
    m = _mesh(tuple(cfg.mesh[a] for a in ("data", "tensor", "pipeline")))
    plan = messages.plan(pol, model_cfg.n_layers, dict(m.shape))
    params = gpt.init_params(model_cfg, jax.random.key(0), coders=autoencoder.coders(pol))
    params = sharding.shard_params(params, m)
    specs = sharding.param_specs(params)
    body = lambda p, t: parallel.local_logits(p, t, model_cfg, plan, cfg.train.microbatches)
    fn = jax.jit(jax.shard_map(body, mesh=m, in_specs=(specs, P(sharding.DATA, None)),
                               out_specs=P(sharding.DATA, None, sharding.TENSOR),
                               check_vma=True))
    tokens_sharding = NamedSharding(m, P(sharding.DATA, None))
    return fn, params, cfg, model_cfg, tokens_sharding


@pytest.mark.parametrize("preset", ["baseline", "naive", "hybrid", "hybrid_paper", "ae"])
def test_compressed_forward_is_causal(preset):
    """Changing the tokens after position t leaves every logit at positions <= t
    unchanged, bit for bit: no codec block, scale or rotation carries a later
    token's values into an earlier token's activations. "ae": the learned
    autoencoder on tensor activations, which codes each token's vector alone."""
    pol = (policy.preset("baseline").replace({"tensor.act": "ae:dim=8",
                                              "tensor.act_grad": "ae:dim=8"})
           if preset == "ae" else policy.preset(preset))
    fn, params, cfg, model_cfg, sharding = _tiny_logits_fn(pol)
    b, L, t = cfg.train.batch_size, cfg.data.seq_len, cfg.data.seq_len // 2
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, model_cfg.vocab_size, (b, L), dtype=np.int32)
    later = tokens.copy()
    later[:, t + 1:] = (tokens[:, t + 1:] + 1 + rng.integers(0, model_cfg.vocab_size - 1,
                                                               (b, L - t - 1))) % model_cfg.vocab_size
    assert (later[:, t + 1:] != tokens[:, t + 1:]).all()
    before = np.asarray(fn(params, jax.device_put(tokens, sharding)))
    after = np.asarray(fn(params, jax.device_put(later, sharding)))
    np.testing.assert_array_equal(after[:, :t + 1], before[:, :t + 1])
    assert (after[:, t + 1:] != before[:, t + 1:]).any()  # the later tokens did reach the model
