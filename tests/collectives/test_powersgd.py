"""jcomp.collectives.powersgd over the 'data' axis of an (8, 1, 1) mesh."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jcomp.gpt import mesh as jmesh
from jcomp.collectives import powersgd
from jcomp.meter import wire

D = 8
M, N, R = 256, 128, 4


@pytest.fixture(scope="module")
def mesh():
    m = jmesh.make_mesh((D, 1, 1))
    with jax.set_mesh(m):
        yield m


@functools.lru_cache(maxsize=None)
def _reduce_fn(mesh, codec, with_residual=True):
    """jit(shard_map): per-rank grads [D, *S], Q [n, R], residuals [D, *S] ->
    (mean [*S], new Q, new residuals [D, *S])."""

    def body(g, q, r):
        mean, q_new, r_new = powersgd.reduce(g[0], q, r[0] if with_residual else None, "data",
                                             codec=codec)
        return mean, q_new, (r_new if with_residual else jnp.zeros_like(g[0]))[None]

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("data"), P(), P("data")),
                                 out_specs=(P(), P(), P("data"))))


def _put(mesh, x, spec=P("data")):
    return jax.device_put(jnp.asarray(x, jnp.float32), NamedSharding(mesh, spec))


def _q0(n, rank):
    return powersgd.init_q(jax.random.key(0), (n,), rank)


def _rel(a, b):
    """Frobenius-norm relative error."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


# ------------------------------------------------------------------ spec

def test_spec_round_trip_and_defaults():
    c = powersgd.parse("PowerSGD:rank=4:factor=bf16:fallback=int8")
    assert (c.rank, c.factor_codec, c.fallback, c.min_compression) == (4, "bf16", "int8", 2.0)
    assert (c.name, c.kind) == ("powersgd", "lowrank")
    assert str(c) == "powersgd:rank=4:factor=bf16:fallback=int8"
    assert str(powersgd.PowerSGD(rank=2)) == "powersgd:rank=2"
    for spec in ("powersgd:rank=3", "powersgd:rank=1:fallback=int4",
                 "powersgd:rank=8:min_compression=4.0"):
        assert str(powersgd.parse(spec)) == spec
        assert powersgd.parse(str(powersgd.parse(spec))) == powersgd.parse(spec)
    assert powersgd.parse(c) is c


@pytest.mark.parametrize("spec,why", [
    ("powersgd", "rank is missing"),
    ("powersgd:rank=0", ">= 1"),
    ("powersgd:rank=-2", ">= 1"),
    ("powersgd:rank=2.5", "int"),
    ("powersgd:rank=two", "int"),
    ("powersgd:rank=2:rank=3", "twice"),
    ("powersgd:rank=2:power=2", "unknown option"),
    ("powersgd:rank=2:factor=int3", "int3"),
    ("powersgd:rank=2:min_compression=0.5", ">= 1"),
    ("topk:rank=2", "powersgd"),
])
def test_bad_specs_raise_naming_the_spec_and_the_form(spec, why):
    with pytest.raises(ValueError, match=why) as err:
        powersgd.parse(spec)
    assert repr(spec) in str(err.value) and "powersgd:rank=R" in str(err.value)


def test_bad_fields_raise():
    with pytest.raises(TypeError, match="rank"):
        powersgd.PowerSGD(rank=2.0)
    with pytest.raises(TypeError, match="rank"):
        powersgd.PowerSGD(rank=True)
    with pytest.raises(ValueError, match="min_compression"):
        powersgd.PowerSGD(rank=2, min_compression=float("nan"))
    with pytest.raises(TypeError):
        powersgd.parse(4)


def test_which_leaves_go_low_rank():
    c = powersgd.PowerSGD(rank=4)
    assert powersgd.matrix_shape((2, 3, 5)) == (6, 5)
    assert powersgd.compresses((M, N), c)
    assert not powersgd.compresses((M * N,), c)  # vectors stay dense
    assert not powersgd.compresses((), c)
    # (16 + 16) * 4 * 2 = 256 >= 16 * 16: low rank would not save 2x
    assert not powersgd.compresses((16, 16), c)
    assert powersgd.compresses((17, 17), c)  # 272 < 289


# ------------------------------------------------------------ the reduce

def test_exactly_rank_r_mean_is_reproduced(mesh):
    """PowerSGD's rank-R gradient equals the exact low-rank approximation for a
    gradient that is exactly rank R, to 1e-5: one step from a random Q."""
    rng = np.random.default_rng(0)
    mean = rng.normal(size=(M, R)) @ rng.normal(size=(R, N))  # exactly rank R
    noise = rng.normal(size=(D, M, N))
    noise -= noise.mean(0)  # full-rank per rank, cancelling in the mean
    grads = mean[None] + noise
    fn = _reduce_fn(mesh, powersgd.PowerSGD(rank=R))
    out, q, res = fn(_put(mesh, grads), _q0(N, R), _put(mesh, np.zeros_like(grads)))
    assert _rel(out, mean) < 1e-5
    # each rank still owes exactly what its own gradient added to the mean
    assert _rel(res, noise) < 1e-5
    # the next step, warm-started, reproduces it again
    out2, _, _ = fn(_put(mesh, grads), q, _put(mesh, np.zeros_like(grads)))
    assert _rel(out2, mean) < 1e-5


def test_warm_start_converges_to_the_best_rank_r_approximation(mesh):
    """Without error feedback, repeated steps on one gradient are power iterations
    on it: the result approaches its truncated SVD."""
    rng = np.random.default_rng(1)
    u, _ = np.linalg.qr(rng.normal(size=(M, N)))
    v, _ = np.linalg.qr(rng.normal(size=(N, N)))
    s = np.concatenate([[10.0, 8.0, 6.0, 4.0], np.full(N - R, 0.5)])
    mean = (u * s) @ v.T
    best = (u[:, :R] * s[:R]) @ v[:, :R].T
    grads = np.broadcast_to(mean, (D, M, N))
    fn = _reduce_fn(mesh, powersgd.PowerSGD(rank=R), with_residual=False)
    x, zeros, q = _put(mesh, grads), _put(mesh, np.zeros_like(grads)), _q0(N, R)
    out, q, _ = fn(x, q, zeros)
    first = _rel(out, best)
    for _ in range(8):
        out, q, _ = fn(x, q, zeros)
    # a random start is far off; each step shrinks the error by about (0.5/4)^2
    assert first > 1e-2
    assert _rel(out, best) < 1e-5


def test_error_feedback_carries_what_was_not_sent(mesh):
    """D * (sum of outputs) + sum over ranks of the final residual = sum of all
    inputs, and the running total tracks the exact one far better than without
    feedback (which keeps dropping the same directions)."""
    rng = np.random.default_rng(2)
    m, n, rank, steps = 32, 16, 2, 40
    base = rng.normal(size=(D, m, n))
    xs = [base + 0.5 * rng.normal(size=(D, m, n)) for _ in range(steps)]
    codec = powersgd.PowerSGD(rank=rank)
    with_ef, without = _reduce_fn(mesh, codec), _reduce_fn(mesh, codec, with_residual=False)
    r = _put(mesh, np.zeros((D, m, n)))
    q_ef = q_plain = _q0(n, rank)
    sent = plain = exact = 0.0
    for x in xs:
        out, q_ef, r = with_ef(_put(mesh, x), q_ef, r)
        out_plain, q_plain, _ = without(_put(mesh, x), q_plain, r)
        sent = sent + D * np.asarray(out, np.float64)
        plain = plain + D * np.asarray(out_plain, np.float64)
        exact = exact + x.sum(0)
    leftover = np.asarray(r, np.float64).sum(0)
    assert float(np.abs(leftover).max()) > 1  # rank 2 of a 32x16 matrix leaves a lot unsent
    # float32 sums over 40 steps of entries about 10 in size
    np.testing.assert_allclose(sent + leftover, exact, rtol=0, atol=1e-3)
    assert _rel(sent, exact) < _rel(plain, exact) / 4


def test_small_and_vector_leaves_use_the_fallback(mesh):
    rng = np.random.default_rng(3)
    codec = powersgd.PowerSGD(rank=4, fallback="int8")
    for shape in ((16, 16), (N,)):
        grads = rng.normal(size=(D, *shape))
        q = _q0(shape[-1], 4)
        out, q_new, res = _reduce_fn(mesh, codec)(_put(mesh, grads), q,
                                                  _put(mesh, np.zeros_like(grads)))
        mean = grads.mean(0)
        # int8 with per-block scales: about 1% error, not a rank-4 truncation
        assert 0 < _rel(out, mean) < 2e-2, shape
        np.testing.assert_array_equal(np.asarray(q_new), np.asarray(q))  # Q untouched
        # the fallback's residual keeps its rounding error, as cc.psum_ef does
        assert 0 < float(np.abs(np.asarray(res)).max()) < float(np.abs(grads).max()) / 50
    exact = powersgd.PowerSGD(rank=4)  # fallback "none": the exact mean
    grads = rng.normal(size=(D, N))
    out, _, _ = _reduce_fn(mesh, exact)(_put(mesh, grads), _q0(N, 4),
                                        _put(mesh, np.zeros_like(grads)))
    np.testing.assert_allclose(np.asarray(out), grads.mean(0), rtol=1e-5, atol=1e-6)


def test_nonfinite_gradient_stays_nonfinite(mesh):
    grads = np.random.default_rng(4).normal(size=(D, M, N))
    grads[3, 10, 20] = np.nan
    out, q, _ = _reduce_fn(mesh, powersgd.PowerSGD(rank=R))(
        _put(mesh, grads), _q0(N, R), _put(mesh, np.zeros_like(grads)))
    assert not np.isfinite(np.asarray(out)).all()
    assert not np.isfinite(np.asarray(q)).all()


def test_bad_state_shapes_raise(mesh):
    grads = _put(mesh, np.zeros((D, M, N)))
    with pytest.raises(ValueError, match="q_state"):
        _reduce_fn(mesh, powersgd.PowerSGD(rank=R)).trace(grads, _q0(N, R + 1), grads)
    with pytest.raises(ValueError, match="residual"):
        _reduce_fn(mesh, powersgd.PowerSGD(rank=R)).trace(
            grads, _q0(N, R), _put(mesh, np.zeros((D, M, N + 1))))


# ------------------------------------------------------------ wire bytes

def _data_bytes(mesh, codec):
    """Compiled data-axis bytes of one reduce of an (M, N) leaf, and the report."""
    if codec == "psum":
        fn = jax.jit(jax.shard_map(lambda g: jax.lax.psum(g[0], "data"), mesh=mesh,
                                   in_specs=P("data"), out_specs=P()))
        report = wire.measure(fn, _put(mesh, np.zeros((D, M, N))), mesh=mesh)
    else:
        fn = _reduce_fn(mesh, codec, with_residual=False)
        x = _put(mesh, np.zeros((D, M, N)))
        report = wire.measure(fn, x, _q0(N, codec.rank), x, mesh=mesh)
    assert set(report.by_axis()) <= {"data"}, report.table()
    return report.by_axis().get("data", 0.0), report


def test_compiled_program_all_reduces_only_the_factors(mesh):
    """(m + n) * R float32 numbers are all-reduced instead of m * n."""
    all_reduce = 2 * (D - 1) / D  # bytes moved per byte of an all-reduced buffer
    lowrank, report = _data_bytes(mesh, powersgd.PowerSGD(rank=R))
    # no scalar extras appear here; any would be a few bytes
    assert lowrank == pytest.approx(all_reduce * 4 * (M + N) * R, abs=64), report.table()
    dense, _ = _data_bytes(mesh, "psum")
    assert dense == all_reduce * 4 * M * N
    # bf16 factors (sent as uint16 bits) halve the factor traffic
    half, report = _data_bytes(mesh, powersgd.PowerSGD(rank=R, factor_codec="bf16"))
    assert half == pytest.approx(lowrank / 2, abs=64), report.table()
    assert all(c.dtype == "u16" for c in report.collectives), report.table()
