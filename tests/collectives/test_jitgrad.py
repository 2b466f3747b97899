"""cc.value_and_grad in a MaxText-shaped jax.jit step (benchmarks/jit_step.py):
logical axis rules, a (data 4, model 2) Auto mesh, bf16 parameters beside
float32 ones, remat, AdamW, and gradient accumulation by lax.scan.

Bytes are read from the compiled steps (jcomp.meter.wire), per mesh axis. The
bfloat16 plain step and the accumulation's one reduction per step are in
experiments/checks/test_jitgrad_long.py."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from benchmarks import jit_step as js
from jcomp import collectives as cc
from jcomp.meter import wire


@pytest.fixture(scope="module")
def mesh():
    return js.make_mesh()


@pytest.fixture(scope="module")
def runs(mesh):
    """(codec, microbatches) -> (params, losses, wire report) of 20 steps, cached."""
    cache = {}

    def get(codec, microbatches=1, steps=20):
        k = (codec, microbatches, steps)
        if k not in cache:
            cache[k] = js.train(mesh, codec, steps=steps, microbatches=microbatches)
        return cache[k]

    return get


def _same(a, b):
    return all(np.array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32"])  # bfloat16: experiments/checks/test_jitgrad_long.py
def test_none_is_the_plain_step(mesh, monkeypatch, dtype):
    """codec="none" reduces with lax's all-reduce, the one XLA inserts: every axis
    carries the same bytes. Values agree to the rounding of a separately compiled
    program: the per-rank forward and backward run inside the data-manual
    shard_map, where XLA fuses and orders their float operations its own way.
    First-step gradients are within 1e-6 of each leaf's largest (seen: 2e-7,
    and the output layer bitwise); over five AdamW steps the losses agree to
    1e-4 relative (Adam turns last-bit differences of near-zero gradients into
    whole steps of the rate, and the next forward sees them)."""
    monkeypatch.setattr(js, "MLP_DTYPE", jnp.dtype(dtype))
    with jax.set_mesh(mesh):
        params, specs, _, _ = js.init(mesh)
        batch = next(js.batches(mesh, 1))
        plain = jax.jit(jax.value_and_grad(js.loss_fn))(params, batch)
        ours = jax.jit(cc.value_and_grad(js.loss_fn, mesh=mesh, param_specs=specs,
                                                mean_over="examples"))(params, batch)
    assert jnp.dtype(dtype) in {x.dtype for x in jax.tree.leaves(ours[1])}
    np.testing.assert_allclose(float(ours[0]), float(plain[0]), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(plain[1]), jax.tree.leaves(ours[1])):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert np.abs(a - b).max() <= 1e-6 * np.abs(a).max()
    _, l_plain, r_plain = js.train(mesh, None, steps=5)
    _, l_ours, r_ours = js.train(mesh, "none", steps=5)
    assert r_ours.by_axis() == r_plain.by_axis()
    assert [c.kind for c in r_ours.collectives if c.axes == ("data",)] == ["all-reduce"]
    np.testing.assert_allclose(l_ours, l_plain, rtol=1e-4)


@pytest.mark.slow
def test_int8_sends_a_quarter_over_data_and_trains_as_plain(runs):
    _, l_plain, r_plain = runs(None)
    _, l_ours, r_ours = runs("int8")
    plain, ours = r_plain.by_axis(), r_ours.by_axis()
    assert set(ours) == {"data", "model"}, ours
    assert ours["data"] <= 0.26 * plain["data"], (ours, plain)
    assert ours["model"] == plain["model"]
    assert r_ours.total() < r_plain.total()
    assert not [n for n in r_ours.notes if "raw" in n.lower()], r_ours.notes
    assert abs(l_ours[-1] / l_plain[-1] - 1) < 0.01, (l_ours[-1], l_plain[-1])
    assert l_plain[-1] < 0.5 * l_plain[0]  # the task is learned, so the 1% says something


@pytest.mark.slow
def test_scatter_and_gather_params(mesh):
    """ZeRO's form: scatter=True returns each gradient reduce-scattered over data
    (the plain gradient's values, sharded as scatter_specs says); gather_params
    brings shards back. Each sends half of an all-reduce; int8 a quarter of that."""
    with jax.set_mesh(mesh):
        params, specs, _, _ = js.init(mesh)
        batch = next(js.batches(mesh, 1))
        sspecs = cc.scatter_specs(params, specs, mesh)
        plain = jax.jit(jax.value_and_grad(js.loss_fn))(params, batch)
        reports = {}
        for codec in ("none", "int8"):
            fn = jax.jit(cc.value_and_grad(js.loss_fn, mesh=mesh, param_specs=specs, codec=codec,
                                           mean_over="examples", scatter=True))
            loss, grads = fn(params, batch)
            reports[codec] = wire.measure(fn, params, batch, mesh=mesh).by_axis()
            for g, s in zip(jax.tree.leaves(grads), jax.tree.leaves(
                    sspecs, is_leaf=lambda x: isinstance(x, P))):
                assert g.sharding.spec == s
            if codec == "none":
                assert _same(plain, (loss, grads))
        shards = jax.jit(lambda p: p, out_shardings=jax.tree.map(
            lambda s: NamedSharding(mesh, s), sspecs))(params)
        gather = jax.jit(lambda s: cc.gather_params(s, mesh=mesh, param_specs=specs))
        assert _same(gather(shards), params)
        g_int8 = wire.measure(jax.jit(lambda s: cc.gather_params(
            s, mesh=mesh, param_specs=specs, codec="int8")), shards, mesh=mesh).by_axis()
        g_none = wire.measure(gather, shards, mesh=mesh).by_axis()
    plain_bytes = wire.measure(jax.jit(jax.value_and_grad(js.loss_fn)), params, batch,
                               mesh=mesh).by_axis()
    assert reports["none"]["data"] < 0.51 * plain_bytes["data"]
    assert reports["int8"]["data"] <= 0.26 * reports["none"]["data"]
    assert g_int8["data"] <= 0.26 * g_none["data"]


def test_bad_arguments_are_named(mesh):
    vg = lambda **kw: cc.value_and_grad(js.loss_fn, mesh=mesh, **{"mean_over": "examples", **kw})
    with jax.set_mesh(mesh):
        params, specs, _, _ = js.init(mesh)
        batch = next(js.batches(mesh, 1))
        bad = jax.tree.map(lambda s: P(("data", "model")), specs,
                           is_leaf=lambda x: isinstance(x, P))
        with pytest.raises(ValueError, match=r"param_specs\['Dense_0'\]\['bias'\].*batch axes "
                                             r"\['data'\] and other axes together"):
            jax.jit(vg(param_specs=bad))(params, batch)
        with pytest.raises(ValueError, match="param_specs must have the parameters' tree"):
            jax.jit(vg(param_specs={"x": P()}))(params, batch)
        with pytest.raises(ValueError, match="param_specs=None reads|not boxed|names axes"):
            jax.jit(vg(param_specs=jax.tree.map(lambda s: P("tensor"), specs,
                                                is_leaf=lambda x: isinstance(x, P))))(params, batch)
    with pytest.raises(ValueError, match="the batch has no arrays; pass it as loss_fn's"):
        jax.jit(vg(param_specs=specs))(params, None)
    with pytest.raises(TypeError, match="mean_over"):
        cc.value_and_grad(js.loss_fn, mesh=mesh, param_specs=specs)
    with pytest.raises(ValueError, match="mean_over must be 'examples', 'sum' or a function"):
        vg(param_specs=specs, mean_over="tokens")
    with pytest.raises(ValueError, match="has_aux=True needs aux="):
        vg(param_specs=specs, has_aux=True)
    with pytest.raises(ValueError, match="aux: 'avg' is not one of"):
        vg(param_specs=specs, has_aux=True, aux={"a": "avg"})
    with pytest.raises(ValueError, match="microbatches must be a positive int; got 0"):
        vg(param_specs=specs, microbatches=0)
    with pytest.raises(ValueError, match="invalid codec spec 'int9'"):
        vg(param_specs=specs, codec="int9")
    with pytest.raises(ValueError, match="param_codec: codec powersgd"):
        vg(param_specs=specs, param_codec="powersgd:rank=2")
    with pytest.raises(ValueError, match="data_axes: 'batch' is not an axis"):
        vg(param_specs=specs, data_axes="batch")


@pytest.mark.parametrize("microbatches", [1, 2])
def test_has_aux_combines_each_leaf_by_its_rule(mesh, microbatches):
    """has_aux: each aux leaf comes back as the plain step computes it over the
    whole batch: "weighted" as the loss (a mean), "sum" a sum in its own dtype
    (an int32 count stays int32 and whole), "max" the largest."""
    def loss_and_aux(params, batch):
        loss = js.loss_fn(params, batch)
        return loss, {"twice": 2 * loss, "tokens": jnp.sum(batch["x"] >= 0),
                      "largest": jnp.max(batch["x"])}

    rules = {"twice": "weighted", "tokens": "sum", "largest": "max"}
    with jax.set_mesh(mesh):
        params, specs, _, _ = js.init(mesh)
        batch = next(js.batches(mesh, 1))
        (loss, aux), _ = jax.jit(cc.value_and_grad(
            loss_and_aux, mesh=mesh, param_specs=specs, mean_over="examples", has_aux=True,
            aux=rules, microbatches=microbatches))(params, batch)
        plain_loss, plain_aux = jax.jit(loss_and_aux)(params, batch)
    np.testing.assert_allclose(float(loss), float(plain_loss), rtol=1e-6)
    np.testing.assert_allclose(float(aux["twice"]), float(plain_aux["twice"]), rtol=1e-6)
    assert aux["tokens"].dtype == plain_aux["tokens"].dtype == jnp.int32
    assert int(aux["tokens"]) == int(plain_aux["tokens"]) == 64 * js.SEQ
    assert int(aux["largest"]) == int(plain_aux["largest"])


@pytest.mark.slow
def test_the_benchmark_reports_bytes_and_times_side_by_side(tmp_path, capsys):
    """benchmarks/jit_step.py at its smallest: both steps' bytes per axis, their
    median step times and final losses, printed and written with the commit."""
    import json

    out = tmp_path / "jit.json"
    js.main(["--codec", "int8", "--steps", "2", "--repeats", "1", "--out", str(out)])
    got = json.loads(out.read_text())
    for side in ("plain", "jcomp"):
        assert set(got[side]["bytes_by_axis"]) == {"data", "model"}
        assert len(got[side]["step_s"]) == 1 and got[side]["median_step_s"] > 0
    assert got["jcomp"]["bytes_by_axis"]["data"] <= 0.26 * got["plain"]["bytes_by_axis"]["data"]
    assert got["git_commit"]
    text = capsys.readouterr().out
    assert "bytes over data" in text and "median step: plain" in text


@pytest.mark.slow
def test_the_benchmark_refuses_a_compile_inside_its_timed_steps(monkeypatch):
    """An optimizer state laid out unlike the step's output makes the second step
    compile a second program: benchmarks/jit_step.py's timed loop raises rather
    than report that compile as step time."""
    mesh = js.make_mesh()
    init = js.init

    def replicated_state(mesh, seed=0, fsdp=False):
        params, specs, tx, _ = init(mesh, seed, fsdp)
        return params, specs, tx, jax.jit(tx.init)(params)  # moments replicated

    monkeypatch.setattr(js, "init", replicated_state)
    with pytest.raises(RuntimeError, match="compiled 1 more time"):
        js._timed(mesh, None, 2, 1)


def test_explicit_mesh_axes_work_as_auto_ones():
    """On a mesh of Explicit axes (jax.make_mesh's default) the same shard_maps run:
    none gives the plain gradient, int8 a close one, sharded as the parameter."""
    from jax.sharding import AxisType

    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
    rng = np.random.default_rng(0)
    with jax.set_mesh(mesh):
        params = {"w": jax.device_put(rng.standard_normal((16, 512)).astype(np.float32),
                                      NamedSharding(mesh, P(None, "model")))}
        x = jax.device_put(rng.standard_normal((32, 16)).astype(np.float32),
                           NamedSharding(mesh, P("data")))
        loss = lambda p, b: jnp.mean((b @ p["w"]) ** 2)
        plain = jax.jit(jax.value_and_grad(loss))(params, x)
        specs = {"w": P(None, "model")}
        none = jax.jit(cc.value_and_grad(loss, mesh=mesh, param_specs=specs,
                                         mean_over="examples"))(params, x)
        int8 = jax.jit(cc.value_and_grad(loss, mesh=mesh, param_specs=specs, codec="int8",
                                         mean_over="examples"))(params, x)
    assert _same(plain, none)
    assert int8[1]["w"].sharding.spec == P(None, "model")
    err = np.abs(np.asarray(int8[1]["w"]) - np.asarray(plain[1]["w"])).max()
    assert 0 < err < 0.02 * np.abs(np.asarray(plain[1]["w"])).max()


def test_fsdp_on_its_own_axis_stays_where_it_is():
    """(data 2, fsdp 2, model 2): parameters split over "fsdp" and "model", the batch
    over data and fsdp. The gradients keep the parameters' shardings and match
    the plain step's; XLA still reduce-scatters over fsdp, jcomp reduces over
    data (lax's all-reduce with none: the whole step's bytes within 2% of the
    plain step's, which reduce-scatters over data and fsdp in one collective;
    with int8 the data axis carries a quarter and the step fewer bytes)."""
    from jax.sharding import AxisType

    mesh = jax.make_mesh((2, 2, 2), ("data", "fsdp", "model"), axis_types=(AxisType.Auto,) * 3)
    rng = np.random.default_rng(0)
    specs = {"w1": P("fsdp", "model"), "w2": P("model", "fsdp"), "b": P("fsdp")}
    shapes = {"w1": (64, 512), "w2": (512, 64), "b": (64,)}
    with jax.set_mesh(mesh):
        params = {k: jax.device_put(rng.standard_normal(shapes[k]).astype(np.float32),
                                    NamedSharding(mesh, specs[k])) for k in specs}
        x = jax.device_put(rng.standard_normal((32, 64)).astype(np.float32),
                           NamedSharding(mesh, P(("data", "fsdp"))))
        loss = lambda p, b: jnp.mean((jnp.tanh(b @ p["w1"]) @ p["w2"] + p["b"]) ** 2)
        plain_fn = jax.jit(jax.value_and_grad(loss))
        plain = plain_fn(params, x)
        bytes_of = lambda fn: wire.measure(fn, params, x, mesh=mesh)
        r_plain = bytes_of(plain_fn)
        got = {}
        for codec in ("none", "int8"):
            fn = jax.jit(cc.value_and_grad(loss, mesh=mesh, param_specs=specs, codec=codec,
                                           mean_over="examples"))
            got[codec] = (fn(params, x), bytes_of(fn))
    (loss_none, g_none), r_none = got["none"]
    np.testing.assert_allclose(float(loss_none), float(plain[0]), rtol=1e-6)
    for k in specs:
        assert g_none[k].sharding.spec == specs[k]
        a, b = np.asarray(plain[1][k]), np.asarray(g_none[k])
        assert np.abs(a - b).max() <= 1e-6 * np.abs(a).max()
    assert abs(r_none.total() / r_plain.total() - 1) < 0.02
    r_int8 = got["int8"][1]
    assert r_int8.by_axis()["data"] <= 0.26 * r_none.by_axis()["data"]
    assert r_int8.total() < r_plain.total()


@pytest.mark.parametrize("codec", ["int8", "int4:rot"])
def test_leaves_sharing_a_bucket_stay_apart(mesh, codec):
    """bf16 and float32 leaves, and short ones padded to whole blocks, travel in
    one bucket: scaling one leaf's gradient by 1000 moves no other leaf's, bit
    for bit (no scale, rotation or block is shared)."""
    rng = np.random.default_rng(0)
    params = {"a": jnp.asarray(rng.standard_normal(100), jnp.float32),
              "b": jnp.asarray(rng.standard_normal(200), jnp.bfloat16),
              "c": jnp.asarray(rng.standard_normal((64, 256)), jnp.float32)}
    specs = {"a": P(), "b": P(), "c": P(None, "model")}

    def loss(p, batch):
        return (jnp.mean(batch["a"] @ p["a"]) + jnp.mean(batch["b"] @ p["b"].astype(jnp.float32))
                + jnp.mean(jnp.tanh(batch["c"] @ p["c"])))

    def grads(scale_a):
        batch = {"a": rng_batch[0] * scale_a, "b": rng_batch[1], "c": rng_batch[2]}
        with jax.set_mesh(mesh):
            fn = jax.jit(cc.value_and_grad(loss, mesh=mesh, param_specs=specs, codec=codec,
                                           mean_over="examples"))
            return fn(params, jax.device_put(batch, NamedSharding(mesh, P("data"))))[1]

    rng_batch = [rng.standard_normal((32, n)).astype(np.float32) for n in (100, 200, 64)]
    base, scaled = grads(1.0), grads(1000.0)
    for k in ("b", "c"):
        np.testing.assert_array_equal(np.asarray(base[k], np.float32),
                                      np.asarray(scaled[k], np.float32))
    assert not np.array_equal(np.asarray(base["a"]), np.asarray(scaled["a"]))
    report = wire.measure(jax.jit(cc.value_and_grad(loss, mesh=mesh, param_specs=specs,
                                                    codec=codec, mean_over="examples")),
                          params, jax.device_put({"a": rng_batch[0], "b": rng_batch[1],
                                                  "c": rng_batch[2]},
                                                 NamedSharding(mesh, P("data"))), mesh=mesh)
    assert not [n for n in report.notes if "raw" in n.lower()], report.notes


def test_a_codec_that_draws_runs_with_a_tensor_axis():
    """int8:sr with a key on a (data 4, model 2) mesh: the key enters the map that
    codes each device's shards as an argument (closed over, it lived on the outer
    map's mesh and JAX refused it: "Mesh for all inputs should be equal"); the
    gradients within int8's error of the plain ones, typed and raw keys alike."""
    from tests.collectives import tp_mlp

    mesh, params, x, specs = tp_mlp.make()
    loss = tp_mlp.loss
    with jax.set_mesh(mesh):
        plain = jax.jit(jax.value_and_grad(loss))(params, x)[1]
        fn = jax.jit(cc.value_and_grad(loss, mesh=mesh, param_specs=specs, codec="int8:sr",
                                       mean_over="examples", check_bytes=False))
        for key in (jax.random.key(0), jax.random.PRNGKey(0)):
            grads = fn(params, x, key)[1]
            for name in specs:
                a, b = np.asarray(plain[name]), np.asarray(grads[name])
                assert 0 < np.abs(a - b).max() <= 0.02 * np.abs(a).max()


@pytest.mark.parametrize("flag", ["False", 0, None])
def test_check_bytes_takes_only_a_bool(mesh, flag):
    """check_bytes="False" is a truthy string: it turned the check on."""
    with pytest.raises(TypeError, match=r"check_bytes must be True or False; got"):
        cc.value_and_grad(js.loss_fn, mesh=mesh, mean_over="examples", check_bytes=flag)


def test_param_specs_none_on_traced_plain_arrays_warns():
    """Plain arrays (no flax box, no NNX Variable) traced inside jax.jit carry no
    Auto axis in their types: with param_specs=None they are taken as
    replicated, and their gradients came back P() without a word. Now a warning
    says so and what to pass; the arrays' own specs, read outside jit, give
    gradients in the parameters' layout."""
    from tests.collectives import tp_mlp

    mesh, params, x, specs = tp_mlp.make()
    vg = lambda **kw: cc.value_and_grad(tp_mlp.loss, mesh=mesh, mean_over="examples",
                                        check_bytes=False, **kw)
    with jax.set_mesh(mesh):
        with pytest.warns(UserWarning, match=r"param_specs=None .* 2 parameter\(s\) traced "
                                             r"inside jax.jit .* Auto axes \['model'\]: they "
                                             r"are taken as replicated"):
            jax.jit(vg()).lower(params, x)
        own = jax.tree.map(lambda a: a.sharding.spec, params)
        grads = jax.jit(vg(param_specs=own))(params, x)[1]
    assert {k: g.sharding.spec for k, g in grads.items()} == specs


def test_called_eagerly_it_runs_as_under_jit():
    """jax.value_and_grad runs outside jit; so does its stand-in, compiled once:
    op by op, the per-rank map failed ("4 does not evenly divide 1"). Eager and
    jitted give the same loss and gradients, key by keyword included."""
    from tests.collectives import tp_mlp

    mesh, params, x, specs = tp_mlp.make()
    fn = cc.value_and_grad(tp_mlp.loss, mesh=mesh, param_specs=specs, codec="int8:sr",
                           mean_over="examples", check_bytes=False)
    key = jax.random.key(1)
    with jax.set_mesh(mesh):
        eager = fn(params, x, key=key)
        jitted = jax.jit(fn)(params, x, key)
    assert float(eager[0]) == float(jitted[0])
    assert _same(eager[1], jitted[1])
    assert {k: g.sharding.spec for k, g in eager[1].items()} == specs
