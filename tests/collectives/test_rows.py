"""Row-locality: a lossy collective's output row depends only on the input rows
that jax.lax's op combines into it. A row is one vector along the operand's last
axis (one token's features); no block, scale, rotation or top-k selection may
span two of them, at any row length.

Each case perturbs every element of input row J on every device. Under
codec="none" that moves exactly the output elements derived from row J; under
a lossy codec, nothing else may move, bit for bit."""
import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jcomp import collectives as cc
from jcomp.gpt import mesh as jmesh

AXES = jmesh.AXES
EVERY = P(AXES)
R, J = 4, 1  # rows per device; the row perturbed
BLOCK = 16
LENGTHS = (6, BLOCK, 40)  # shorter than, equal to and longer than a block
# A cast, blocks with a rotation, a top-k and a random-k selection; the other
# codecs, and the options that draw (sr) or change the format (the FP4 and FP8
# microscale formats), are in experiments/checks/test_rows_long.py.
LOSSY = ["bf16", f"int8:block={BLOCK}:rot", "topk:0.25", "randk:0.5"]
LOSSY_LONG = ["fp16", f"fp8:block={BLOCK}", f"int8:block={BLOCK}", f"int4:block={BLOCK}",
              f"int2:block={BLOCK}", f"int4:block={BLOCK}:sr:rot", f"mxfp4:block={BLOCK}:rot",
              "mxfp8:sr", "nvfp4"]
D128 = ["int8"]
D128_LONG = ["int4:rot", "topk:0.01", "mxfp4:rot", "nvfp4"]
PERM = ((0, 1), (1, 0))


@pytest.fixture(scope="module")
def mesh():
    return jmesh.make_mesh((2, 2, 2))


def _ops(codec, rows):
    """name -> fn(x_RxC) of one device's block, each a jcomp op, a pytree op, or the
    gradient of one (the backward's codec)."""
    kw = lambda: dict(codec=codec, key=jax.random.key(7), rows=rows)
    data2, data4 = "data", ("data", "tensor")

    def grad_of(fn, ct_of=lambda x: x):
        # The backward pass alone: the gradient at a fixed point c of sum(fn(c) * ct),
        # with the cotangent ct made from x, so that row J of ct is what moves.
        return lambda x: jax.grad(lambda c: jnp.sum(fn(c) * ct_of(x)))(_weights(x.shape))

    return {
        "psum": lambda x: cc.psum(x, data2, **kw()),
        "psum_owners": lambda x: cc.psum(jnp.tile(x, (8, 1)), data4, **kw()),  # n=4: owners form
        "psum_tree": lambda x: cc.psum({"a": x, "b": x[:, ::-1] * 2.0, "c": x[:, :3]}, data4,
                                       **kw()),
        "psum_scatter_rows": lambda x: cc.psum_scatter(x, data2, scatter_dimension=0, tiled=True,
                                                       **kw()),
        "psum_scatter_last": lambda x: cc.psum_scatter(x, data2, scatter_dimension=1, tiled=True,
                                                       **kw()),
        "all_gather": lambda x: cc.all_gather(x, data2, **kw()),
        "all_gather_tiled_last": lambda x: cc.all_gather(x, data2, axis=1, tiled=True, **kw()),
        "ppermute": lambda x: cc.ppermute(x, "pipeline", PERM, **kw()),
        "all_to_all_rows": lambda x: cc.all_to_all(x, data2, 0, 0, tiled=True, **kw()),
        "all_to_all_last": lambda x: cc.all_to_all(x, data2, 1, 0, tiled=True, **kw()),
        "grad_copy_to_parallel": grad_of(lambda a: cc.copy_to_parallel(
            a, "tensor", bwd_codec=codec, key=jax.random.key(3), rows=rows) * 1.5),
        "grad_ppermute": grad_of(lambda a: cc.ppermute(a, "pipeline", PERM, **kw())),
        "grad_all_gather": grad_of(lambda a: cc.all_gather(a, data2, **kw()),
                                   lambda x: jnp.stack([x, 0.5 * x])),
        "grad_psum_scatter": grad_of(lambda a: cc.psum_scatter(
            a, data2, scatter_dimension=0, tiled=True, **kw()), lambda x: x[:R // 2]),
    }


def _weights(shape):
    return jnp.cos(jnp.arange(np.prod(shape), dtype=jnp.float32)).reshape(shape) + 2.0


@functools.lru_cache(maxsize=None)
def _program(mesh, codec, rows, lengths):
    """One compiled program: every op at every row length, fn(*x) for x[c] of
    global shape [8, R, c]."""
    ops = _ops(codec, rows)

    def body(*blocks):
        outs = {}
        for c, b in zip(lengths, blocks):
            for name, fn in ops.items():
                outs[f"{name}/{c}"] = jax.tree.map(lambda o: cc.vary(o, AXES)[None], fn(b[0]))
        return outs

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(EVERY,) * len(lengths),
                                 out_specs=EVERY))


@functools.lru_cache(maxsize=None)
def _run(mesh, codec, rows, lengths, perturbed):
    x = _inputs(lengths)[perturbed]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", cc.RawSendWarning)
        got = _program(mesh, codec, rows, lengths)(
            *[jax.device_put(x[c], NamedSharding(mesh, EVERY)) for c in lengths])
    return {k: [np.asarray(v) for v in jax.tree.leaves(t)] for k, t in got.items()}


@functools.lru_cache(maxsize=None)
def _inputs(lengths):
    rng = np.random.default_rng(0)
    x = {c: rng.standard_normal((8, R, c)).astype(np.float32) for c in lengths}
    moved = {c: x[c].copy() for c in lengths}
    for c in lengths:  # every element of row J changes, on every device
        moved[c][:, J, :] += 0.5 + rng.random((8, c)).astype(np.float32)
    return x, moved


def _changed(a, b):
    return [u != v for u, v in zip(a, b)]


def _leaks(mesh, codec, rows, lengths):
    """The cases where the lossy codec moved an output element that codec="none"
    leaves alone: {case: count}."""
    exact = [_run(mesh, "none", "independent", lengths, p) for p in (0, 1)]
    lossy = [_run(mesh, codec, rows, lengths, p) for p in (0, 1)]
    leaks = {}
    for case in exact[0]:
        allowed = _changed(exact[0][case], exact[1][case])
        seen = _changed(lossy[0][case], lossy[1][case])
        assert any(a.any() for a in allowed), case  # row J reaches this output
        n = sum(int((s & ~a).sum()) for s, a in zip(seen, allowed))
        if n:
            leaks[case] = n
    return leaks


@pytest.mark.parametrize("codec", LOSSY)
def test_lossy_codecs_keep_rows_apart(mesh, codec):
    assert _leaks(mesh, codec, "independent", LENGTHS) == {}


@pytest.mark.parametrize("codec", D128)
def test_default_blocks_keep_rows_apart_at_d128(mesh, codec):
    """configs/base.py's d_model: rows of 128 elements under the default block of 256."""
    assert _leaks(mesh, codec, "independent", (128,)) == {}


def test_flat_rows_do_mix_and_the_check_sees_it(mesh):
    """rows="flat" codes a leaf as one vector: a block spans rows, and the check above
    finds the leak (so it can fail)."""
    leaks = _leaks(mesh, f"int8:block={BLOCK}", "flat", (6,))
    assert "psum/6" in leaks and "ppermute/6" in leaks, leaks


def test_rows_is_checked(mesh):
    fn = jax.shard_map(lambda x: cc.psum(x, "data", codec="int8", rows="token"), mesh=mesh,
                       in_specs=EVERY, out_specs=EVERY)
    with pytest.raises(ValueError, match="rows must be one of 'independent', 'flat'; got 'token'"):
        jax.jit(fn)(jax.device_put(np.zeros((8, 4), np.float32), NamedSharding(mesh, EVERY)))


# rows="flat": leaves share buckets, but never a block.
FLAT_OPS = {
    "psum": lambda t, c: cc.psum(t, ("data", "tensor"), codec=c, rows="flat"),
    "psum_scatter": lambda t, c: cc.psum_scatter(t, "data", tiled=True, codec=c, rows="flat"),
    "all_gather": lambda t, c: cc.all_gather(t, "data", tiled=True, codec=c, rows="flat"),
    "psum_ef": lambda t, c: cc.psum_ef(t, jax.tree.map(jnp.zeros_like, t), ("data", "tensor"),
                                       codec=c, rows="flat")[0],
    "psum_scatter_ef": lambda t, c: cc.psum_scatter_ef(
        t, jax.tree.map(jnp.zeros_like, t), "data", tiled=True, codec=c, rows="flat")[0],
}


def _flat_leaves(seed):
    """A leaf whose length no block divides (first, so a block would run on into
    the next leaf), a small leaf of tiny values, a large one: per device."""
    rng = np.random.default_rng(seed)
    return {"a_odd": rng.standard_normal((8 * 100,)).astype(np.float32),
            "b_small": (1e-3 * rng.standard_normal((8 * 512,))).astype(np.float32),
            "c_big": rng.standard_normal((8 * 4096,)).astype(np.float32)}


@functools.lru_cache(maxsize=None)
def _flat_program(mesh, op, codec):
    # One compile for the base and each perturbed run: same shapes, same program.
    return jax.jit(jax.shard_map(lambda t: FLAT_OPS[op](t, codec), mesh=mesh, in_specs=EVERY,
                                 out_specs=EVERY, check_vma=False))


def _flat_run(mesh, op, codec, tree):
    placed = {k: jax.device_put(v, NamedSharding(mesh, EVERY)) for k, v in tree.items()}
    return jax.tree.map(np.asarray, _flat_program(mesh, op, codec)(placed))


FLAT_CODECS = ["int4:rot"]
FLAT_CODECS_LONG = ["int8", "fp8", "topk:0.05", "nvfp4"]


@pytest.mark.parametrize("op", sorted(FLAT_OPS))
@pytest.mark.parametrize("codec", FLAT_CODECS)
def test_flat_bucket_leaves_do_not_mix(mesh, op, codec):
    """Scaling one leaf of a flat bucket by 1000 on every device moves no element
    of the other leaves, bit for bit: no block, scale, rotation or top-k budget
    spans two leaves."""
    leaves = _flat_leaves(3)
    base = _flat_run(mesh, op, codec, leaves)
    for moved in leaves:
        out = _flat_run(mesh, op, codec, {**leaves, moved: leaves[moved] * 1000.0})
        for name in leaves:
            if name != moved:
                np.testing.assert_array_equal(out[name], base[name],
                                              err_msg=f"{moved} moved {name}")


def test_flat_bucket_small_leaf_error_is_its_own(mesh):
    """A small leaf of tiny gradients beside large ones: its error in the bucket is
    its error when reduced alone (the same blocks; the all-reduce's form may
    differ with the bucket's size, hence a bound rather than bit equality), not
    the large leaves' scale (before leaves kept to block boundaries: 100x)."""
    leaves = _flat_leaves(4)
    exact = leaves["b_small"].reshape(8, -1).reshape(2, 2, 2, -1).sum(axis=(0, 1))
    # device (d, t, p) holds the sum over d and t of its pipeline index p's pieces
    rel = lambda got: np.abs(got.reshape(8, -1) - np.tile(exact, (4, 1))).max() / np.abs(
        exact).max()
    together = rel(_flat_run(mesh, "psum", "int8", leaves)["b_small"])
    alone = rel(_flat_run(mesh, "psum", "int8", {"b_small": leaves["b_small"]})["b_small"])
    assert together <= 1.5 * alone, (together, alone)
    assert alone < 0.02, alone
