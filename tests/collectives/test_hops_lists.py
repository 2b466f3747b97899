"""The reduce-scatter and all-gather hop by hop of a list of leaves
(jcomp.collectives.hops.reduce_scatter_hops / all_gather_hops), as the ZeRO
optimizer sends them over ('dcn', 'data'): each hop along its own dimension,
under its own message, raw hops as lax's op on the leaves in buckets, error
feedback on one hop."""
import jax
import numpy as np
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jcomp.collectives import feedback, hops
from jcomp.meter import wire

SHAPES = [(3, 16, 5), (16,), (2, 32)]  # each leaf's dimension 1 (0 for 1-D) splits 8 ways


def _mesh():
    return jax.make_mesh((2, 4), ("dcn", "ici"), axis_types=(AxisType.Explicit,) * 2)


def _leaves(seed=0):
    """Small integers: a sum of them, and a bf16 hop of them, is exact."""
    rng = np.random.default_rng(seed)
    return [rng.integers(-8, 9, (8,) + s).astype(np.float32) for s in SHAPES]


def _dim(shape):
    return 1 if len(shape) > 1 else 0


def _run(fn, leaves):
    """fn(list of this device's leaves) -> list of arrays, on every device:
    (results stacked per device, wire report)."""
    mesh = _mesh()
    every = P(("dcn", "ici"))
    body = lambda xs: [o[None] for o in fn([x[0] for x in xs])]
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(every,), out_specs=every))
    xs = [jax.device_put(x, NamedSharding(mesh, every)) for x in leaves]
    return [np.asarray(o) for o in f(xs)], wire.measure(f, xs, mesh=mesh)


def _scatter_ref(xs):
    """lax: over ici along each leaf's dimension, then over dcn."""
    out = []
    for x in xs:
        d = _dim(x.shape)
        y = lax.psum_scatter(x, "ici", scatter_dimension=d, tiled=True)
        out.append(lax.psum_scatter(y, "dcn", scatter_dimension=d, tiled=True))
    return out


def _hop_list(codec="none", messages=("fast", "slow")):
    return lambda shape: [hops.Hop("ici", message=messages[0], dim=_dim(shape)),
                          hops.Hop("dcn", codec, message=messages[1], dim=_dim(shape))]


def test_raw_and_lossless_hops_are_lax_bit_for_bit_and_meter_per_message():
    """Raw hops, in one bucket or one per leaf, and a lossless coded hop (bf16 of
    small integers) give lax's nested psum_scatter bit for bit, and the gather
    back gives lax's nested all_gather; each hop's bytes sit under its message."""
    leaves = _leaves()
    ref, _ = _run(_scatter_ref, leaves)
    for codec in ("none", "bf16"):
        for bucket_bytes in (1, 2**20):
            def fn(xs, codec=codec, bucket_bytes=bucket_bytes):
                # leaves of one dimension go together: hops carry one dim per hop
                out = [None] * len(xs)
                for d in (0, 1):
                    idx = [i for i, x in enumerate(xs) if _dim(x.shape) == d]
                    hs = _hop_list(codec)(xs[idx[0]].shape)
                    got, res = hops.reduce_scatter_hops([xs[i] for i in idx], hs, rows="flat",
                                                        bucket_bytes=bucket_bytes)
                    assert res is None
                    back = hops.all_gather_hops(got, hs[::-1], to="invarying", rows="flat",
                                                bucket_bytes=bucket_bytes)
                    for i, g, b in zip(idx, got, back):
                        out[i] = (g, b)
                return [g for g, _ in out] + [b for _, b in out]

            got, report = _run(fn, leaves)
            n = len(leaves)
            for g, r in zip(got[:n], ref):
                np.testing.assert_array_equal(g, r)
            for b, x in zip(got[n:], leaves):
                total = x.sum(axis=0)
                np.testing.assert_array_equal(b, np.broadcast_to(total, b.shape))
            by = report.by_message()
            assert set(by) == {"fast", "slow"}, by
            ici = {c.message for c in report.collectives if c.axes == ("ici",)}
            dcn = {c.message for c in report.collectives if c.axes == ("dcn",)}
            assert ici == {"fast"} and dcn == {"slow"}, (ici, dcn)


def test_error_feedback_on_the_slow_hop_is_psum_scatter_ef_on_the_piece_left():
    """ef_hop=1 with int8 on dcn: the sum and the new residual are those of
    psum_scatter_ef on what the raw ici hop leaves, bit for bit."""
    rng = np.random.default_rng(1)
    leaves = [rng.standard_normal((8, n)).astype(np.float32) for n in (8192, 4096)]

    def fn(xs):
        hs = [hops.Hop("ici"), hops.Hop("dcn", "int8")]
        pieces = [lax.psum_scatter(x, "ici", tiled=True) for x in xs]
        res = [0.01 * p for p in pieces]
        got, new = hops.reduce_scatter_hops(xs, hs, residual=res, ef_hop=1, rows="flat")
        want, want_new = feedback.psum_scatter_ef(pieces, res, "dcn", tiled=True, codec="int8",
                                                  rows="flat")
        return list(got) + list(new) + list(want) + list(want_new)

    got, _ = _run(fn, leaves)
    n = len(leaves)
    for a, b in zip(got[:2 * n], got[2 * n:]):
        np.testing.assert_array_equal(a, b)
    assert all(np.abs(r).max() > 0 for r in got[n:2 * n])
