"""jcomp.collectives at users' sizes: raw sends, bucketing, pmean, invariant
operands, check_vma=False and remat names."""
import pathlib
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from benchmarks import sizes
from jcomp import codecs
from jcomp import collectives as cc
from jcomp.meter import wire

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _mesh(n):
    return jax.make_mesh((n,), ("x",), axis_types=(jax.sharding.AxisType.Explicit,),
                         devices=jax.devices()[:n])


def _put(mesh, x, spec=P("x")):
    return jax.device_put(x, NamedSharding(mesh, spec))


def _sizes_module():
    return sizes


@pytest.mark.slow
def test_no_cell_sends_more_than_lax_except_named_raw_sends():
    """The smallest form of `benchmarks/collectives.py --sizes`: every op, two
    codecs, sizes 1, 7 and 4096 on an axis of 4, each cell read from its compiled
    program. Raw cells must send exactly lax's bytes and be named raw."""
    sizes = _sizes_module()
    rows = sizes.sweep((1, 7, 4096), (4,), ("int8", "topk:0.1"), log=lambda *a, **k: None)
    assert sizes.violations(rows) == []
    by = {(r["op"], r["codec"], r["elements"]): r for r in rows}
    assert by["psum", "int8", 1]["raw"] and by["psum", "int8", 1]["ratio"] == 1.0
    # A 7-element psum over 4 owners codes 2-element blocks, not 256-element ones.
    assert by["psum", "int8", 7]["ratio"] < 1.0 and not by["psum", "int8", 7]["raw"]
    assert by["all_gather", "int8", 4096]["ratio"] <= 0.26
    # Sparse psum costs 2F at this n too (all-gathering every device's entries would be nF).
    assert by["psum", "topk:0.1", 4096]["ratio"] <= 0.21


def test_raw_send_warns_once_per_call_site_and_is_noted():
    mesh = _mesh(4)
    x = _put(mesh, jnp.arange(8.0))  # 2 elements per device: int8 cannot win

    def f(x):
        return cc.psum(x, "x", codec="int8")

    fn = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("x"), out_specs=P()))
    with jax.set_mesh(mesh), warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("default")
        rep = wire.measure(fn, x, mesh=mesh)
        np.testing.assert_array_equal(np.asarray(fn(x)), np.asarray(x).reshape(4, 2).sum(0))
    raw = [w for w in seen if issubclass(w.category, cc.RawSendWarning)]
    assert len(raw) == 1 and "int8" in str(raw[0].message) and "raw" in str(raw[0].message)
    assert raw[0].filename == __file__  # the user's line, not jcomp's
    assert any("send raw" in n and "int8" in n for n in rep.notes), rep.notes
    assert [c.dtype for c in rep.collectives] == ["f32"]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_codec_none_is_lax_bitwise_for_pytrees_and_pmean(dtype):
    """codec="none" is the lax call: values and gradients bit for bit, for every op
    on a pytree of mixed shapes in float32, bf16 and fp16 (bucketing the leaves
    into one buffer would change how a bf16 sum rounds)."""
    mesh = _mesh(4)
    rng = np.random.default_rng(0)
    tree = {"a": _put(mesh, jnp.asarray(rng.normal(size=(8, 3)), dtype)),
            "b": _put(mesh, jnp.asarray(rng.normal(size=(4,)), dtype)),
            "c": _put(mesh, jnp.asarray(rng.normal(size=(16, 8)) * 1e3, dtype))}
    pairs = ((0, 1), (1, 2), (2, 3), (3, 0))

    def run(lib):
        def body(t):
            s = lib.psum(t, "x")
            m = lib.pmean(t, "x")
            g = lib.all_gather(t, "x", axis=0, tiled=True)
            p = lib.ppermute(t, "x", pairs)
            r = lib.psum_scatter({"c": t["c"]}, "x", scatter_dimension=1, tiled=True)
            e = lib.all_to_all({"c": t["c"]}, "x", 1, 0, tiled=True)
            f32 = lambda v: v.astype(jnp.float32)
            parts = [f32((a * b).sum()) + f32(c.sum() * 0.5) + f32((d * d).sum())
                     for a, b, c, d in zip(*map(jax.tree.leaves, (s, m, g, p)))]
            return sum(parts) + f32(r["c"].sum() * 3) + f32((e["c"] ** 2).sum())

        def loss(t):
            return jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P(),
                                 check_vma=False)(t)

        return jax.jit(jax.value_and_grad(loss))(tree)

    with jax.set_mesh(mesh):
        got, want = run(cc), run(lax)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert g.dtype == w.dtype
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_pytree_psum_is_bucketed_into_one_message_per_phase():
    """Twelve leaves with int8: one all_to_all and one all_gather, not 24 (or 48 with
    codes and scales apart); each leaf's sum as accurate as alone. With codec none,
    lax's own call: its values, and however many messages lax sends."""
    mesh = _mesh(4)
    rng = np.random.default_rng(1)
    shapes = [(4 * (i + 1), 64) for i in range(12)]
    tree = [_put(mesh, jnp.asarray(rng.normal(size=s), jnp.float32)) for s in shapes]
    body = lambda t: cc.psum(t, "x", codec="int8")
    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P()))
    with jax.set_mesh(mesh):
        rep = wire.measure(fn, tree, mesh=mesh)
        got = fn(tree)
        small = jax.jit(jax.shard_map(lambda t: cc.psum(t, "x", codec="int8", bucket_bytes=1),
                                      mesh=mesh, in_specs=P("x"), out_specs=P()))
        per_leaf = wire.measure(small, tree, mesh=mesh)
        plain = jax.jit(jax.shard_map(lambda t: cc.psum(t, "x"), mesh=mesh, in_specs=P("x"),
                                      out_specs=P()))
        plain_rep = wire.measure(plain, tree, mesh=mesh)
        np.testing.assert_array_equal(np.asarray(plain(tree)[3]),
                                      np.asarray(jax.jit(jax.shard_map(
                                          lambda t: lax.psum(t, "x"), mesh=mesh, in_specs=P("x"),
                                          out_specs=P()))(tree)[3]))
    assert sorted(c.kind for c in rep.collectives) == ["all-gather", "all-to-all"]
    assert len(per_leaf.collectives) == 2 * len(shapes)
    assert {c.kind for c in plain_rep.collectives} == {"all-reduce"}
    for g, x in zip(got, tree):
        want = np.asarray(x).reshape(4, -1, 64).sum(0)
        err = np.linalg.norm(np.asarray(g) - want) / np.linalg.norm(want)
        assert err < 2e-2, err


@pytest.mark.parametrize("codec", ["int8", "int4:rot", "topk:0.1"])
def test_psum_over_two_devices_gathers_coded_rows_and_over_four_uses_owners(codec):
    """Over 2 devices a coded psum is one all_gather of the coded rows, summed on
    every device in one order: the same sum everywhere, bitwise, and the bytes of
    one coded row, which is what the owners' two phases send at n = 2. Over 4,
    gathering every row would send 3 coded rows; the owners' form sends 1.5."""
    rng = np.random.default_rng(3)
    m = 4096
    for n, kinds in ((2, ["all-gather"]), (4, ["all-gather", "all-to-all"])):
        mesh = _mesh(n)
        x_NxM = jnp.asarray(rng.normal(size=(n, m)), jnp.float32)
        fn = jax.jit(jax.shard_map(lambda a: cc.psum(a[0], "x", codec=codec)[None], mesh=mesh,
                                   in_specs=P("x"), out_specs=P("x"), check_vma=False))
        with jax.set_mesh(mesh):
            rep = wire.measure(fn, _put(mesh, x_NxM), mesh=mesh)
            got_NxM = np.asarray(fn(_put(mesh, x_NxM)))
        assert sorted(c.kind for c in rep.collectives) == kinds, rep.table()
        fitted = codecs.fit(codecs.parse(codec), m)
        row_bytes = fitted.wire_bytes((1, m), jnp.float32)
        sent = sum(c.bytes_per_device for c in rep.collectives)
        if n == 2:
            assert sent == row_bytes
        else:
            assert row_bytes < sent < (n - 1) * row_bytes
        for r in range(1, n):  # every device holds the same sum
            np.testing.assert_array_equal(got_NxM[r], got_NxM[0])
        want = np.asarray(x_NxM).sum(0)
        if codec.startswith("topk") and n == 2:
            # each row's own top 10% (410 of 4096 entries; Gaussian rows have no
            # ties), summed exactly: no second selection on a partial sum
            kept = np.zeros_like(x_NxM)
            for r, row in enumerate(np.asarray(x_NxM)):
                top = np.argsort(-np.abs(row))[:410]
                kept[r, top] = row[top]
            np.testing.assert_allclose(got_NxM[0], kept.sum(0), rtol=1e-6, atol=1e-6)
        elif not codec.startswith("topk"):
            err = np.linalg.norm(got_NxM[0] - want) / np.linalg.norm(want)
            assert err < {"int8": 1.5e-2, "int4:rot": 0.2}[codec], err


def test_psum_over_an_invariant_axis_moves_nothing():
    """lax.psum of a replicated value all-reduces n identical copies in float32; the
    compressed psum computes n * x locally, with the same result."""
    mesh = _mesh(4)
    rng = np.random.default_rng(2)
    w = _put(mesh, jnp.asarray(rng.normal(size=(512,)), jnp.float32), P())

    def run(lib, **kw):
        fn = jax.jit(jax.shard_map(lambda w: lib.psum(w, "x", **kw), mesh=mesh, in_specs=P(),
                                   out_specs=P()))
        return fn, fn(w)

    with jax.set_mesh(mesh):
        fn, got = run(cc, codec="int8")
        _, want = run(lax)
        rep = wire.measure(fn, w, mesh=mesh)
    assert rep.collectives == []
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_check_vma_false_compresses_and_differentiates_as_lax():
    """Under check_vma=False every operand counts as varying: the psum is coded
    (uint8 on the wire, no float32 collective of operand size), and its backward
    pass is a psum of the cotangent, as lax.psum's is there."""
    mesh = _mesh(4)
    rng = np.random.default_rng(3)
    x = _put(mesh, jnp.asarray(rng.normal(size=(4 * 1024,)), jnp.float32))
    c_1xM = jnp.asarray(rng.normal(size=(1024,)), jnp.float32)

    def loss(lib, **kw):
        def body(x):
            y = lib.psum(x * x, "x", **kw)
            return (y * c_1xM * (1.0 + lax.axis_index("x"))).sum()[None]
        f = jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False)
        return lambda x: f(x).sum()

    with jax.set_mesh(mesh):
        got = jax.jit(jax.value_and_grad(loss(cc, codec="int8")))(x)
        want = jax.jit(jax.value_and_grad(loss(lax)))(x)
        rep = wire.measure(jax.jit(jax.grad(loss(cc, codec="int8"))), x, mesh=mesh)
    for g, w in zip(got, want):
        err = np.linalg.norm(np.asarray(g) - np.asarray(w)) / np.linalg.norm(np.asarray(w))
        assert err < 2e-2, err
    assert rep.collectives and {c.dtype for c in rep.collectives} == {"u8"}, rep.table()


def _fsdp_residual_bytes(gather, policy):
    """Bytes of the residuals one device saves for the backward pass of the
    shard_map tutorial's FSDP MLP under remat `policy` (read while tracing)."""
    mesh = _mesh(4)
    params = [(jax.ShapeDtypeStruct((256, 256), jnp.float32, sharding=NamedSharding(mesh, P("x"))),
               jax.ShapeDtypeStruct((256,), jnp.float32, sharding=NamedSharding(mesh, P("x"))))
              for _ in range(3)]
    x = jax.ShapeDtypeStruct((32, 256), jnp.float32, sharding=NamedSharding(mesh, P("x")))
    seen = []

    def body(params, x):
        def net(params, x):
            for w, b in params:
                x = jnp.maximum(x @ gather(w) + gather(b), 0)
            return x

        out, f_vjp = jax.vjp(jax.checkpoint(net, policy=policy), params, x)
        seen.append(sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(f_vjp)))
        return out

    with jax.set_mesh(mesh):
        jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("x"), P("x")),
                              out_specs=P("x"))).lower(params, x)
    return seen[0]


def test_remat_policies_see_the_coded_gather_by_name():
    """Name-based remat policies on the shard_map tutorial's FSDP MLP: saving
    REMAT_NAMES["all_gather"] keeps the three decoded weights (no second gather
    in the backward pass); a policy naming only other values saves exactly what it
    saves with lax.all_gather."""
    policies = jax.checkpoint_policies
    lax_gather = lambda w: lax.all_gather(w, "x", tiled=True)
    cc_gather = lambda w: cc.all_gather(w, "x", tiled=True, codec="int8")
    others = policies.save_only_these_names("activations")
    base = _fsdp_residual_bytes(cc_gather, others)
    assert base == _fsdp_residual_bytes(lax_gather, others)
    kept = _fsdp_residual_bytes(cc_gather, policies.save_only_these_names(cc.REMAT_NAMES["all_gather"]))
    weights = 3 * (256 * 256 + 256) * 4  # gathered float32 weights and biases of the 3 layers
    assert kept >= weights > base, (kept, base)  # gathered weights in place of local shards


OUT_OF_RANGE = [  # (op, its call on a 2-D block, the argument it names)
    ("all_gather", lambda lib, x, kw: lib.all_gather(x, "x", axis=3, **kw), "axis"),
    ("all_gather tiled", lambda lib, x, kw: lib.all_gather(x, "x", axis=2, tiled=True, **kw),
     "axis"),
    ("psum_scatter", lambda lib, x, kw: lib.psum_scatter(x, "x", scatter_dimension=2, tiled=True,
                                                         **kw), "scatter_dimension"),
    ("psum_scatter negative", lambda lib, x, kw: lib.psum_scatter(
        x, "x", scatter_dimension=-3, tiled=True, **kw), "scatter_dimension"),
    ("all_to_all split", lambda lib, x, kw: lib.all_to_all(x, "x", 2, 0, tiled=True, **kw),
     "split_axis"),
    ("all_to_all concat", lambda lib, x, kw: lib.all_to_all(x, "x", 0, -3, tiled=True, **kw),
     "concat_axis"),
]


@pytest.mark.parametrize("op, call, arg", OUT_OF_RANGE, ids=[o[0] for o in OUT_OF_RANGE])
def test_out_of_range_axes_raise_value_error_naming_the_argument(op, call, arg):
    """As lax refuses them (IndexError, a lowering error or ValueError), so does every
    codec, with a ValueError that names the argument; nothing wraps around."""
    mesh = _mesh(2)
    x = _put(mesh, jnp.ones((4, 8), jnp.float32))

    def compile_(lib, **kw):
        fn = jax.shard_map(lambda a: call(lib, a, kw), mesh=mesh, in_specs=P("x"),
                           out_specs=P("x"), check_vma=False)
        return jax.jit(fn).lower(x).compile()

    with jax.set_mesh(mesh), warnings.catch_warnings():
        warnings.simplefilter("ignore", cc.RawSendWarning)
        with pytest.raises(Exception):
            compile_(lax)
        for codec in ("none", "int8"):
            with pytest.raises(ValueError, match=f"{arg}=-?[0-9]+ is out of range"):
                compile_(cc, codec=codec)


def test_negative_dimensions_count_from_the_end_for_every_codec():
    """scatter_dimension=-1 and all_to_all's -1 are the last axis, with "none" (lax
    itself refuses negative dimensions here) as with a codec."""
    mesh = _mesh(2)
    x = _put(mesh, jnp.arange(64.0).reshape(8, 8))
    with jax.set_mesh(mesh):
        for codec in ("none", "bf16"):
            f = lambda a, c=codec: (cc.psum_scatter(a, "x", scatter_dimension=-1, tiled=True,
                                                    codec=c),
                                    cc.all_to_all(a, "x", -1, 0, tiled=True, codec=c))
            want = lambda a: (lax.psum_scatter(a, "x", scatter_dimension=1, tiled=True),
                              lax.all_to_all(a, "x", 1, 0, tiled=True))
            run = lambda g: jax.jit(jax.shard_map(g, mesh=mesh, in_specs=P("x"),
                                                  out_specs=P("x"), check_vma=False))(x)
            for a, b in zip(run(f), run(want)):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # exact in bf16


@pytest.mark.parametrize("codec", ["none", "int8"])
def test_a_wrong_residual_is_named(codec):
    mesh = _mesh(2)
    x = _put(mesh, jnp.ones((4, 8), jnp.float32))
    bad = {"psum_ef": lambda a: cc.psum_ef({"w": a}, {"w": jnp.zeros((3,))}, "x", codec=codec),
           "psum_scatter_ef": lambda a: cc.psum_scatter_ef(
               {"w": a}, {"w": jnp.zeros((2, 3))}, "x", tiled=True, codec=codec)}
    with jax.set_mesh(mesh):
        for op, f in bad.items():
            fn = jax.shard_map(f, mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False)
            with pytest.raises(ValueError, match=rf"{op}: residual\['w'\] has shape"):
                jax.jit(fn).lower(x)
