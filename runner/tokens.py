"""Token streams: every text dataset becomes one flat array of token ids on disk, read through a
memory map, and batches are windows of it.

* ``data=tokens``: a pre-tokenized flat binary (``uint16``/``uint32``, or ``.npy``), as large
  corpora are kept;
* ``data=text`` with ``data.tokenizer``, and ``data=hf`` (json/jsonl/parquet/arrow/csv through
  ``datasets``): documents are tokenized once, the tokenizer's EOS after each, into a cache file
  keyed by the sources and the tokenizer (``runner.token_cache``); later runs (and every rank) map
  the cached file.

Windows of ``seq_len + 1`` tokens tile the stream (documents are packed across window edges); the
last ``val_fraction`` of it is held out. Sample ``n`` of a split is window ``perm(n mod W)`` of
that split's ``W`` windows, under a permutation drawn per epoch from the seed: every window once
per epoch, and every batch a pure function of (seed, split, step, batch size), so a resumed run
reads exactly the batches it would have. Nothing reads the whole corpus into memory.
"""

from __future__ import annotations

import hashlib
import logging
import math
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from runner.cache_files import default_cache_dir, file_identity
from runner.errors import ConfigError
from runner.remote_code import remote_code_problem

__all__ = ["TokenStream", "window_index", "open_tokens", "load_tokenizer", "tokenizer_vocab",
           "text_documents", "dataset_documents", "default_cache_dir"]

log = logging.getLogger(__name__)

DTYPES = {"uint8": np.uint8, "uint16": np.uint16, "uint32": np.uint32}
_FORMATS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".arrow": "arrow", ".csv": "csv", ".txt": "text"}


def window_index(n: int, windows: int, seed: int, split: str) -> int:
    """Which of ``windows`` windows sample ``n`` reads: an affine permutation per epoch
    (``a * i + b mod W`` with ``a`` coprime to ``W``), drawn from (seed, split, epoch)."""
    epoch, i = divmod(n, windows)
    digest = hashlib.sha256(f"{seed}/{split}/{epoch}".encode()).digest()
    a = 1 + int.from_bytes(digest[:8], "little") % max(1, windows - 1)
    while math.gcd(a, windows) != 1:
        a = a % (windows - 1) + 1 if windows > 2 else 1
    b = int.from_bytes(digest[8:16], "little") % windows
    return (a * i + b) % windows


class TokenStream:
    """Batches of windows of a flat token array (see the module docstring)."""

    def __init__(self, tokens: np.ndarray, *, seed: int, val_fraction: float, vocab_size: int | None,
                 source: str, key: str = "data.path"):
        if not 0.0 < val_fraction < 1.0:
            raise ConfigError(f"data.val_fraction={val_fraction} must be between 0 and 1. Fix: e.g. 0.01.")
        self.tokens = tokens
        self.seed = seed
        self.vocab_size = vocab_size
        self.source = source
        self.key = key
        cut = len(tokens) - int(len(tokens) * val_fraction)
        self.splits = {"train": (0, cut), "val": (cut, len(tokens))}

    def batch(self, step: int, batch_size: int, seq_len: int, *, split: str = "train"):
        start, end = self.splits[split]
        window = seq_len + 1
        windows = (end - start) // window
        if windows < 1:
            raise ConfigError(
                f"{self.key}={self.source!r}: its {split} split holds {end - start} tokens, fewer than "
                f"train.seq_len + 1 = {window}. Fix: more data, a smaller train.seq_len or another data.val_fraction.")
        first = step * batch_size
        offsets = [start + window * window_index(n, windows, self.seed, split)
                   for n in range(first, first + batch_size)]
        rows = torch.from_numpy(np.stack([self.tokens[o:o + window] for o in offsets]).astype(np.int64))
        if self.vocab_size is not None and int(rows.max()) >= self.vocab_size:
            raise ConfigError(f"{self.key}={self.source!r} holds token id {int(rows.max())}, outside data.vocab_size="
                              f"{self.vocab_size}. Fix: the data's real vocabulary size (data.vocab_size), or the "
                              "right data.dtype.")
        return rows[:, :-1], rows[:, 1:]


def open_tokens(path: str, dtype: str) -> np.ndarray:
    """A pre-tokenized file as a read-only memory map: ``.npy`` (its own dtype) or raw ``dtype``."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise ConfigError(f"data.path={path!r}: no such file. "
                          "Fix: data.path=<a flat binary of token ids (.bin) or .npy>.")
    if file.suffix == ".npy":
        return np.load(file, mmap_mode="r").reshape(-1)
    if dtype not in DTYPES:
        raise ConfigError(f"data.dtype={dtype!r} is not one of {', '.join(DTYPES)}. "
                          "Fix: data.dtype=uint16 (vocabularies up to 65536) or uint32.")
    size = np.dtype(DTYPES[dtype]).itemsize
    if file.stat().st_size % size:
        raise ConfigError(f"data.path={path!r}: {file.stat().st_size} bytes is not a whole number of {dtype} tokens. "
                          "Fix: the data.dtype it was written with.")
    return np.memmap(file, dtype=DTYPES[dtype], mode="r")


def load_tokenizer(path: str):
    """A local Hugging Face tokenizer directory (nothing is downloaded)."""
    try:
        from transformers import AutoTokenizer
    except ImportError as e:
        raise ConfigError("data.tokenizer needs transformers and tokenizers (not installed). "
                          "Fix: pip install -e '.[hf]' (or 'runner[hf]').") from e
    directory = Path(path).expanduser()
    if not directory.is_dir():
        raise ConfigError(f"data.tokenizer={path!r}: no such directory. Fix: a local tokenizer directory "
                          "(tokenizer.json or the files save_pretrained writes).")
    if problem := remote_code_problem(directory, f"data.tokenizer={path!r}"):  # before transformers reads it
        raise ConfigError(problem)
    try:
        tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError) as e:
        raise ConfigError(f"data.tokenizer={path!r} cannot be loaded: {e}") from e
    if tokenizer.eos_token_id is None:
        raise ConfigError(f"data.tokenizer={path!r} has no EOS token to put between documents. Fix: a tokenizer "
                          "with an eos_token.")
    return tokenizer


def tokenizer_vocab(path: str | None, default: int | None) -> int | None:
    """The vocabulary size of a tokenizer directory (for ``data.vocab_size``), or ``default``
    without one; None when it cannot be read (the dataset then says why)."""
    if path is None:
        return default
    file = Path(path).expanduser() / "tokenizer.json"
    try:
        from tokenizers import Tokenizer

        return Tokenizer.from_file(str(file)).get_vocab_size(with_added_tokens=True)
    except Exception:  # no tokenizer.json (sentencepiece only), or not installed
        try:
            return len(load_tokenizer(path))
        except ConfigError:
            return None


def _files(path: str, key: str = "data.path") -> list[Path]:
    p = Path(path).expanduser()
    files = sorted(f for f in p.rglob("*") if f.is_file() and not f.name.startswith(".")) if p.is_dir() else (
        [p] if p.is_file() else sorted(Path().glob(path)))
    if not files:
        raise ConfigError(f"{key}={path!r}: no such file or directory. Fix: a local file, directory or glob.")
    return files


def text_documents(path: str, chunk_chars: int = 1 << 20) -> tuple[list[Path], Iterator[tuple[str, bool]]]:
    """Each file under ``path`` is a document, read in blocks of ``chunk_chars`` characters (never a
    whole file at once; ``runner.token_cache`` cuts the pieces it tokenizes)."""
    files = _files(path)

    def pieces() -> Iterator[tuple[str, bool]]:
        for file in files:
            with open(file, encoding="utf-8", errors="replace") as f:
                while block := f.read(chunk_chars):
                    yield block, False
                yield "", True

    return files, pieces()


def dataset_documents(path: str, field: str, cache_dir: str | None) -> tuple[list[Path], Iterator[tuple[str, bool]]]:
    """Records of local json/jsonl/parquet/arrow/csv files through ``datasets`` (memory-mapped
    Arrow), ``field`` of each a document."""
    files = _files(path)
    formats = {_FORMATS.get(f.suffix) for f in files}
    if None in formats or len(formats) != 1:
        raise ConfigError(f"data.path={path!r}: files of one format are needed, one of "
                          f"{', '.join(sorted(_FORMATS))}; found {sorted({f.suffix for f in files})}.")
    try:
        import datasets
    except ImportError as e:
        raise ConfigError("data=hf needs datasets (not installed). Fix: pip install -e '.[hf]'.") from e
    # datasets keys its Arrow copy by path and modification time: one directory per identity of the sources.
    identity = hashlib.sha256("\n".join(file_identity(f) for f in files).encode()).hexdigest()[:16]
    cache = str((Path(cache_dir).expanduser() if cache_dir else default_cache_dir()) / "datasets" / identity)
    ds = datasets.load_dataset(formats.pop(), data_files=[str(f) for f in files], split="train", cache_dir=cache)
    if field not in ds.column_names:
        raise ConfigError(f"data.field={field!r} is not a column of data.path={path!r} (columns: "
                          f"{', '.join(ds.column_names)}). Fix: data.field=<the text column>.")

    def pieces() -> Iterator[tuple[str, bool]]:
        for batch in ds.iter(batch_size=1000):
            yield from ((text, True) for text in batch[field] if text)

    return files, pieces()
