"""cc.outer_init / cc.outer_sync (jcomp/collectives/outer/sync.py): DiLoCo's outer
step in a jax.jit program. A two-layer MLP trains as 2 islands over mesh axis
"dcn" (each island's batch split over "data", 4 devices), the inner step a
jax.vmap over the islands inside jax.jit; the sync averages the islands'
pseudo-gradients across "dcn" with a codec. Bytes are read from the compiled
programs (jcomp.meter.wire)."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jcomp import collectives as cc
from jcomp.meter import wire

ISLANDS, D, HID, OUT, BATCH = 2, 32, 128, 64, 16
ULP = np.finfo(np.float32).eps
SPECS = {"w1": P(None, "data"), "b1": P(), "w2": P()}  # one island's: w1 split over "data"


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((ISLANDS, 4), ("dcn", "data"), axis_types=(AxisType.Auto,) * 2)


def _loss(p, x_BxD, y_BxO):
    h_BxH = jnp.tanh(x_BxD @ p["w1"] + p["b1"])
    return jnp.mean((h_BxH @ p["w2"] - y_BxO) ** 2)


def _params(seed=0):
    k1, k2 = jax.random.split(jax.random.key(seed))
    return {"w1": jax.random.normal(k1, (D, HID)) / np.sqrt(D), "b1": jnp.zeros((HID,)),
            "w2": jax.random.normal(k2, (HID, OUT)) / np.sqrt(HID)}


def _batches(mesh, steps, seed=1):
    """[steps] of (x_IxBxD, y_IxBxO), each island's batch split over "data"."""
    rng = np.random.default_rng(seed)
    teacher = rng.standard_normal((D, OUT)).astype(np.float32)
    out = []
    for _ in range(steps):
        x = rng.standard_normal((ISLANDS, BATCH, D)).astype(np.float32)
        split = NamedSharding(mesh, P("dcn", "data"))
        out.append((jax.device_put(x, split), jax.device_put(np.sin(x @ teacher), split)))
    return out


@functools.cache
def _inner(mesh, tx):
    """The islands' inner step: one optax step per island, vmapped over I; the
    parameters keep their split (as a MaxText step's out_shardings keep it)."""
    split = {k: NamedSharding(mesh, P("dcn", *s)) for k, s in SPECS.items()}

    def one(p, o, x, y):
        loss, g = jax.value_and_grad(_loss)(p, x, y)
        u, o = tx.update(g, o, p)
        return optax.apply_updates(p, u), o, loss

    def step(p, o, x, y):
        p, o, loss = jax.vmap(one)(p, o, x, y)
        return jax.lax.with_sharding_constraint(p, split), o, loss
    return jax.jit(step)


@functools.cache
def _sync(mesh, tx, codec, rows="flat"):
    return jax.jit(functools.partial(cc.outer_sync, tx=tx, mesh=mesh, axis="dcn", codec=codec,
                                     param_specs=SPECS, rows=rows))


def _start(mesh, inner_tx, outer_tx, error_feedback=False):
    params = jax.device_put(_params(), NamedSharding(mesh, P()))
    params_IxX, state = jax.jit(functools.partial(
        cc.outer_init, tx=outer_tx, mesh=mesh, axis="dcn", param_specs=SPECS,
        error_feedback=error_feedback))(params)
    assert params_IxX["w1"].sharding.spec == P("dcn", None, "data")
    return params_IxX, jax.jit(jax.vmap(inner_tx.init))(params_IxX), state


def _train(mesh, params_IxX, opt_IxX, batches, inner_tx):
    step = _inner(mesh, inner_tx)
    for x, y in batches:
        params_IxX, opt_IxX, loss = step(params_IxX, opt_IxX, x, y)
        loss.block_until_ready()  # emulated devices deadlock on queued collectives
    return params_IxX, opt_IxX


def _np(tree):
    return jax.tree.map(np.asarray, tree)


def test_h1_none_is_every_step_sgd(mesh):
    """H=1, codec "none", outer lr 1, no momentum: with SGD inside, every sync
    lands where one data-parallel SGD step on both islands' batches lands.
    Not bitwise: the sync forms anchor - params, averages and subtracts, three
    float32 roundings per step where the plain step has one; bound 8 ulp of the
    leaf's largest value per step taken (seen: at most 2.6 ulp after 2 steps)."""
    inner_tx, outer_tx = optax.sgd(0.1), optax.sgd(1.0)
    params_IxX, opt_IxX, state = _start(mesh, inner_tx, outer_tx)
    sync = _sync(mesh, outer_tx, "none")
    batches = _batches(mesh, 3)
    ref = _params()
    plain = jax.jit(lambda p, x, y: jax.tree.map(
        lambda a, g: a - 0.1 * g, p, jax.grad(lambda q: jnp.mean(jax.vmap(
            _loss, in_axes=(None, 0, 0))(q, x, y)))(p)))
    for t, batch in enumerate(batches, 1):
        params_IxX, opt_IxX = _train(mesh, params_IxX, opt_IxX, [batch], inner_tx)
        params_IxX, state = sync(params_IxX, state)
        ref = plain(ref, *batch)
        for k, r in _np(ref).items():
            got = np.asarray(params_IxX[k])
            assert np.array_equal(got[0], got[1])
            assert np.abs(got[0] - r).max() <= 8 * t * ULP * np.abs(r).max(), k


def test_sync_is_the_mean_of_the_islands(mesh):
    """H=3 over 6 steps, Adam inside, codec "none", outer lr 1, no momentum: each
    sync is the mean of the islands' parameters to 2 ulp of the leaf's largest
    |anchor| or |params| (three roundings of half an ulp; dividing by 2 islands
    is exact; seen: 0.1 ulp), every island then holds it (bitwise the same),
    and the anchor is it. The inner steps send nothing across "dcn"."""
    H = 3
    inner_tx, outer_tx = optax.adam(1e-2), optax.sgd(1.0)
    params_IxX, opt_IxX, state = _start(mesh, inner_tx, outer_tx)
    sync = _sync(mesh, outer_tx, "none")
    batches = _batches(mesh, 2 * H)
    for step, batch in enumerate(batches):
        params_IxX, opt_IxX = _train(mesh, params_IxX, opt_IxX, [batch], inner_tx)
        if (step + 1) % H:
            continue
        before, anchor = _np(params_IxX), _np(state.anchor)
        assert not np.array_equal(before["w1"][0], before["w1"][1])  # the islands differ
        params_IxX, state = sync(params_IxX, state)
        for k, p in before.items():
            got = np.asarray(params_IxX[k])
            scale = max(np.abs(p).max(), np.abs(anchor[k]).max())
            assert np.abs(got[0] - p.mean(0)).max() <= 2 * ULP * scale, k
            assert np.array_equal(got[0], got[1]) and np.array_equal(got[0], state.anchor[k])
    inner = wire.measure(_inner(mesh, inner_tx), params_IxX, opt_IxX, *batches[0], mesh=mesh)
    assert inner.by_axis().get("dcn", 0) == 0, inner.table()
    assert inner.by_axis()["data"] > 0


def _diverged(mesh, inner_tx, outer_tx, error_feedback=False, steps=3):
    params_IxX, opt_IxX, state = _start(mesh, inner_tx, outer_tx, error_feedback)
    params_IxX, _ = _train(mesh, params_IxX, opt_IxX, _batches(mesh, steps), inner_tx)
    return params_IxX, state


@pytest.mark.parametrize("codec,bound,ratio", [("int8", 0.02, 0.26), ("int4:rot", 0.15, 0.14)])
def test_coded_sync_is_the_exact_one_within_the_codec(mesh, codec, bound, ratio):
    """DiLoCo's outer step (Nesterov SGD, lr 0.7, momentum 0.9) with a coded
    pseudo-gradient: every island holds bitwise the same parameters, within the
    codec's relative L2 error (`bound`, of the largest island's pseudo-gradient
    per leaf; seen: int8 0.003, int4:rot 0.09) times lr (1 + momentum), the first
    Nesterov step's factor, of the exact step; "dcn" carries at most `ratio` of
    the uncoded sync's bytes (seen: int8 0.254, int4:rot 0.129), and "data"
    what the uncoded sync's gathers carry there."""
    lr, mom = 0.7, 0.9
    inner_tx, outer_tx = optax.adam(1e-2), optax.sgd(lr, momentum=mom, nesterov=True)
    params_IxX, state = _diverged(mesh, inner_tx, outer_tx)
    exact, _ = _sync(mesh, outer_tx, "none")(params_IxX, state)
    coded, _ = _sync(mesh, outer_tx, codec)(params_IxX, state)
    for k, p in _np(params_IxX).items():
        got, ref = np.asarray(coded[k]), np.asarray(exact[k])
        assert np.array_equal(got[0], got[1]), k
        delta = np.asarray(state.anchor[k])[None] - p
        largest = max(np.linalg.norm(d) for d in delta)
        err = np.linalg.norm(got[0] - ref[0]) / (lr * (1 + mom) * largest)
        assert err <= bound, (k, err)
    r_none = wire.measure(_sync(mesh, outer_tx, "none"), params_IxX, state, mesh=mesh).by_axis()
    r_coded = wire.measure(_sync(mesh, outer_tx, codec), params_IxX, state, mesh=mesh).by_axis()
    assert r_coded["dcn"] <= ratio * r_none["dcn"], (r_coded, r_none)
    assert r_coded["data"] == r_none["data"] and set(r_coded) == {"dcn", "data"}, r_coded


def test_each_island_crosses_once(mesh):
    """Uncoded, each device sends 1/4 of the parameters' bytes across "dcn": w1
    its own shard (split over "data"), b1 and w2 a quarter each of the copy the
    island's 4 devices share. The averaged quarters are gathered over "data"
    (3/4 of b1 and w2, raw, on the fast link); w1 is never gathered."""
    outer_tx = optax.sgd(1.0)
    params_IxX, _, state = _start(mesh, optax.sgd(0.1), outer_tx)
    by = wire.measure(_sync(mesh, outer_tx, "none"), params_IxX, state, mesh=mesh).by_axis()
    nbytes = {k: 4 * v.size for k, v in _params().items()}
    assert by["dcn"] == sum(nbytes.values()) / 4, by
    assert by["data"] == 3 / 4 * (nbytes["b1"] + nbytes["w2"]), by


def test_error_feedback_keeps_what_topk_dropped(mesh):
    """topk:0.03 with error feedback: each island sends its pseudo-gradient plus
    its residual with all but 3% of each piece zeroed and keeps the rest, bit for
    bit (sent + new residual = pseudo-gradient + old residual), and the anchor
    moves by the mean of what was sent (lr 1, no momentum; to 2 ulp). At the
    second sync the first one's residual travels too."""
    inner_tx, outer_tx = optax.adam(1e-2), optax.sgd(1.0)
    params_IxX, opt_IxX, state = _start(mesh, inner_tx, outer_tx, error_feedback=True)
    sync = _sync(mesh, outer_tx, "topk:0.03")
    batches = _batches(mesh, 4)
    for part in (batches[:2], batches[2:]):
        params_IxX, opt_IxX = _train(mesh, params_IxX, opt_IxX, part, inner_tx)
        before, old = _np(params_IxX), _np(state)
        params_IxX, state = sync(params_IxX, state)
        for k, p in before.items():
            corrected = (old.anchor[k][None] - p) + old.residual[k]
            res = np.asarray(state.residual[k])
            sent = corrected - res
            kept = sent != 0
            assert np.array_equal(res[kept], np.zeros_like(res[kept])), k
            assert np.array_equal(res[~kept], corrected[~kept]), k
            per_island = kept.reshape(ISLANDS, -1).sum(1)  # 4 devices, 3% of a quarter each
            assert (per_island >= 1).all(), k
            assert (per_island <= 4 * np.ceil(0.03 * p[0].size / 4)).all(), k
            moved = old.anchor[k] - np.asarray(state.anchor[k])
            scale = max(np.abs(old.anchor[k]).max(), np.abs(state.anchor[k]).max())
            assert np.abs(moved - sent.mean(0)).max() <= 2 * ULP * scale, k
        assert np.abs(np.asarray(state.residual["w1"])).max() > 0


@pytest.mark.parametrize("rows", ["independent", "flat"])
def test_a_row_changes_only_what_it_may(mesh, rows):
    """int4:rot, DiLoCo's outer step. rows="independent": changing one row (a
    vector along the last axis) of one island's w1 changes that row of the
    result only. rows="flat": it changes w1 only. Everything else bit for bit."""
    outer_tx = optax.sgd(0.7, momentum=0.9, nesterov=True)
    params_IxX, state = _diverged(mesh, optax.adam(1e-2), outer_tx)
    sync = _sync(mesh, outer_tx, "int4:rot", rows)
    base, _ = sync(params_IxX, state)
    w1 = np.asarray(params_IxX["w1"]).copy()
    w1[1, 5] += 10.0 * np.abs(w1).max()
    moved = dict(params_IxX, w1=jax.device_put(w1, params_IxX["w1"].sharding))
    got, _ = sync(moved, state)
    for k in base:
        a, b = np.asarray(base[k]), np.asarray(got[k])
        if k != "w1":
            assert np.array_equal(a, b), k
            continue
        changed = np.any(a != b, axis=(0, 2))
        assert changed[5]
        if rows == "independent":
            assert not changed[np.arange(D) != 5].any(), np.flatnonzero(changed)


def test_bad_arguments_are_named(mesh):
    """Each refusal names the argument (and the leaf) at fault, before tracing."""
    tx = optax.sgd(1.0)
    params = _params()
    params_IxX = jax.tree.map(lambda x: jnp.stack([x, x]), params)
    state = cc.OuterState(params, tx.init(params))
    kw = dict(tx=tx, mesh=mesh, axis="dcn")
    with pytest.raises(ValueError, match="axis 'pod'"):
        cc.outer_sync(params_IxX, state, **dict(kw, axis="pod"))
    with pytest.raises(ValueError, match="axis 'pod'"):
        cc.outer_init(params, tx, mesh=mesh, axis="pod")
    three = jax.tree.map(lambda x: jnp.stack([x, x, x]), params)
    with pytest.raises(ValueError, match=r"params_IxX\['b1'\] has shape \(3, 128\).*2 islands"):
        cc.outer_sync(three, state, **kw)
    with pytest.raises(ValueError, match=r"state.anchor has the tree structure"):
        cc.outer_sync(params_IxX, state._replace(anchor={"w1": params["w1"]}), **kw)
    with pytest.raises(ValueError, match=r"state.anchor\['w2'\] has shape"):
        cc.outer_sync(params_IxX, state._replace(anchor=dict(params, w2=params["w1"])), **kw)
    with pytest.raises(ValueError, match=r"state.residual\['b1'\] has shape"):
        cc.outer_sync(params_IxX, state._replace(residual=params), **kw)
    with pytest.raises(TypeError, match=r"params_IxX\['n'\] has dtype int32"):
        cc.outer_sync(dict(params_IxX, n=jnp.zeros((2, 4), jnp.int32)),
                      state._replace(anchor=dict(params, n=jnp.zeros(4, jnp.int32))),
                      **dict(kw, codec="int8"))
    with pytest.raises(TypeError, match=r"params\['n'\] has dtype int32"):
        cc.outer_init(dict(params, n=jnp.zeros(4, jnp.int32)), tx, mesh=mesh, axis="dcn")
    with pytest.raises(ValueError, match=r"param_specs\['w1'\] = .* islands' axis 'dcn'"):
        cc.outer_sync(params_IxX, state, **dict(kw, param_specs=dict(SPECS, w1=P("dcn"))))
    with pytest.raises(ValueError, match=r"param_specs\['b1'\] = .* names \['model'\]"):
        cc.outer_sync(params_IxX, state, **dict(kw, param_specs=dict(SPECS, b1=P("model"))))
    with pytest.raises(ValueError, match=r"param_specs\['b1'\] = .* more entries"):
        cc.outer_sync(params_IxX, state, **dict(kw, param_specs=dict(SPECS, b1=P(None, None))))
    with pytest.raises(ValueError, match="param_specs has the tree structure"):
        cc.outer_init(params, tx, mesh=mesh, axis="dcn", param_specs={"w1": P()})
    with pytest.raises(TypeError, match="tx must be an outer optimizer"):
        cc.outer_sync(params_IxX, state, **dict(kw, tx=optax.sgd))
    with pytest.raises(TypeError, match="state must be the OuterState"):
        cc.outer_sync(params_IxX, tuple(state), **kw)
    with pytest.raises(ValueError, match="rows must be one of"):
        cc.outer_sync(params_IxX, state, **dict(kw, rows="rows"))


def test_an_empty_leaf_syncs_trivially(mesh):
    """A parameter leaf of size 0 has nothing to send: it stays empty (its
    residual too), and the other leaves sync bit for bit as without it."""
    tx = optax.sgd(1.0)
    params = dict(_params(), e=jnp.zeros((0, 4)))
    drop = lambda tree: {k: v for k, v in tree.items() if k != "e"}
    scale_I = jnp.arange(1.0, ISLANDS + 1.0)  # the islands apart: island i at (i + 1) x
    # e split over 'data' (sent where it lies) or replicated (sent in pieces, gathered)
    for e_spec, codec, ef in ((P("data"), "topk:0.1", True), (P(), "none", False),
                              (P("data"), "none", False), (P(), "int8", True)):
        specs = dict(SPECS, e=e_spec)
        params_IxX, state = jax.jit(functools.partial(
            cc.outer_init, tx=tx, mesh=mesh, axis="dcn", param_specs=specs,
            error_feedback=ef))(params)
        moved = jax.tree.map(lambda x: x * scale_I.reshape((-1,) + (1,) * (x.ndim - 1)),
                             params_IxX)
        got, new = jax.jit(functools.partial(cc.outer_sync, tx=tx, mesh=mesh, axis="dcn",
                                             codec=codec, param_specs=specs))(moved, state)
        assert got["e"].shape == (ISLANDS, 0, 4) and new.anchor["e"].shape == (0, 4)
        assert not ef or new.residual["e"].shape == (ISLANDS, 0, 4)
        want, _ = _sync(mesh, tx, codec)(drop(moved), cc.OuterState(
            drop(state.anchor), tx.init(drop(state.anchor)), drop(state.residual) if ef else None))
        for k in want:
            assert np.array_equal(np.asarray(got[k]), np.asarray(want[k])), (e_spec, codec, k)


def test_a_split_that_does_not_divide_a_leaf_names_param_specs(mesh):
    """'data' (4 devices) cannot split a leaf of 6 elements: refused naming
    param_specs, the leaf, the spec, its shape and the mesh axis sizes."""
    tx = optax.sgd(1.0)
    params = dict(_params(), b1=jnp.zeros((6,)))
    params_IxX = jax.tree.map(lambda x: jnp.stack([x, x]), params)
    state = cc.OuterState(params, tx.init(params))
    specs = dict(SPECS, b1=P("data"))
    said = (r"param_specs\['b1'\] = P\('data',\) splits dimension 0 of the leaf's "
            r"shape \(6,\) \(one island's\) over data = 4 devices, which does not divide 6 "
            r"\(mesh axis sizes \{'dcn': 2, 'data': 4\}\)")
    with pytest.raises(ValueError, match=said):
        cc.outer_init(params, tx, mesh=mesh, axis="dcn", param_specs=specs)
    with pytest.raises(ValueError, match=said):
        cc.outer_sync(params_IxX, state, tx=tx, mesh=mesh, axis="dcn", param_specs=specs)


def test_explicit_mesh():
    """The same sync on a mesh of Explicit axes (nanoDO's kind), where shard_map
    inputs must carry their shardings: "none" is the islands' mean (2 ulp),
    int8 within its error, every island the same, w1's split kept."""
    mesh = jax.make_mesh((ISLANDS, 4), ("dcn", "data"), axis_types=(AxisType.Explicit,) * 2)
    tx = optax.sgd(1.0)
    params = jax.device_put(_params(), NamedSharding(mesh, P()))
    _, state = cc.outer_init(params, tx, mesh=mesh, axis="dcn", param_specs=SPECS)
    rng = np.random.default_rng(2)
    moved = {k: np.asarray(v)[None] + 0.01 * rng.standard_normal((ISLANDS,) + v.shape)
             for k, v in _params().items()}
    params_IxX = {k: jax.device_put(v.astype(np.float32), NamedSharding(mesh, P("dcn", *SPECS[k])))
                  for k, v in moved.items()}
    for codec, bound in (("none", None), ("int8", 0.02)):
        got, _ = _sync(mesh, tx, codec)(params_IxX, state)
        assert got["w1"].sharding.spec == P("dcn", None, "data")
        for k, p in _np(params_IxX).items():
            g = np.asarray(got[k])
            assert np.array_equal(g[0], g[1]), k
            if bound is None:
                assert np.abs(g[0] - p.mean(0)).max() <= 2 * ULP * np.abs(p).max(), k
            else:
                assert np.linalg.norm(g[0] - p.mean(0)) <= bound * np.linalg.norm(
                    np.asarray(state.anchor[k])[None] - p, axis=None), k


# ------------------------------------------------------------------- SparseLoCo

from jcomp.collectives.outer import sparseloco  # noqa: E402

SLC = sparseloco.SparseLoCo(k=8, chunk=256, beta=0.9)                  # packed
SLC_INDEX = sparseloco.SparseLoCo(k=8, chunk=256, beta=0.9, coder="index")
W = {"w": P(None, "data")}  # one leaf, each device's piece its own [32, 32] shard


def test_sparseloco_index_coder_keeps_k_per_chunk_on_two_bits():
    """coder="index": each chunk of 256 sends exactly 8 distinct positions (uint16)
    and 8 values packed 4 per byte with one float32 scale: decoded, a chunk holds
    at most 8 non-zeros, each -s, 0 or +s with s its largest kept magnitude."""
    x = jax.random.normal(jax.random.key(3), (1000,))
    pay = sparseloco.encode(x, SLC_INDEX)
    assert pay["index"].shape == (4, 8) and pay["index"].dtype == jnp.uint16
    assert pay["q"].shape == (4, 2) and pay["q"].dtype == jnp.uint8
    assert pay["scale"].shape == (4, 1)
    idx = np.asarray(pay["index"])
    assert all(len(set(row)) == 8 for row in idx)
    xs = np.pad(np.asarray(x), (0, 24)).reshape(4, 256)
    for r in range(4):  # the kept entries are the chunk's 8 largest in magnitude
        assert set(idx[r]) == set(np.argsort(-np.abs(xs[r]))[:8])
    out = np.pad(np.asarray(sparseloco.decode(pay, 1000, SLC_INDEX)), (0, 24)).reshape(4, 256)
    for r in range(4):
        s = np.abs(xs[r][idx[r]]).max()
        assert set(np.unique(out[r])) <= {-s, 0.0, s}
        assert np.count_nonzero(out[r]) <= 8
    assert SLC_INDEX.payload_bytes(1000) == 4 * (2 + 4 + 8 * 2)


def _quantize_packed(v):
    """numpy of the packed coder's values: +-lo, +-hi from one Lloyd step from the mean."""
    a = np.abs(v)
    t = a.mean(dtype=np.float32)
    big = a >= t
    hi = a[big].mean(dtype=np.float32) if big.any() else t
    lo = a[~big].mean(dtype=np.float32) if (~big).any() else t
    return np.where(v < 0, -1, 1).astype(np.float32) * np.where(big, hi, lo)


def test_sparseloco_packed_coder_keeps_k_per_chunk_on_four_levels():
    """The packed coder: each chunk of 256 sends its 8 largest entries as 2 B of
    2-bit codes, two float32 magnitudes and 8 positions in an Elias-Fano code of
    8 x (5 + 1) + 8 bits = 7 B (r = 5), 17 B against the index coder's 22 B;
    decoded, the positions are exact and each value is +-lo or +-hi."""
    x = jax.random.normal(jax.random.key(3), (1000,))
    pay = sparseloco.encode(x, SLC)
    assert set(pay) == {"q", "scale", "pos"}
    assert pay["q"].shape == (4, 2) and pay["scale"].shape == (4, 2)
    assert pay["pos"].shape == (4, 7) and pay["pos"].dtype == jnp.uint8
    assert SLC.payload_bytes(1000) == 4 * (2 + 8 + 7)
    xs = np.pad(np.asarray(x), (0, 24)).reshape(4, 256)
    out = np.pad(np.asarray(sparseloco.decode(pay, 1000, SLC)), (0, 24)).reshape(4, 256)
    for r in range(4):
        keep = np.sort(np.argsort(-np.abs(xs[r]))[:8])
        assert np.array_equal(np.flatnonzero(out[r]), keep)
        np.testing.assert_allclose(out[r][keep], _quantize_packed(xs[r][keep]), rtol=1e-6)
        assert len(np.unique(np.abs(out[r][keep]))) == 2


def _reference_round(anchor, p_IxX, res_IxX, c):
    """numpy SparseLoCo on one leaf split over 4 "data" devices by columns."""
    cols = anchor.shape[1] // 4
    res_new, sent = np.zeros_like(res_IxX), np.zeros_like(p_IxX)
    for i in range(ISLANDS):
        for j in range(4):
            sl = np.s_[:, j * cols:(j + 1) * cols]
            delta = (anchor - p_IxX[i])[sl]
            acc = (np.float32(c.beta) * res_IxX[i][sl] + delta).reshape(-1)
            chunks = acc.reshape(-1, c.chunk)
            out = np.zeros_like(chunks)
            for r, row in enumerate(chunks):
                keep = np.argsort(-np.abs(row), kind="stable")[:c.k]
                if c.coder == "index":
                    s = np.abs(row[keep]).max()
                    out[r, keep] = np.round(row[keep] / s) * s
                else:
                    out[r, keep] = _quantize_packed(row[keep])
            sent[i][sl] = out.reshape(delta.shape)
            res_new[i][sl] = (acc - out.reshape(-1)).reshape(delta.shape)
    mean = (sent[0] + sent[1]) / np.float32(2)
    return anchor - mean, res_new


@pytest.mark.parametrize("codec", [SLC, SLC_INDEX], ids=["packed", "index"])
def test_sparseloco_sync_matches_numpy_over_three_rounds(mesh, codec):
    """Three syncs (lr 1, no momentum) of islands that drift apart: the anchor
    and the decaying residuals follow a numpy reference of SparseLoCo (top-8 of
    every 256-entry chunk of beta * residual + pseudo-gradient, 2-bit values,
    residual = what was not sent), with either coder; within 4 ulp of the values'
    scale."""
    outer_tx = optax.sgd(1.0)
    w = jax.device_put(_params()["w1"], NamedSharding(mesh, P()))
    p_IxX, state = jax.jit(functools.partial(cc.outer_init, tx=outer_tx, mesh=mesh, axis="dcn",
                                             param_specs=W, error_feedback=True))({"w": w})
    sync = jax.jit(functools.partial(cc.outer_sync, tx=outer_tx, mesh=mesh, axis="dcn",
                                     codec=codec, param_specs=W))
    anchor, res = np.asarray(state.anchor["w"]), np.asarray(state.residual["w"])
    rng = np.random.default_rng(0)
    for _ in range(3):
        drift = rng.standard_normal((ISLANDS, D, HID)).astype(np.float32) * 0.01
        p = jax.device_put({"w": np.asarray(p_IxX["w"]) + drift},
                           NamedSharding(mesh, P("dcn", None, "data")))
        want_anchor, want_res = _reference_round(anchor, np.asarray(p["w"]), res, codec)
        p_IxX, state = sync(p, state)
        anchor, res = np.asarray(state.anchor["w"]), np.asarray(state.residual["w"])
        tol = 4 * ULP * max(np.abs(want_anchor).max(), 1.0)
        assert np.abs(anchor - want_anchor).max() <= tol
        assert np.abs(res - want_res).max() <= tol
        assert np.array_equal(np.asarray(p_IxX["w"])[0], anchor)
    assert np.abs(res).max() > 0


def test_sparseloco_sends_its_payload_and_less_than_raw(mesh):
    """The compiled sync sends across "dcn" each device's payload once (2
    islands: an all_gather sends the other island one payload): 4 chunks x
    (2 B of values + two 4 B magnitudes + 7 B of positions) per device with the
    packed coder, 4 x (16 B of uint16 positions + 2 B + a 4 B scale) with the
    index coder, under the raw sync's bytes; where the payloads would not gain,
    the piece goes raw."""
    outer_tx = optax.sgd(1.0)
    w = jax.device_put(_params()["w1"], NamedSharding(mesh, P()))
    p_IxX, state = jax.jit(functools.partial(cc.outer_init, tx=outer_tx, mesh=mesh, axis="dcn",
                                             param_specs=W, error_feedback=True))({"w": w})
    by = {}
    for name, codec in (("packed", SLC), ("index", SLC_INDEX), ("none", "none")):
        fn = jax.jit(functools.partial(cc.outer_sync, tx=outer_tx, mesh=mesh, axis="dcn",
                                       codec=codec, param_specs=W))
        by[name] = wire.measure(fn, p_IxX, state, mesh=mesh).by_axis()["dcn"]
    piece = D * HID // 4
    assert by["packed"] == SLC.payload_bytes(piece) == 4 * (2 + 8 + 7), by
    assert by["index"] == SLC_INDEX.payload_bytes(piece) == 4 * (8 * 2 + 2 + 4), by
    assert by["packed"] < by["index"] < by["none"], by
    # every entry kept, 16 islands: 15 payloads of 2.3 KB would pass 2 x 15/16 x 4 KB
    assert not sparseloco.SparseLoCo(k=256, chunk=256, coder="index").sends_less(piece, 16)
    # packed, every entry kept: 416 B a payload gains at 16 islands, not at 32 (31 x 416 B
    # against 2 x 31/32 x 4 KB)
    assert sparseloco.SparseLoCo(k=256, chunk=256).sends_less(piece, 16)
    assert not sparseloco.SparseLoCo(k=256, chunk=256).sends_less(piece, 32)
