"""Tests for jcomp.train.outer.islands: the outer loop of the trainer (config.outer).

In process, on configs/tiny.py's model: the run is built as the loop builds it
(`_Run`), the inner steps and syncs called in the loop's order (those tests
compile whole train steps: marked slow)."""
import jax
import numpy as np
import pytest

from jcomp.collectives.outer.sparseloco import SparseLoCo
from jcomp.gpt import mesh as mesh_lib
from jcomp.train.outer import delay as outerdelay
from jcomp.train.outer import fragments
from jcomp.train.settings import outer as outerconfig, runspec
from jcomp.train.state import resume
from jcomp.train.state.stepcache import StepCache, global_batch
from tests.train.tinyconfig import tiny_config

ULP = float(np.finfo(np.float32).eps)


class _Run:
    """A tiny run built as jcomp.train.loop builds it, on random token rows."""

    def __init__(self, **overrides):
        self.run = runspec.validate(tiny_config(**overrides), 8)
        self.tx = self.run.optim.tx(self.run.train.steps)
        self.mesh = mesh_lib.make_mesh(self.run.mesh_shape, dcn_data=self.run.mesh_split())
        make = resume.init_params(self.run)
        self.shapes = jax.eval_shape(make)
        self.state = resume.init_state(self.run, make(), self.mesh, self.tx, self.shapes)
        self.steps = StepCache(self.run, self.mesh, self.tx, self.shapes)
        self.syncs = (outerdelay.syncs_for(self.run, self.mesh, self.shapes, self.tx)
                      if self.run.outer else None)
        self.done = 0

    def batch(self, seed):
        t = self.run.train
        rows = np.random.default_rng(seed).integers(
            0, self.run.model.vocab_size, (t.batch_size, self.run.data.seq_len + 1))
        return global_batch(self.mesh, rows, t.batch_size)

    def inner_step(self, seed):
        """One inner step, no sync after it -> the step's wire report."""
        phase = self.run.phases[0][1]
        inner = {k: v for k, v in self.state.items() if k != "outer"}
        batch = self.batch(seed)
        exe, report = self.steps.train(phase, inner, batch)
        inner, m = exe(inner, batch)
        jax.block_until_ready(m)
        self.state = {**inner, "outer": self.state["outer"]} if self.syncs else inner
        self.done += 1
        return report

    def step(self, seed):
        """One inner step (and the syncs due after it) -> the step's wire report."""
        report = self.inner_step(seed)
        for f in fragments.due(self.done, self.run.outer):
            self.state, _ = self.syncs.run_sync(f, self.state, self.done)
        return report


def _np(tree):
    return jax.tree.map(np.asarray, tree)


SGD = {"optim.name": "sgd", "optim.b1": 0.0, "optim.weight_decay": 0.0, "optim.clip_norm": 0.0,
       "optim.warmup_steps": 0, "optim.lr": 0.05}
H1 = {"outer.every": 1, "outer.codec": "none", "outer.lr": 1.0, "outer.momentum": 0.0}


@pytest.mark.slow  # compiles whole train steps and syncs
def test_h1_with_sgd_inside_is_the_data_parallel_sgd_run():
    """The identity that holds: with plain SGD inside (no momentum, no weight
    decay, no clipping), H=1, codec "none", outer lr 1 and no momentum, the
    islands' mean after each step is the data-parallel SGD step (the anchor
    minus lr times the mean of the islands' gradients), so the outer run
    follows the every-step run. It does not hold for AdamW (nonlinear in the
    gradient: the mean of the islands' Adam steps is not the Adam step of the
    mean gradient). Not bitwise: the sync forms anchor - master, averages it and
    subtracts (three float32 roundings where the plain step has one). Bound: 4
    ulp of the leaf's largest |value| per step taken (seen: at most 1.2 ulp after
    3 steps). Every island holds the same parameters, bit for bit."""
    ref, out = _Run(**SGD), _Run(**SGD, **H1)
    assert out.run.islands == 2 and dict(out.mesh.shape)["data"] == 1
    worst = 0.0
    for t in range(1, 4):
        ref.step(t), out.step(t)
        want, got = _np(ref.state["params"]), _np(out.state["params"])
        for (path, w), g in zip(jax.tree_util.tree_flatten_with_path(want)[0],
                                jax.tree.leaves(got)):
            assert np.array_equal(g[0], g[1]), path
            err = np.abs(g[0] - w).max() / (ULP * np.abs(w).max())
            worst = max(worst, err / t)
            assert err <= 4 * t, (path, t, err)
    print(f"largest deviation: {worst:.2f} ulp per step")


@pytest.mark.slow  # compiles whole train steps and syncs
def test_inner_steps_send_nothing_across_islands_and_a_sync_sends_the_codec():
    """mesh.dcn_data=2 on data 4 x tensor 2 (two islands of 2 data ranks): the
    compiled inner step sends 0 bytes on 'dcn' and reduces over 'data'; a sync
    with int4:rot sends at most 0.14 of an uncoded sync's bytes across 'dcn'
    (seen: 0.13), and both send the same raw gather over 'data'."""
    mesh = {"mesh.data": 4, "mesh.pipeline": 1, "mesh.dcn_data": 2, "outer.every": 2}
    coded = _Run(**mesh, **{"outer.codec": "int4:rot"})
    report = coded.step(1)
    by = report.by_axis()
    assert by.get("dcn", 0) == 0 and by["data"] > 0, by
    coded.step(2)
    plain = _Run(**mesh)
    plain.step(1), plain.step(2)
    n, c = plain.syncs.bytes_per_sync[0], coded.syncs.bytes_per_sync[0]
    assert 0 < c <= 0.14 * n, (c, n)
    assert plain.syncs.bytes_per_step() == n / 2
    for r in (plain, coded):  # a synced run: every island holds the anchor's params
        for p in jax.tree.leaves(_np(r.state["params"])):
            assert np.array_equal(p[0], p[1])


def test_layer_blocks_are_contiguous_and_balanced_within_a_layer():
    """Every block has a layer; each further layer joins the lightest block (the
    embedding counted in the first, the final norm in the last)."""
    assert fragments.blocks(0, 10, 0, 4, 2) == [(0, 2), (2, 4)]
    assert fragments.blocks(25, 10, 0, 4, 2) == [(0, 1), (1, 4)]   # a large embedding
    assert fragments.blocks(1000, 10, 0, 3, 3) == [(0, 1), (1, 2), (2, 3)]
    assert fragments.blocks(4, 10, 1, 8, 5) == [(0, 1), (1, 3), (3, 5), (5, 7), (7, 8)]
    with pytest.raises(ValueError, match="outer.fragments=3: the model has only 2 layers"):
        fragments.blocks(0, 1, 0, 2, 3)


@pytest.mark.parametrize("n_layers,n", [(2, 2), (6, 3), (6, 4), (8, 5)])
def test_fragments_are_blocks_of_layers_of_equal_bytes(n_layers, n):
    """On the model's real parameter tree: each fragment is a contiguous block of
    layers (one slice [a, b) of every stacked layer leaf), the blocks cover the
    layers once, the embedding goes whole with the first fragment, the final
    norm with the last, and the fragments' bytes differ by at most one layer's."""
    run = runspec.validate(tiny_config(**{"model.n_layers": n_layers, "model.d_model": 64,
                                          "model.vocab_size": 64}), 8)
    shapes = jax.eval_shape(resume.init_params(run))
    names = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(shapes)[0]]
    plan = fragments.plan(shapes, n)
    layer_leaves = {i for i, name in enumerate(names) if name.startswith("['layers']")}
    covered = []
    for f, parts in enumerate(plan):
        blocks = {p.layers for p in parts if p.layers is not None}
        assert len(blocks) == 1, blocks
        assert {p.leaf for p in parts if p.layers is not None} == layer_leaves
        covered.append(blocks.pop())
        whole = {names[p.leaf] for p in parts if p.layers is None}
        if f == 0:
            assert "['embed']" in whole
        if f == n - 1:
            assert {"['final_ln']['bias']", "['final_ln']['scale']"} <= whole
        assert all(p.leaf not in layer_leaves for p in parts if p.layers is None)
    assert [b for b, _ in covered] == [0] + [e for _, e in covered[:-1]]
    assert covered[-1][1] == n_layers
    leaves = jax.tree.leaves(shapes)
    layer = sum(np.prod(leaves[i].shape) * 4 for i in layer_leaves) // n_layers
    sizes = [fragments.part_bytes(shapes, parts) for parts in plan]
    assert max(sizes) - min(sizes) <= layer, (sizes, layer)


def test_due():
    """Fragment f syncs after the steps n with n % every == f * every / fragments."""
    o = outerconfig.OuterSettings(every=6, codec="none", error_feedback=False, lr=0.7, momentum=0.9,
                            fragments=3)
    assert [fragments.due(n, o) for n in range(1, 8)] == [[], [1], [], [2], [], [0], []]
    assert fragments.due(5, None) == []


BAD = [
    ({"outer.every": -1}, "outer.every=-1; allowed: an integer >= 0"),
    ({"outer.every": 4, "outer.fragments": 3}, "outer.fragments=3 does not divide outer.every=4"),
    ({"outer.every": 4, "outer.fragments": 0}, "outer.fragments=0; allowed: an integer >= 1"),
    ({"outer.every": 4, "outer.codec": "int5"}, "outer.codec='int5'"),
    ({"outer.every": 4, "outer.codec": "powersgd:4"}, "outer.codec='powersgd:4'"),
    ({"outer.every": 4, "outer.momentum": 1.0}, "outer.momentum=1.0; allowed: a number in [0, 1)"),
    ({"outer.every": 4, "outer.lr": 0.0}, "outer.lr=0.0; allowed: a number > 0"),
    ({"outer.every": 13}, "outer.every=13: no sync would run within train.steps=12"),
    ({"outer.every": 4, "outer.error_feedback": "yes"}, "outer.error_feedback='yes'"),
    ({"outer.every": 4, "outer.error_feedback": "on"}, "nothing to feed back"),
    ({"outer.every": 4, "mesh.data": 1, "mesh.tensor": 4}, "needs at least 2 islands"),
    ({"outer.every": 4, "mesh.data": 4, "mesh.pipeline": 1, "mesh.dcn_data": 2,
      "compression.dcn.grad": "int8"}, "compression.dcn.grad='int8': with outer.every > 0"),
    ({"outer.every": 4, "compression.data.grad": "powersgd:rank=2"}, "PowerSGD inside the islands"),
    # mesh.dcn_data below 1 is no split: refused as without an outer loop, not
    # taken as "each data rank an island" (and written into the checkpoint)
    ({"outer.every": 4, "mesh.dcn_data": 0},
     "mesh.dcn_data=0; allowed: a divisor of mesh.data=2, 1 or 2"),
    ({"outer.every": 4, "mesh.dcn_data": -1},
     "mesh.dcn_data=-1; allowed: a divisor of mesh.data=2, 1 or 2"),
    # tiny's model has 2 layers: a fragment is a block of whole layers
    ({"outer.every": 4, "outer.fragments": 4},
     "outer.fragments=4: the model has only 2 layers and a fragment is a block of whole "
     "layers; allowed: 1 to 2"),
    ({"outer.every": 4, "outer.codec": "sparseloco", "outer.momentum": 0.9},
     "outer.momentum=0.9 with outer.codec='sparseloco': SparseLoCo takes no outer momentum"),
    ({"outer.every": 4, "outer.codec": "sparseloco:k=9:chunk=8"},
     "outer.codec='sparseloco:k=9:chunk=8': SparseLoCo k=9 exceeds chunk=8"),
    ({"outer.every": 4, "outer.codec": "sparseloco:beta=2"},
     "outer.codec='sparseloco:beta=2': SparseLoCo beta=2.0; allowed: a number in [0, 1]"),
    ({"outer.every": 4, "outer.codec": "sparseloco:q=1"}, "outer.codec='sparseloco:q=1'"),
    # with outer.every=0 no outer loop runs: a field set away from its default is
    # refused, as compression.dcn.* without a split (an invalid value included)
    ({"outer.lr": -1.0}, "outer.lr=-1.0 applies to an outer loop only, and outer.every=0"),
    ({"outer.codec": "int5"}, "outer.codec='int5' applies to an outer loop only"),
    ({"outer.codec": "int8"}, "leave outer.codec at its default 'none'"),
    ({"outer.fragments": 2}, "outer.fragments=2 applies to an outer loop only"),
    ({"outer.error_feedback": "on"}, "outer.error_feedback='on' applies to an outer loop only"),
]


@pytest.mark.parametrize("overrides,message", BAD)
def test_bad_outer_settings_are_refused_by_name(overrides, message):
    with pytest.raises(runspec.UsageError) as e:
        runspec.validate(tiny_config(**overrides), 8)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_two_fragments_fit_tiny_s_two_layers():
    run = runspec.validate(tiny_config(**{"outer.every": 4, "outer.fragments": 2}), 8)
    assert run.outer.fragments == 2


def test_sparseloco_setting_keeps_a_residual_and_no_momentum():
    run = runspec.validate(tiny_config(**{"outer.every": 4,
                                          "outer.codec": "sparseloco:k=4:chunk=64"}), 8)
    o = run.outer
    assert o.error_feedback and o.momentum == 0.0
    assert o.codec_object() == SparseLoCo(k=4, chunk=64, beta=0.95)


@pytest.mark.parametrize("overrides,processes,message", [
    # 4 data ranks as islands cannot be whole processes of 2: name the split to set
    ({"mesh.data": 4, "mesh.pipeline": 1}, 2,
     "outer.every=4 with mesh.dcn_data=1 (no split) makes each of the mesh.data=4 data ranks "
     "an island, but in a run of 2 processes every island must be one or several whole "
     "processes: set mesh.dcn_data to a divisor of 2 above 1 (mesh.dcn_data=2)"),
    ({"mesh.data": 8, "mesh.tensor": 1, "mesh.pipeline": 1}, 4,
     "set mesh.dcn_data to a divisor of 4 above 1 (mesh.dcn_data=2 or mesh.dcn_data=4)"),
    # 2 data ranks over 4 processes: no split makes islands of whole processes
    ({}, 4, "set mesh.data to a multiple of 4 and mesh.dcn_data to a divisor of 4 above 1"),
])
def test_islands_that_cannot_be_whole_processes_name_the_split_to_set(
        monkeypatch, overrides, processes, message):
    monkeypatch.setattr(jax, "process_count", lambda: processes)
    with pytest.raises(runspec.UsageError) as e:
        runspec.validate(tiny_config(**{"outer.every": 4, **overrides}), 8)
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)
    assert "mesh.dcn_data=1 (no split)" in str(e.value)  # what the user has, not a made-up split


def test_islands_of_whole_processes_are_accepted(monkeypatch):
    """2 processes: each data rank of mesh.data=2 an island, or mesh.data=4 split in 2."""
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    assert runspec.validate(tiny_config(**{"outer.every": 4}), 8).islands == 2
    run = runspec.validate(tiny_config(**{"outer.every": 4, "mesh.data": 4, "mesh.pipeline": 1,
                                          "mesh.dcn_data": 2}), 8)
    assert run.islands == 2 and run.mesh_sizes()["data"] == 2


def test_every_0_is_no_outer_loop():
    """outer.every=0 (the default): no outer settings, the mesh and plans of a
    run without them."""
    run = runspec.validate(tiny_config(), 8)
    assert run.outer is None and run.islands == 0 and run.mesh_split() == 1
    assert run.plan_sizes() == run.mesh_sizes() == {"data": 2, "tensor": 2, "pipeline": 2}
    assert "islands" not in run.step_options()


def test_diloco_config_has_two_islands_of_data_2_x_tensor_2():
    from configs import diloco
    run = runspec.validate(diloco.get_config(), 8)
    assert run.islands == 2 and run.outer.every == 10 and run.outer.codec == "int4:rot"
    assert run.mesh_sizes() == {"dcn": 2, "data": 2, "tensor": 2, "pipeline": 1}
    assert run.plan_sizes() == {"data": 2, "tensor": 2, "pipeline": 1}


def test_an_outer_codec_that_draws_gets_a_key_per_step_and_fragment():
    """The trainer's sync parses the codec spec to see whether it draws (the spec
    is a string, which has no needs_key), and keys it by step and fragment, so
    that no two syncs draw alike and a resumed run draws as the uninterrupted one."""
    from jcomp.train.outer import islands as outer
    assert outer.draws("randk:0.25") and outer.draws("int8:sr")
    assert not outer.draws("topk:0.1") and not outer.draws("int8")
    assert not outer.draws(SparseLoCo())
    key = lambda n, f: np.asarray(jax.random.key_data(outer.sync_key(0, n, f)))
    assert np.array_equal(key(4, 1), key(4, 1))
    keys = [key(n, f) for n in (2, 4) for f in (0, 1)] + [np.asarray(jax.random.key_data(
        outer.sync_key(1, 4, 1)))]
    assert len({k.tobytes() for k in keys}) == len(keys)


def test_outer_sync_takes_a_key_for_a_codec_that_draws_and_names_it_when_missing():
    """cc.outer_sync with randk: without key= a ValueError naming key= and
    outer_sync, before anything is traced; with one, the draw follows the key."""
    import functools

    import jax.numpy as jnp
    import optax
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    from jcomp import collectives as cc
    mesh = jax.make_mesh((2, 4), ("dcn", "data"), axis_types=(AxisType.Auto,) * 2)
    params = jax.device_put({"w": jnp.arange(64.0).reshape(8, 8) / 64},
                            NamedSharding(mesh, P()))
    tx = optax.sgd(1.0)
    params_IxX, state = jax.jit(functools.partial(cc.outer_init, tx=tx, mesh=mesh,
                                                  axis="dcn"))(params)
    params_IxX = jax.tree.map(lambda p: p * jnp.array([1.0, 3.0])[:, None, None], params_IxX)
    with pytest.raises(ValueError, match=r"codec 'randk:0.25' draws random numbers: pass key= "
                                         r"to cc.outer_sync"):
        cc.outer_sync(params_IxX, state, tx=tx, mesh=mesh, axis="dcn", codec="randk:0.25")
    sync = jax.jit(lambda p, s, k: cc.outer_sync(p, s, tx=tx, mesh=mesh, axis="dcn",
                                                 codec="randk:0.25", key=k))
    a, b, c = (np.asarray(sync(params_IxX, state, jax.random.key(k))[1].anchor["w"])
               for k in (0, 0, 1))
    assert np.array_equal(a, b) and not np.array_equal(a, c)
