"""Tests for jcomp.gpt.model: shapes, causality, learning, and the tensor-parallel
decomposition of a Block that the parallel layouts rely on."""
import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jcomp.gpt import model as M

CFG = M.ModelConfig(vocab_size=64, d_model=32, n_heads=4, n_layers=2, d_ff=64, max_seq_len=16)
B, L = 2, 8
# Compiled once per config; op-by-op flax is slow on two cores.
loss_fn = jax.jit(M.loss_fn, static_argnums=(2, 3))
head_logits = jax.jit(M.head_logits, static_argnums=2)


def _tokens(key, shape, cfg=CFG):
    return jax.random.randint(jax.random.key(key), shape, 0, cfg.vocab_size)


@pytest.fixture(scope="module")
def params():
    return jax.jit(M.init_params, static_argnums=0)(CFG, jax.random.key(0))


@pytest.fixture(scope="module")
def grad_batch():
    return _tokens(9, (B, L + 1))


@pytest.fixture(scope="module")
def ref_value_and_grads(params, grad_batch):
    """The single-device reference every other gradient is compared against."""
    return jax.jit(jax.value_and_grad(lambda p: M.loss_fn(p, grad_batch, CFG)))(params)


def _path_keys(path):
    return tuple(k.key for k in path)


def _tensor_dim(path):
    """The dim of a Block parameter Megatron splits across tensor ranks, or None."""
    axes = M.PARAM_AXES[_path_keys(path)]
    split = [i for i, a in enumerate(axes) if a in M.TENSOR_SPLIT]
    assert len(split) <= 1, axes
    return split[0] if split else None


def split_for_tensor_ranks(block_params, T, layer_axis=False):
    """Stacks T rank slices on a new leading axis, cutting each leaf along its
    split dim (PARAM_AXES) and copying replicated leaves."""
    shift = 1 if layer_axis else 0

    def split(path, x):
        dim = _tensor_dim(path)
        if dim is None:
            return jnp.broadcast_to(x, (T,) + x.shape)
        return jnp.stack(jnp.split(x, T, axis=dim + shift))

    return jax.tree_util.tree_map_with_path(split, block_params)


def _psum_tp(y):
    return jax.lax.psum(y, "tp")


# ---------------------------------------------------------------- config


@pytest.mark.parametrize(
    "changes, field, exc",
    [
        ({"d_model": 30}, "d_model", ValueError),  # 30 % 4 heads
        ({"d_model": 12, "n_heads": 4}, "head_dim", ValueError),  # odd head_dim breaks RoPE
        ({"vocab_size": 0}, "vocab_size", ValueError),
        ({"n_layers": -1}, "n_layers", ValueError),
        ({"d_ff": 64.0}, "d_ff", TypeError),
        ({"n_heads": True}, "n_heads", TypeError),
        ({"max_seq_len": 0}, "max_seq_len", ValueError),
        ({"dtype": "float16"}, "dtype", ValueError),
        ({"tie_embeddings": 1}, "tie_embeddings", TypeError),
        ({"rope_base": -1.0}, "rope_base", ValueError),
        ({"init_std": float("nan")}, "init_std", ValueError),
        ({"ln_eps": 0.0}, "ln_eps", ValueError),
    ],
)
def test_config_validate_names_field(changes, field, exc):
    with pytest.raises(exc, match=field):
        dataclasses.replace(CFG, **changes)


def test_config_is_frozen_and_derives_sizes():
    assert CFG.head_dim == 8 and CFG.compute_dtype == jnp.float32
    with pytest.raises(dataclasses.FrozenInstanceError):
        CFG.d_model = 64


# ---------------------------------------------------------------- shapes


def test_param_shapes_and_dtypes(params):
    V, D, H, K, F, N = 64, 32, 4, 8, 64, 2
    shapes = jax.tree.map(lambda x: x.shape, params)
    assert shapes == {
        "embed": (V, D),
        "final_ln": {"scale": (D,), "bias": (D,)},
        "layers": {
            "ln1": {"scale": (N, D), "bias": (N, D)},
            "qkv": {"kernel": (N, D, 3, H, K), "bias": (N, 3, H, K)},
            "attn_out": {"kernel": (N, H, K, D)},
            "attn_out_bias": (N, D),
            "ln2": {"scale": (N, D), "bias": (N, D)},
            "mlp_in": {"kernel": (N, D, F), "bias": (N, F)},
            "mlp_out": {"kernel": (N, F, D)},
            "mlp_out_bias": (N, D),
        },
    }
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(params))
    assert M.param_count(params) == sum(math.prod(s) for s in jax.tree.leaves(
        shapes, is_leaf=lambda s: isinstance(s, tuple)))


def test_layers_get_distinct_init_and_scaled_output_projections(params):
    qkv = params["layers"]["qkv"]["kernel"]
    assert not np.allclose(qkv[0], qkv[1])
    std_in = float(jnp.std(params["layers"]["mlp_in"]["kernel"]))
    std_out = float(jnp.std(params["layers"]["mlp_out"]["kernel"]))
    # 4096 samples each: sample std is within a few percent of 0.02 and 0.01.
    assert abs(std_in - 0.02) < 0.002
    assert abs(std_out - 0.02 / math.sqrt(2 * CFG.n_layers)) < 0.001


def test_tensor_sharded_dims_cover_block_params(params):
    paths = {_path_keys(p) for p, _ in jax.tree_util.tree_leaves_with_path(params["layers"])}
    assert paths == set(M.PARAM_AXES)
    assert all(len(M.PARAM_AXES[_path_keys(p)]) == x.ndim - 1  # - 1: the stacked layer axis
               for p, x in jax.tree_util.tree_leaves_with_path(params["layers"]))
    # A Block built for a rank's share has exactly the shapes of a rank's slice.
    for T in (2, 4):
        local = M.make_block(CFG, CFG.n_heads // T, CFG.d_ff // T)
        local_params = jax.eval_shape(local.init, jax.random.key(1), jnp.zeros((1, 1, CFG.d_model)))
        local_params = local_params["params"]
        sliced = jax.eval_shape(lambda p: split_for_tensor_ranks(p, T, layer_axis=True),
                                params["layers"])
        want = jax.tree.map(lambda x: x.shape[2:], sliced)  # drop [T, N]
        assert jax.tree.map(lambda x: x.shape, local_params) == want


def test_forward_shapes_and_dtypes(params):
    tokens = _tokens(1, (B, L))
    x = M.embed(params["embed"], tokens, jnp.float32)
    assert x.shape == (B, L, CFG.d_model) and x.dtype == jnp.float32
    np.testing.assert_array_equal(x[1, 2], params["embed"][tokens[1, 2]])
    y = jax.eval_shape(lambda p, v: M.apply_layers(p, v, CFG), params["layers"], x)
    assert y.shape == x.shape and y.dtype == jnp.float32
    logits = jax.eval_shape(lambda p, t: M.forward(p, t, CFG), params, tokens)
    assert logits.shape == (B, L, CFG.vocab_size) and logits.dtype == jnp.float32
    value = loss_fn(params, _tokens(2, (B, L + 1)), CFG)
    assert value.shape == () and value.dtype == jnp.float32


# ---------------------------------------------------------------- behaviour


def test_causal(params):
    tokens = _tokens(3, (1, L))
    t = 5
    changed = tokens.at[0, t].set((tokens[0, t] + 1) % CFG.vocab_size)
    fwd = jax.jit(lambda tok: M.forward(params, tok, CFG))
    a, b = fwd(tokens), fwd(changed)
    np.testing.assert_array_equal(np.asarray(a[:, :t]), np.asarray(b[:, :t]))
    assert np.all(np.abs(np.asarray(a[:, t:]) - np.asarray(b[:, t:])).max(axis=-1) > 0)


def test_rope_encodes_relative_position():
    q_K, k_K = jax.random.normal(jax.random.key(4), (2, 8))
    seq = lambda v: jnp.broadcast_to(v, (1, 10, 1, 8))
    q, k = M.rope(seq(q_K), 10000.0)[0, :, 0], M.rope(seq(k_K), 10000.0)[0, :, 0]
    np.testing.assert_allclose(jnp.linalg.norm(q, axis=-1), jnp.linalg.norm(q_K), rtol=1e-5)
    np.testing.assert_allclose(q[6] @ k[2], q[8] @ k[4], rtol=1e-5)
    assert abs(float(q[6] @ k[2] - q[6] @ k[4])) > 1e-3  # but absolute offset matters


def test_initial_loss_is_near_log_vocab(params):
    # Logits start with std about init_std * sqrt(D) = 0.11, so the softmax is
    # nearly uniform: expected excess over log(V) is about var / 2 = 0.006.
    value = loss_fn(params, _tokens(5, (8, L + 1)), CFG)
    assert abs(float(value) - math.log(CFG.vocab_size)) < 0.05


def test_adam_reduces_loss_on_a_repeated_batch(params):
    batch = _tokens(6, (B, L + 1))
    opt = optax.adam(1e-2)

    @jax.jit
    def step(p, s):
        value, grads = jax.value_and_grad(M.loss_fn)(p, batch, CFG)
        updates, s = opt.update(grads, s, p)
        return optax.apply_updates(p, updates), s, value

    p, s = params, opt.init(params)
    first = None
    for _ in range(40):
        p, s, value = step(p, s)
        first = float(value) if first is None else first
    final = float(loss_fn(p, batch, CFG))
    assert final < 0.5 * first, (first, final)


def test_tied_and_untied(params):
    untied_cfg = dataclasses.replace(CFG, tie_embeddings=False)
    untied = jax.jit(M.init_params, static_argnums=0)(untied_cfg, jax.random.key(0))
    assert "head" not in params and untied["head"].shape == (CFG.vocab_size, CFG.d_model)
    assert M.param_count(untied) - M.param_count(params) == CFG.vocab_size * CFG.d_model
    assert not np.allclose(untied["head"], untied["embed"])
    x = jax.random.normal(jax.random.key(7), (B, L, CFG.d_model))
    ln = lambda v: (v - v.mean(-1, keepdims=True)) / jnp.sqrt(v.var(-1, keepdims=True) + CFG.ln_eps)
    np.testing.assert_allclose(head_logits(params, x, CFG), ln(x) @ params["embed"].T,
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(head_logits(untied, x, untied_cfg), ln(x) @ untied["head"].T,
                               rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="'head'.*tie_embeddings=False"):
        head_logits(params, x, untied_cfg)
    with pytest.raises(ValueError, match="'head'.*tie_embeddings=True"):
        head_logits(untied, x, CFG)


def test_bfloat16_compute_is_finite_and_close(params):
    bf_cfg = dataclasses.replace(CFG, dtype="bfloat16")
    batch = _tokens(8, (B, L + 1))
    x = M.embed(params["embed"], batch, jnp.bfloat16)
    assert jax.eval_shape(lambda p, v: M.apply_layers(p, v, bf_cfg), params["layers"], x).dtype == jnp.bfloat16
    assert jax.eval_shape(lambda p, t: M.forward(p, t, bf_cfg), params, batch[:, :-1]).dtype == jnp.float32
    f32, bf16 = float(loss_fn(params, batch, CFG)), float(loss_fn(params, batch, bf_cfg))
    # bf16 keeps 8 mantissa bits (relative error 4e-3 per rounding); at init
    # the logits are O(0.1), so the loss moves by far less than 0.02.
    assert math.isfinite(bf16) and abs(bf16 - f32) < 0.02


def test_remat_gives_same_loss_and_gradients(params):
    batch = _tokens(9, (B, L + 1))
    plain = jax.jit(jax.value_and_grad(lambda p: loss_fn(p, batch, CFG)))(params)
    remat = jax.jit(jax.value_and_grad(lambda p: M.loss_fn(p, batch, CFG, remat=True)))(params)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), plain, remat)


def test_bad_inputs(params):
    with pytest.raises(TypeError, match="tokens"):
        M.embed(params["embed"], jnp.zeros((B, L), jnp.float32), jnp.float32)
    with pytest.raises(TypeError, match="targets"):
        M.loss(jnp.zeros((B, L, 4)), jnp.zeros((B, L)))
    with pytest.raises(ValueError, match="targets shape"):
        M.loss(jnp.zeros((B, L, 4)), jnp.zeros((B, L + 1), jnp.int32))
    with pytest.raises(ValueError, match="max_seq_len=16"):
        M.forward(params, _tokens(0, (1, 17)), CFG)
    with pytest.raises(ValueError, match=r"batch must have shape \[B, L\+1\]"):
        M.loss_fn(params, _tokens(0, (4,)), CFG)


def test_out_of_range_ids_give_nan_not_numbers(params):
    for bad in (-1, CFG.vocab_size):
        tokens = _tokens(0, (B, L)).at[0, 3].set(bad)
        assert np.isnan(M.embed(params["embed"], tokens, jnp.float32)[0, 3]).all()
        assert np.isnan(float(M.loss(jnp.zeros((B, L, CFG.vocab_size)), tokens)))


# ---------------------------------------------------------------- tensor parallel


@jax.jit
def _perturbed_first_layer(layers):
    """Layer 0 with every leaf moved off its init, so that the zero-init
    biases and unit LayerNorm scales cannot hide a bias summed T times."""
    leaves, treedef = jax.tree.flatten(jax.tree.map(lambda x: x[0], layers))
    keys = jax.random.split(jax.random.key(12), len(leaves))
    moved = [x + 0.1 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)]
    return jax.tree.unflatten(treedef, moved)


@pytest.mark.parametrize("T", [2, 4])
def test_block_tensor_parallel_decomposition(params, T):
    """Each of T ranks holds H/T heads and F/T hidden units; with tp_exit an
    all-reduce over ranks, every rank reproduces the full Block exactly."""
    block_params = _perturbed_first_layer(params["layers"])
    x = jax.random.normal(jax.random.key(10), (B, L, CFG.d_model))
    full = jax.jit(M.make_block(CFG).apply)({"params": block_params}, x)

    def rank_output(tp_exit):
        block = M.make_block(CFG, CFG.n_heads // T, CFG.d_ff // T, tp_exit=tp_exit)
        run = lambda p: block.apply({"params": p}, x)
        return jax.vmap(run, axis_name="tp")(split_for_tensor_ranks(block_params, T))

    outs = jax.jit(rank_output, static_argnums=0)(_psum_tp)
    assert outs.shape == (T, B, L, CFG.d_model)
    for r in range(T):
        np.testing.assert_allclose(outs[r], full, rtol=1e-5, atol=1e-5)
    # Control: without the reduction each rank only has its share.
    unreduced = jax.jit(rank_output, static_argnums=0)(lambda y: y)
    assert np.abs(np.asarray(unreduced[0] - full)).max() > 1e-2


def test_tp_hooks_wrap_both_sublayers():
    entered, exited = [], []
    block = M.make_block(CFG, tp_enter=lambda h: (entered.append(h.shape), h)[1],
                         tp_exit=lambda y: (exited.append(y.shape), y)[1])
    jax.eval_shape(block.init, jax.random.key(0), jnp.zeros((B, L, CFG.d_model)))
    assert entered == exited == [(B, L, CFG.d_model)] * 2


@pytest.mark.parametrize("T", [2])
def test_tensor_parallel_layers_match_reference_loss_and_gradients(
        params, grad_batch, ref_value_and_grads, T):
    """The whole stack split T ways (under vmap with a psum tp_exit) gives the
    reference loss and, mapped back to the full layout, the same gradients."""
    batch = grad_batch

    def split_loss(p):
        x = M.embed(p["embed"], batch[:, :-1], jnp.float32)
        layers = split_for_tensor_ranks(p["layers"], T, layer_axis=True)
        run = lambda pl: M.apply_layers(pl, x, CFG, tp_exit=_psum_tp)
        y_TxBxLxD = jax.vmap(run, axis_name="tp")(layers)
        # Every rank holds the same activations; the mean is the common loss.
        per_rank = jax.vmap(lambda y: M.loss(M.head_logits(p, y, CFG), batch[:, 1:]))(y_TxBxLxD)
        return jnp.mean(per_rank)

    ref_value, ref_grads = jax.jit(jax.value_and_grad(lambda p: loss_fn(p, batch, CFG)))(params)
    value, grads = jax.jit(jax.value_and_grad(split_loss))(params)
    np.testing.assert_allclose(value, ref_value, rtol=1e-5)
    for (path, g), r in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(ref_grads)):
        scale = float(jnp.abs(r).max())
        assert float(jnp.abs(g - r).max()) <= 1e-5 * scale + 1e-8, jax.tree_util.keystr(path)


def test_layers_inside_shard_map_over_tensor_axis(params):
    """The same code runs per device under jax.shard_map, with parameters
    sharded along their split dim (PARAM_AXES) and tp_exit a psum over 'tensor'."""
    from jax.sharding import PartitionSpec as P

    from jcomp.gpt.mesh import make_mesh

    mesh = make_mesh({"data": 2, "tensor": 4})

    def spec(path, x):
        dim = _tensor_dim(path)
        axes = [None] * x.ndim
        if dim is not None:
            axes[dim + 1] = "tensor"  # + 1: the stacked layer axis comes first
        return P(*axes)

    specs = jax.tree_util.tree_map_with_path(spec, params["layers"])
    run = lambda pl, x: M.apply_layers(pl, x, CFG, tp_exit=lambda y: jax.lax.psum(y, "tensor"))
    sharded = jax.shard_map(run, mesh=mesh, in_specs=(specs, P("data")), out_specs=P("data"))
    x = jax.random.normal(jax.random.key(13), (4, L, CFG.d_model))
    ref = jax.jit(lambda pl, v: M.apply_layers(pl, v, CFG))(params["layers"], x)
    np.testing.assert_allclose(jax.jit(sharded)(params["layers"], x), ref, rtol=1e-5, atol=1e-5)


def test_pipeline_stages_compose(params):
    """Layers split into stages and run one after another give the full stack."""
    x = jax.random.normal(jax.random.key(14), (B, L, CFG.d_model))
    run = jax.jit(lambda pl, v: M.apply_layers(pl, v, CFG))
    stage = lambda i: jax.tree.map(lambda a: a[i:i + 1], params["layers"])
    np.testing.assert_allclose(run(stage(1), run(stage(0), x)), run(params["layers"], x),
                               rtol=1e-5, atol=1e-6)
