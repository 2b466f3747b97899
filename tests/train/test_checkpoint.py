"""Tests for jcomp.train.run.checkpoint: bit-exact roundtrips across shardings, retention,
fallback past damaged steps, and refusal of checkpoints of another model; and the
checksums it stores (jcomp.train.run.checksums)."""
import glob
import logging
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P, SingleDeviceSharding

from jcomp.train.run.checkpoint import (
    COMMIT_MARKER,
    CheckpointError,
    Checkpointer,
    abstract_like,
)
from jcomp.train.run.checksums import tree_checksums
from jcomp.gpt.mesh import make_mesh

MODEL = {"d_model": 64, "n_layers": 2}


@pytest.fixture(scope="module")
def mesh():
    return make_mesh((2, 2, 2))


def _state(mesh, offset=0.0):
    """A small train state of every dtype a run stores, sharded several ways."""
    on = lambda x, *spec: jax.device_put(x, NamedSharding(mesh, P(*spec)))
    # Large enough that orbax stores it outside its checksummed b-tree nodes.
    w = jax.random.normal(jax.random.key(0), (128, 256), jnp.float32) + offset
    w = w.at[0, 0].set(jnp.nan).at[0, 1].set(-0.0)  # bits that value comparisons blur
    return {
        "params": {
            "w_DxF": on(w, "data", "tensor"),
            "b_F": on(jnp.linspace(-1, 1, 64).astype(jnp.bfloat16) + offset, "tensor"),
        },
        "opt": [on(jnp.arange(16, dtype=jnp.int32) + int(offset), "pipeline"), on(jnp.int8([-128, 127]))],
        "step": jnp.int32(int(offset)),
        "rng": jax.random.key_data(jax.random.key(int(offset))),
    }


def _meta(step):
    return {"step": step, "data": {"position": 10 * step}, "model": MODEL}


def _bits(tree):
    """Raw bytes of every leaf: equal bits, not just equal values (NaN, -0.0)."""
    return [(x.dtype, x.shape, np.asarray(x).tobytes()) for x in jax.tree.leaves(tree)]


def _save_run(directory, mesh, steps=(10, 20), keep=3):
    with Checkpointer(directory, save_every=10, keep=keep) as ck:
        for s in steps:
            assert ck.maybe_save(s, _state(mesh, s), _meta(s))
        ck.wait()


@pytest.fixture(scope="module")
def template(tmp_path_factory, mesh):
    """A run directory holding steps 10 and 20, copied by the tests that damage it."""
    d = tmp_path_factory.mktemp("template") / "ckpt"
    _save_run(d, mesh)
    return d


@pytest.fixture
def run_dir(template, tmp_path):
    d = tmp_path / "ckpt"
    shutil.copytree(template, d)
    return d


def _listing(d):
    """Every file with its size and contents, to show nothing was deleted or rewritten."""
    out = {}
    for f in sorted(glob.glob(os.path.join(d, "**"), recursive=True)):
        if os.path.isfile(f):
            out[os.path.relpath(f, d)] = open(f, "rb").read()
    return out


# ------------------------------------------------------------------ roundtrip


def test_roundtrip_is_bit_exact_with_shardings_and_meta(run_dir, mesh):
    want = _state(mesh, 20)
    with Checkpointer(run_dir, save_every=10, keep=3) as ck:
        state, meta, step = ck.restore(abstract_like(want), expect_meta={"model": MODEL})
    assert step == 20 and meta == _meta(20)
    assert _bits(state) == _bits(want)
    for got, ref in zip(jax.tree.leaves(state), jax.tree.leaves(want)):
        assert got.sharding.is_equivalent_to(ref.sharding, got.ndim)
    assert not ck.skipped


def test_restore_onto_other_shardings_and_mesh(run_dir, mesh):
    other = make_mesh((1, 8, 1))
    device0 = SingleDeviceSharding(jax.devices()[0])
    want = _state(mesh, 20)
    abstract = abstract_like(want)
    targets = {
        "params": {"w_DxF": NamedSharding(other, P(None, "tensor")), "b_F": device0},
        "opt": [NamedSharding(other, P("tensor")), NamedSharding(other, P())],
        "step": device0,
        "rng": NamedSharding(other, P()),
    }
    abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, targets)
    with Checkpointer(run_dir, save_every=10, keep=3) as ck:
        state, _, _ = ck.restore(abstract)
    assert _bits(state) == _bits(want)
    for got, s in zip(jax.tree.leaves(state), jax.tree.leaves(targets)):
        assert got.sharding == s


def test_restore_given_step(run_dir, mesh):
    with Checkpointer(run_dir, save_every=10, keep=3) as ck:
        state, meta, step = ck.restore(abstract_like(_state(mesh)), step=10)
        assert step == 10 and meta["step"] == 10
        assert _bits(state) == _bits(_state(mesh, 10))
        with pytest.raises(CheckpointError, match=r"no checkpoint for step 15 .*\[10, 20\]"):
            ck.restore(abstract_like(_state(mesh)), step=15)


def test_empty_or_missing_directory_means_no_checkpoint(tmp_path, mesh):
    abstract = abstract_like(_state(mesh))
    for d in (tmp_path / "empty", tmp_path / "not" / "there"):
        with Checkpointer(d, save_every=1, keep=1) as ck:
            assert ck.restore(abstract) is None
            assert ck.latest_step() is None


# ------------------------------------------------------------------ cadence and retention


def test_save_cadence_force_and_keep(tmp_path, mesh):
    state = _state(mesh)
    with Checkpointer(tmp_path, save_every=3, keep=2) as ck:
        saved = [s for s in range(8) if ck.maybe_save(s, state, _meta(s))]
        assert saved == [0, 3, 6]
        assert ck.maybe_save(7, state, _meta(7), force=True)
        ck.wait()
        assert ck.steps() == [6, 7] and ck.latest_step() == 7
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.isdigit()) == ["6", "7"]


def test_second_save_of_a_step_in_flight_is_skipped(tmp_path, mesh, caplog):
    with Checkpointer(tmp_path, save_every=10, keep=2) as ck:
        assert ck.maybe_save(10, _state(mesh, 10), _meta(10))
        with caplog.at_level(logging.WARNING):
            assert not ck.maybe_save(10, _state(mesh, 99), _meta(10), force=True)
        assert "not saving step 10" in caplog.text
        state, _, step = ck.restore(abstract_like(_state(mesh)))
    assert step == 10 and _bits(state) == _bits(_state(mesh, 10))


def test_existing_step_is_never_overwritten(run_dir, mesh, caplog):
    before = _listing(run_dir / "20")
    with Checkpointer(run_dir, save_every=10, keep=3) as ck:
        with caplog.at_level(logging.WARNING):
            assert not ck.maybe_save(20, _state(mesh, 99), _meta(20))
        ck.wait()
        assert str(run_dir / "20") in caplog.text
        state, _, step = ck.restore(abstract_like(_state(mesh)))
    assert step == 20 and _bits(state) == _bits(_state(mesh, 20))
    assert _listing(run_dir / "20") == before


# ------------------------------------------------------------------ damaged steps


_ZSTD_MAGIC = bytes.fromhex("28b52ffd")


def _flip_bulk_byte(step_dir):
    """Flips one bit in the middle of every compressed chunk of w_DxF (the only
    array whose zstd frames pass 4 KiB): orbax keeps no checksum over these
    bytes, so only the stored checksums can notice.

    Every chunk, not one byte of the largest file: a data file may also hold a
    stale copy of a chunk (a write that was retried), which a restore never
    reads. A frame's middle, not the file's: a flip in a frame's first bytes
    (headers, Huffman table) breaks decoding instead of changing values."""
    flipped = 0
    for f in glob.glob(str(step_dir / "state" / "ocdbt.process_*" / "d" / "*")):
        b = bytearray(open(f, "rb").read())
        starts, i = [], b.find(_ZSTD_MAGIC)
        while i >= 0:
            starts.append(i)
            i = b.find(_ZSTD_MAGIC, i + 1)
        starts.append(len(b))
        for start, end in zip(starts, starts[1:]):
            if end - start > 4096:
                b[(start + end) // 2] ^= 0x01
                flipped += 1
        open(f, "wb").write(bytes(b))
    assert flipped, f"no zstd frame of w_DxF found under {step_dir}: the damage did nothing"


def _truncate_btree(step_dir):
    for f in glob.glob(str(step_dir / "state" / "d" / "*")):
        open(f, "r+b").truncate(os.path.getsize(f) // 2)


def _garble_meta(step_dir):
    (step_dir / "meta" / "metadata").write_text('{"step": 2')


def _drop_commit_marker(step_dir):
    (step_dir / COMMIT_MARKER).unlink()


# A failed tensorstore read leaves a future that orbax's closed event loop reports
# as unraisable; it is noise from the failure this test provokes on purpose.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize(
    "damage, reason",
    [
        (_flip_bulk_byte, "checksum mismatch in ['params/w_DxF']"),
        (_truncate_btree, "ValueError"),
        (_garble_meta, "JSONDecodeError"),
        (_drop_commit_marker, f"incomplete save: no {COMMIT_MARKER}"),
    ],
)
def test_damaged_newest_falls_back_to_previous(run_dir, mesh, caplog, damage, reason):
    damage(run_dir / "20")
    before = _listing(run_dir)
    with Checkpointer(run_dir, save_every=10, keep=3) as ck:
        with caplog.at_level(logging.WARNING):
            state, meta, step = ck.restore(abstract_like(_state(mesh)), expect_meta={"model": MODEL})
    assert step == 10 and meta == _meta(10)
    assert _bits(state) == _bits(_state(mesh, 10))
    assert [p for p, _ in ck.skipped] == [str(run_dir / "20")]
    assert reason in ck.skipped[0][1]
    assert str(run_dir / "20") in caplog.text and reason in caplog.text
    assert _listing(run_dir) == before


def test_set_aside_moves_a_step_intact_and_frees_it_for_saving(run_dir, mesh):
    _flip_bulk_byte(run_dir / "20")
    damaged = _listing(run_dir / "20")
    with Checkpointer(run_dir, save_every=10, keep=3) as ck:
        moved = ck.set_aside(20)
        assert moved == run_dir.parent / "ckpt_unusable" / "20"
        assert _listing(moved) == damaged and not (run_dir / "20").exists()
        assert ck.steps() == [10]
        assert ck.maybe_save(20, _state(mesh, 20), _meta(20))
        ck.wait()
        _, _, step = ck.restore(abstract_like(_state(mesh)))
        assert step == 20 and not ck.skipped
        # A second unusable copy of the same step does not replace the first.
        assert ck.set_aside(20) == run_dir.parent / "ckpt_unusable" / "20-1"
        assert _listing(moved) == damaged
        with pytest.raises(ValueError, match="no directory"):
            ck.set_aside(30)


def test_step_without_marker_is_not_latest(run_dir):
    _drop_commit_marker(run_dir / "20")
    with Checkpointer(run_dir, save_every=10, keep=3) as ck:
        assert ck.steps() == [10, 20]
        assert ck.latest_step() == 10


def test_leftover_temporary_directory_is_ignored(run_dir, mesh):
    # What a save killed before its final rename leaves behind.
    tmp = run_dir / "30.orbax-checkpoint-tmp-1764500000000000"
    shutil.copytree(run_dir / "20", tmp)
    with Checkpointer(run_dir, save_every=10, keep=3) as ck:
        assert ck.steps() == [10, 20] and ck.latest_step() == 20
        _, _, step = ck.restore(abstract_like(_state(mesh)))
    assert step == 20 and not ck.skipped and tmp.exists()


def test_remove_unfinished_deletes_only_temporary_directories(run_dir):
    tmp = run_dir / "30.orbax-checkpoint-tmp"
    shutil.copytree(run_dir / "20", tmp)
    _drop_commit_marker(run_dir / "20")  # incomplete, but a step: restore reports it
    before = _listing(run_dir / "10"), _listing(run_dir / "20")
    with Checkpointer(run_dir, save_every=10, keep=3) as ck:
        assert ck.remove_unfinished() == [str(tmp)]
        assert ck.remove_unfinished() == []
        assert ck.steps() == [10, 20]
    assert not tmp.exists()
    assert (_listing(run_dir / "10"), _listing(run_dir / "20")) == before


def test_all_damaged_raises_with_every_path_and_reason(run_dir, mesh):
    _flip_bulk_byte(run_dir / "20")
    _garble_meta(run_dir / "10")
    before = _listing(run_dir)
    with Checkpointer(run_dir, save_every=10, keep=3) as ck:
        with pytest.raises(CheckpointError) as e:
            ck.restore(abstract_like(_state(mesh)))
    msg = str(e.value)
    assert f"{run_dir / '20'}: checksum mismatch" in msg and f"{run_dir / '10'}: JSONDecodeError" in msg
    assert [p for p, _ in e.value.failures] == [str(run_dir / "20"), str(run_dir / "10")]
    assert isinstance(e.value, ValueError)
    assert _listing(run_dir) == before


def test_given_damaged_step_raises(run_dir, mesh):
    _flip_bulk_byte(run_dir / "10")
    with Checkpointer(run_dir, save_every=10, keep=3) as ck:
        with pytest.raises(CheckpointError, match="checksum mismatch"):
            ck.restore(abstract_like(_state(mesh)), step=10)


# ------------------------------------------------------------------ another model


def test_other_model_meta_is_refused_naming_the_field(run_dir, mesh):
    before = _listing(run_dir)
    with Checkpointer(run_dir, save_every=10, keep=3) as ck:
        with pytest.raises(CheckpointError) as e:
            ck.restore(abstract_like(_state(mesh)), expect_meta={"model": {**MODEL, "d_model": 128}})
        with pytest.raises(CheckpointError, match=r"it has no model\.n_heads, this run has model\.n_heads=4"):
            ck.restore(abstract_like(_state(mesh)), expect_meta={"model": {**MODEL, "n_heads": 4}})
    assert str(e.value) == (
        f"checkpoint at {run_dir / '20'} does not fit this run: "
        "it was written for model.d_model=64, this run has model.d_model=128"
    )
    assert _listing(run_dir) == before


def test_check_meta_refuses_before_any_array_is_read(run_dir, mesh):
    """A check_meta phrase makes the step unfit (not unusable): no fallback to
    step 10, and the arrays are not read (a damaged bulk file goes unnoticed)."""
    _flip_bulk_byte(run_dir / "20")
    seen = []

    def check(meta):
        seen.append(meta["step"])
        return [f"it was written for position {meta['data']['position']}, this run has 0"]

    with Checkpointer(run_dir, save_every=10, keep=3) as ck:
        with pytest.raises(CheckpointError, match="position 200, this run has 0") as e:
            ck.restore(abstract_like(_state(mesh)), check_meta=check)
    assert seen == [20] and not e.value.failures and not ck.skipped


@pytest.mark.parametrize(
    "shape, dtype, phrase",
    [
        ((64, 256), jnp.float32, "its array 'params/w_DxF' is float32[128, 256], this run has float32[64, 256]"),
        ((128, 256), jnp.bfloat16, "its array 'params/w_DxF' is float32[128, 256], this run has bfloat16[128, 256]"),
    ],
)
def test_other_shapes_or_dtypes_are_refused_naming_the_path(run_dir, mesh, shape, dtype, phrase):
    abstract = abstract_like(_state(mesh))
    w = abstract["params"]["w_DxF"]
    abstract["params"]["w_DxF"] = jax.ShapeDtypeStruct(shape, dtype, sharding=w.sharding)
    with Checkpointer(run_dir, save_every=10, keep=3) as ck:
        with pytest.raises(CheckpointError, match=str(run_dir / "20")) as e:
            ck.restore(abstract)
    assert phrase in str(e.value)


def test_other_tree_is_refused_naming_the_paths(run_dir, mesh):
    abstract = abstract_like(_state(mesh))
    abstract["extra"] = abstract.pop("rng")
    with Checkpointer(run_dir, save_every=10, keep=3) as ck:
        with pytest.raises(CheckpointError) as e:
            ck.restore(abstract)
    assert "it lacks array 'extra'" in str(e.value)
    assert "it has array 'rng', this run's state has not" in str(e.value)


# ------------------------------------------------------------------ checksums


def test_checksums_ignore_sharding_and_see_every_bit(mesh):
    state = _state(mesh)
    sums = tree_checksums(state)
    replicated = jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh, P())), state)
    host = jax.tree.map(np.asarray, state)
    assert tree_checksums(replicated) == sums == tree_checksums(host)
    w = np.asarray(state["params"]["w_DxF"])
    for i, j in [(0, 0), (0, 1), (127, 255), (7, 5)]:
        flipped = w.copy()
        flipped.view(np.uint32)[i, j] ^= 1  # one bit, including NaN payloads and -0.0
        got = tree_checksums({**state, "params": {**state["params"], "w_DxF": flipped}})
        assert got["params/w_DxF"] != sums["params/w_DxF"]
        assert {k: v for k, v in got.items() if k != "params/w_DxF"} == {
            k: v for k, v in sums.items() if k != "params/w_DxF"
        }


def test_checksums_depend_on_position():
    a = np.array([1.0, 2.0], np.float32)
    assert tree_checksums(a) != tree_checksums(a[::-1].copy())


# ------------------------------------------------------------------ bad input


def test_bad_arguments_raise(tmp_path, mesh):
    with pytest.raises(ValueError, match="save_every must be >= 1; got 0"):
        Checkpointer(tmp_path, save_every=0, keep=1)
    with pytest.raises(TypeError, match="keep must be an int; got str"):
        Checkpointer(tmp_path, save_every=1, keep="2")
    with pytest.raises(TypeError, match="directory must be a str or path"):
        Checkpointer(3, save_every=1, keep=1)
    state = _state(mesh)
    with Checkpointer(tmp_path, save_every=1, keep=1) as ck:
        with pytest.raises(ValueError, match="meta must be JSON-serialisable with finite numbers"):
            ck.maybe_save(0, state, {"loss": float("nan")})
        with pytest.raises(TypeError, match="meta must be JSON-serialisable"):
            ck.maybe_save(0, state, {"x": object()})
        with pytest.raises(TypeError, match="meta must be a dict"):
            ck.maybe_save(0, state, [1])
        with pytest.raises(ValueError, match="step must be >= 0; got -1"):
            ck.maybe_save(-1, state, {})
        with pytest.raises(TypeError, match="state leaf 'key' is a typed PRNG key"):
            ck.maybe_save(0, {"key": jax.random.key(0)}, {})
        with pytest.raises(TypeError, match="abstract_state leaf 'w' must be a jax.ShapeDtypeStruct with a sharding"):
            ck.restore({"w": jax.ShapeDtypeStruct((2,), jnp.float32)})
        with pytest.raises(TypeError, match="expect_meta must be a dict"):
            ck.restore(abstract_like(state), expect_meta=["model"])
        assert ck.steps() == []


@pytest.mark.e2e
def test_a_failure_reported_only_at_close_is_a_save_error(tmp_path, mesh):
    """Orbax may report a background finalize failure (a file system turned
    read-only) only when the manager closes: that is the same SaveError as a
    failed wait, naming the step and the last complete checkpoint, so train.py
    exits 3 with one line rather than a traceback."""
    from jcomp.train.run.checkpoint import SaveError

    state = _state(mesh)
    ck = Checkpointer(tmp_path, save_every=1, keep=3)
    ck.maybe_save(1, state, _meta(1))
    ck.wait()
    ck.maybe_save(2, state, _meta(2))
    ck.wait()

    def fail():
        raise OSError(30, "Read-only file system")

    ck._mngr.close = fail
    with pytest.raises(SaveError, match="saving step 2 .* Read-only file system") as got:
        ck.close()
    assert got.value.last_complete == 2 and got.value.step == 2
