"""cc.psum / cc.pmean with a codec per mesh axis (jcomp/collectives/hops.py):
raw over the fast hop, coded over the slow one, hierarchically. Bytes are
read from compiled programs (jcomp.meter.wire), per mesh axis."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jcomp import collectives as cc
from jcomp.meter import wire

MESHES = {(2, 4): ("dcn", "ici"), (4, 2): ("dcn", "ici"), (2, 2, 2): ("dcn", "ici", "chip")}


def _mesh(shape):
    names = MESHES[shape]
    return jax.make_mesh(shape, names, axis_types=(AxisType.Explicit,) * len(names))


def _run(mesh, fn, x, grad=False):
    """fn on each device's block (leading dim: one per device) -> (result, report)."""
    every = P(mesh.axis_names)
    weight = lambda b: (jnp.arange(b.size) % 17 - 8).astype(b.dtype).reshape(b.shape)
    body = (lambda a: fn(a[0])[None]) if not grad else (  # linear: the gradient is exact
        lambda a: jax.grad(lambda b: jnp.sum(_weighted(fn(b), weight)))(a[0])[None])
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=every, out_specs=every))
    x = jax.device_put(x, NamedSharding(mesh, every))
    return np.asarray(f(x)), wire.measure(f, x, mesh=mesh)


def _weighted(out, weight):
    return out * weight(out)


def _data(n_dev, shape=(64, 512), seed=0, dtype=np.float32):
    return np.random.default_rng(seed).standard_normal((n_dev,) + shape).astype(dtype)


@pytest.mark.parametrize("shape", list(MESHES))
@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
def test_uncoded_hops_are_lax_psum_bitwise(shape, dtype):
    """A dict that codes no axis (or names "none") is lax.psum itself, values and
    gradients bit for bit, and sends what lax sends."""
    mesh = _mesh(shape)
    axes = mesh.axis_names
    x = _data(mesh.size, dtype=np.float32).astype(dtype)
    ref, r_ref = _run(mesh, lambda a: lax.psum(a, axes), x)
    for codec in ({}, {axes[0]: "none"}):
        got, r_got = _run(mesh, lambda a: cc.psum(a, axes, codec=codec), x)
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(ref, np.float32))
        assert r_got.by_axis() == r_ref.by_axis()
    g_ref, _ = _run(mesh, lambda a: lax.psum(a, axes), x, grad=True)
    g_got, _ = _run(mesh, lambda a: cc.psum(a, axes, codec={}), x, grad=True)
    np.testing.assert_array_equal(np.asarray(g_got, np.float32), np.asarray(g_ref, np.float32))


@pytest.mark.parametrize("shape", list(MESHES))
@pytest.mark.parametrize("codec,bound", [("int8", 0.02), ("int4:rot", 0.2)])
def test_slow_hop_coded_fast_hops_raw(shape, codec, bound):
    """codec={"dcn": c}: the result within c's error of lax.psum (the error of one
    coded reduction over dcn, never more than the flat coded psum over every
    axis); "dcn" carries at most 1/n_fast of the flat coded psum's bytes; the
    fast axes carry no more than lax's reduce-scatter plus all-gather over them
    (lax.psum over them alone), and nothing raw crosses "dcn"."""
    mesh = _mesh(shape)
    axes = mesh.axis_names
    slow, fast = axes[0], axes[1:]
    n_fast = int(np.prod([mesh.shape[a] for a in fast]))
    x = _data(mesh.size)
    ref, _ = _run(mesh, lambda a: lax.psum(a, axes), x)
    hop, r_hop = _run(mesh, lambda a: cc.psum(a, axes, codec={slow: codec}), x)
    flat, r_flat = _run(mesh, lambda a: cc.psum(a, axes, codec=codec), x)
    scale = np.abs(ref).max()
    assert np.abs(hop - ref).max() <= bound * scale
    assert np.abs(hop - ref).max() <= np.abs(flat - ref).max() * 1.05
    by = r_hop.by_axis()
    assert by[slow] <= r_flat.total() / n_fast, (by, r_flat.by_axis())
    _, r_fast = _run(mesh, lambda a: lax.psum(a, fast), x)
    assert sum(v for k, v in by.items() if k != slow) <= r_fast.total(), (by, r_fast.by_axis())
    assert all(c.dtype in ("u8", "s8") for c in r_hop.collectives if c.axes == (slow,))
    np.testing.assert_allclose(
        *(_run(mesh, lambda a: f(a, axes, codec={slow: codec}), x)[0] for f in (cc.pmean,)),
        hop / mesh.size, rtol=1e-6)


@pytest.mark.parametrize("rows", ["independent", "flat"])
def test_one_row_moves_only_its_own_sum(rows):
    """Perturbing one row of one device's block changes that row of the sum and no
    other (rows="independent"); rows="flat" keeps leaves apart: a second leaf in
    the same call does not move."""
    mesh = _mesh((2, 4))
    axes = mesh.axis_names
    x = _data(mesh.size, (16, 256))
    y = x.copy()
    y[3, 5] *= 1000.0
    codec = {"dcn": "int4:rot"}
    if rows == "independent":
        a, _ = _run(mesh, lambda b: cc.psum(b, axes, codec=codec, rows=rows), x)
        b, _ = _run(mesh, lambda b: cc.psum(b, axes, codec=codec, rows=rows), y)
        moved = np.nonzero(np.any(a != b, axis=(0, 2)))[0]
        assert list(moved) == [5]
    else:
        other = _data(mesh.size, (16, 256), seed=1)
        pair = lambda b: sum(cc.psum([b, jnp.asarray(other[0])], axes, codec=codec,
                                     rows=rows)[1:])
        a, _ = _run(mesh, pair, x)
        b, _ = _run(mesh, pair, y)
        np.testing.assert_array_equal(a, b)


def test_gradient_moves_nothing_under_check_vma():
    """As lax.psum's: the transpose of an all-reduce into an invariant value is a
    local cast, so the gradient equals lax's bit for bit and the backward sends
    nothing (the loss is linear, so XLA drops the forward: the gradient program
    holds no collective at all, lax's neither)."""
    mesh = _mesh((2, 4))
    axes = mesh.axis_names
    x = _data(mesh.size)
    g_ref, _ = _run(mesh, lambda a: lax.psum(a, axes), x, grad=True)
    g_hop, r = _run(mesh, lambda a: cc.psum(a, axes, codec={"dcn": "int8"}), x, grad=True)
    np.testing.assert_array_equal(g_hop, g_ref)
    assert r.total() == 0, r.by_axis()


def test_bad_arguments_are_named():
    mesh = _mesh((2, 4))
    axes = mesh.axis_names
    x = _data(mesh.size)
    with pytest.raises(ValueError, match=r"codec names axes \['tensor'\]"):
        _run(mesh, lambda a: cc.psum(a, axes, codec={"tensor": "int8"}), x)
    with pytest.raises(ValueError, match=r"codec\['dcn'\]: invalid codec spec 'int9'"):
        _run(mesh, lambda a: cc.psum(a, axes, codec={"dcn": "int9"}), x)
    with pytest.raises(TypeError, match="codes floating-point arrays; got a leaf of dtype int32"):
        _run(mesh, lambda a: cc.psum(a.astype(jnp.int32), axes, codec={"dcn": "int8"}), x)
    with pytest.raises(ValueError, match="key="):
        _run(mesh, lambda a: cc.psum(a, axes, codec={"dcn": "int8:sr"}), x)
    with pytest.raises(ValueError, match=r"codec names the axis 'tensor', not one of data_axes"):
        cc.value_and_grad(jnp.sum, mesh=mesh, param_specs=None, mean_over="sum",
                          data_axes=axes, codec={"tensor": "int8"})


def test_value_and_grad_codes_only_the_slow_hop():
    """A jit step on (dcn 2, ici 2, tensor 2), the batch over dcn and ici, the
    parameters split over ici (FSDP) and tensor: codec={"dcn": "int8"} sends int8
    across dcn only (on the pieces the ici reduce-scatter leaves) and raw over
    ici; the gradients within int8's error of the plain step's and with the
    parameters' shardings; dcn carries under 0.3 of the uncoded step's bytes
    there, ici no more than the uncoded step's."""
    from benchmarks.jit_step import bytes_over

    mesh = jax.make_mesh((2, 2, 2), ("dcn", "ici", "tensor"), axis_types=(AxisType.Auto,) * 3)
    rng = np.random.default_rng(0)
    specs = {"w1": P("ici", "tensor"), "w2": P("tensor", "ici"), "b": P()}
    shapes = {"w1": (64, 512), "w2": (512, 64), "b": (64,)}
    loss = lambda p, x: jnp.mean((jnp.tanh(x @ p["w1"]) @ p["w2"] + p["b"]) ** 2)
    with jax.set_mesh(mesh):
        params = {k: jax.device_put(rng.standard_normal(shapes[k]).astype(np.float32),
                                    NamedSharding(mesh, specs[k])) for k in specs}
        x = jax.device_put(rng.standard_normal((32, 64)).astype(np.float32),
                           NamedSharding(mesh, P(("dcn", "ici"))))
        plain = jax.jit(jax.value_and_grad(loss))(params, x)
        got = {}
        for name, codec in (("none", "none"), ("hop", {"dcn": "int8"})):
            fn = jax.jit(cc.value_and_grad(loss, mesh=mesh, param_specs=specs, codec=codec,
                                           mean_over="examples", data_axes=("dcn", "ici")))
            got[name] = (fn(params, x), wire.measure(fn, params, x, mesh=mesh))
    (_, g_hop), r_hop = got["hop"]
    _, r_none = got["none"]
    for k in specs:
        assert g_hop[k].sharding.spec == specs[k]
        a, b = np.asarray(plain[1][k]), np.asarray(g_hop[k])
        assert np.abs(a - b).max() <= 0.02 * np.abs(a).max()
    for c in r_hop.collectives:
        if c.axes == ("dcn",):
            assert c.dtype in ("u8", "s8"), c
        if c.axes == ("ici",):
            assert c.dtype == "f32", c
    hop, none = bytes_over(r_hop), bytes_over(r_none)
    assert hop["dcn"] < 0.3 * none["dcn"], (hop, none)
    assert hop["ici"] <= none["ici"], (hop, none)


def _ints(n_dev, shape=(16, 64)):
    """Small integers as float32: bf16 holds them and their sums exactly, so a
    bf16 hop is lossless and any misplaced block shows bit for bit."""
    return np.random.default_rng(0).integers(-8, 9, (n_dev,) + shape).astype(np.float32)


@pytest.mark.parametrize("shape", list(MESHES))
@pytest.mark.parametrize("dim", [0, 1])
def test_scatter_and_gather_per_hop_lay_blocks_out_as_lax(shape, dim):
    """psum_scatter and all_gather with a codec on one hop put every block where
    lax puts it, for each order of the axes and tiled or not: with a lossless
    hop (bf16 of small integers) values and gradients equal lax's bit for bit."""
    mesh = _mesh(shape)
    names = mesh.axis_names
    x = _ints(mesh.size)
    codec = {names[0]: "bf16"}
    for axes in (names, names[::-1]):
        cases = [(lambda a: lax.psum_scatter(a, axes, scatter_dimension=dim, tiled=True),
                  lambda a: cc.psum_scatter(a, axes, scatter_dimension=dim, tiled=True,
                                            codec=codec)),
                 (lambda a: lax.all_gather(a, axes, axis=dim, tiled=True),
                  lambda a: cc.all_gather(a, axes, axis=dim, tiled=True, codec=codec)),
                 (lambda a: lax.all_gather(a, axes, axis=dim),
                  lambda a: cc.all_gather(a, axes, axis=dim, codec=codec))]
        if dim == 0:
            cases.append((lambda a: lax.psum_scatter(a[:mesh.size], axes),
                          lambda a: cc.psum_scatter(a[:mesh.size], axes, codec=codec)))
        for ref_fn, hop_fn in cases:
            np.testing.assert_array_equal(_run(mesh, hop_fn, x)[0], _run(mesh, ref_fn, x)[0])
            np.testing.assert_array_equal(_run(mesh, hop_fn, x, grad=True)[0],
                                          _run(mesh, ref_fn, x, grad=True)[0])


@pytest.mark.parametrize("shape", [(2, 4), (4, 2)])
def test_scatter_and_gather_code_only_the_slow_hop(shape):
    """int8 on dcn: what crosses dcn is int8 codes and scales on 1/n_ici of the
    data (the reduce-scatter runs over ici first; the gather over dcn first),
    within int8's error; ici carries what lax's op over ici alone carries."""
    mesh = _mesh(shape)
    names = mesh.axis_names
    n_ici = mesh.shape["ici"]
    x = _data(mesh.size)
    for ref_fn, hop_fn, flat_fn, ici_fn in [
            (lambda a: lax.psum_scatter(a, names, tiled=True),
             lambda a: cc.psum_scatter(a, names, tiled=True, codec={"dcn": "int8"}),
             lambda a: cc.psum_scatter(a, names, tiled=True, codec="int8"),
             lambda a: lax.psum_scatter(a, "ici", tiled=True)),
            (lambda a: lax.all_gather(a, names, tiled=True),
             lambda a: cc.all_gather(a, names, tiled=True, codec={"dcn": "int8"}),
             lambda a: cc.all_gather(a, names, tiled=True, codec="int8"),
             lambda a: lax.all_gather(lax.all_gather(a, "dcn", tiled=True), "ici", tiled=True))]:
        ref, _ = _run(mesh, ref_fn, x)
        hop, r_hop = _run(mesh, hop_fn, x)
        _, r_flat = _run(mesh, flat_fn, x)
        _, r_ici = _run(mesh, ici_fn, x)
        assert np.abs(hop - ref).max() <= 0.02 * np.abs(ref).max()
        by = r_hop.by_axis()
        assert by["dcn"] <= r_flat.total() / n_ici * 1.01, (by, r_flat.by_axis())
        assert by["ici"] <= r_ici.by_axis()["ici"], (by, r_ici.by_axis())
        assert all(c.dtype in ("u8", "s8") for c in r_hop.collectives if c.axes == ("dcn",))


@pytest.mark.parametrize("shape", [(2, 4), (4, 2)])
def test_error_feedback_per_hop_carries_what_the_slow_hop_lost(shape):
    """psum_ef with int2 on dcn only: over two dcn devices (the coded all-reduce
    gathers, nothing is re-coded) a step's sum plus the residuals' sum is exact:
    the raw hop loses nothing and what the coded hop lost is in the residuals;
    the residual is nonzero only on the piece this device sent; over repeated
    steps of the same x the mean of the sums is closer to lax's than one coded
    step."""
    mesh = _mesh(shape)
    axes = mesh.axis_names
    x = _data(mesh.size, (16, 256))
    codec = {"dcn": "int2"}

    def steps(a):
        res = jnp.zeros_like(a)
        sums = []
        for _ in range(8):
            total, res = cc.psum_ef(a, res, axes, codec=codec)
            sums.append(total)
        first, res1 = cc.psum_ef(a, jnp.zeros_like(a), axes, codec=codec)
        exact = first + lax.psum(res1, axes)
        return jnp.stack([sum(sums) / len(sums), exact, lax.psum((res1 != 0) * 1.0, axes)])

    got, r = _run(mesh, steps, x)
    ref, _ = _run(mesh, lambda a: lax.psum(a, axes), x)
    mean, exact, nonzero = got[:, 0], got[:, 1], got[:, 2]
    if mesh.shape["dcn"] == 2:
        np.testing.assert_allclose(exact, ref, rtol=1e-5, atol=1e-4)
    one_step, _ = _run(mesh, lambda a: cc.psum(a, axes, codec=codec), x)
    assert np.abs(mean - ref).max() < 0.5 * np.abs(one_step - ref).max()
    # each position of the residual is held by one device of each ici group at most
    assert nonzero.max() <= mesh.shape["dcn"]
    assert all(c.dtype in ("u8", "s8") for c in r.collectives if c.axes == ("dcn",))
