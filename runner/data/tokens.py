"""Token streams: every text dataset becomes one flat array of token ids on disk, read through a
memory map, and batches are windows of it.

* ``data=tokens``: pre-tokenized flat binaries (``uint16``/``uint32``, or ``.npy``), as large
  corpora are kept (``runner.data.token_files``);
* ``data=text`` with ``data.tokenizer``, and ``data=hf`` (json/jsonl/parquet/arrow/csv through
  ``datasets``): documents are tokenized once, the tokenizer's EOS after each, into a cache file
  keyed by the sources and the tokenizer (``runner.data.token_cache``); later runs (and every rank) map
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
from typing import TYPE_CHECKING, Iterator, Sequence

import numpy as np
import torch

from runner.data.files import default_cache_dir
from runner.errors import ConfigError
from runner.models.hf_dirs import remote_code_problem

if TYPE_CHECKING:
    from runner.data.token_files import Shards

__all__ = ["TokenStream", "window_index", "load_tokenizer", "tokenizer_vocab", "text_documents",
           "dataset_documents", "default_cache_dir"]

log = logging.getLogger("runner.tokens")  # named as before runner/ became packages (runner.log)


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

    def __init__(self, tokens: np.ndarray | Shards, *, seed: int, val_fraction: float, vocab_size: int | None,
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

    def num_windows(self, split: str, seq_len: int) -> int:
        """How many windows of ``seq_len + 1`` tokens ``split`` holds."""
        start, end = self.splits[split]
        return (end - start) // (seq_len + 1)

    def batch(self, step: int, batch_size: int, seq_len: int, *, split: str = "train"):
        """Step ``step``'s batch (steps are numbered from 1): samples ``(step - 1) * batch_size`` on."""
        if step < 1:
            raise ValueError(f"step {step}: steps are numbered from 1")
        start, end = self.splits[split]
        window = seq_len + 1
        windows = self.num_windows(split, seq_len)
        if windows < 1:
            raise ConfigError(
                f"{self.key}={self.source!r}: its {split} split holds {end - start} tokens, fewer than "
                f"train.seq_len + 1 = {window}. Fix: more data, a smaller train.seq_len or another data.val_fraction.")
        first = (step - 1) * batch_size
        offsets = [start + window * window_index(n, windows, self.seed, split)
                   for n in range(first, first + batch_size)]
        rows = torch.from_numpy(np.stack([self.tokens[o:o + window] for o in offsets]).astype(np.int64))
        low, high = int(rows.min()), int(rows.max())
        if low < 0 or (self.vocab_size is not None and high >= self.vocab_size):
            ids = f"0..{self.vocab_size - 1} (data.vocab_size={self.vocab_size})" if self.vocab_size else "ids >= 0"
            raise ConfigError(f"{self.key}={self.source!r} holds token id {low if low < 0 else high} ({split} batch of "
                              f"step {step}), outside {ids}. Fix: the data's real vocabulary size (data.vocab_size), "
                              "or the right data.dtype.")
        return rows[:, :-1], rows[:, 1:]


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
    except Exception as e:  # OSError, ValueError, and the tokenizers library's plain Exception for a damaged file
        raise ConfigError(f"data.tokenizer={path!r} cannot be loaded as a tokenizer: {type(e).__name__}: "
                          f"{' '.join(str(e).split())} Fix: a directory save_pretrained wrote a tokenizer to "
                          "(tokenizer.json, or a SentencePiece model with tokenizer_config.json).") from e
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


def text_documents(files: str | Sequence[Path], chunk_chars: int = 1 << 20
                   ) -> tuple[list[Path], Iterator[tuple[str, bool]]]:
    """Each of ``files`` (``runner.data.files.text_files`` chose them; or one file's path) is a
    document, read in blocks of ``chunk_chars`` characters (never a whole file at once;
    ``runner.data.token_cache`` cuts the pieces it tokenizes)."""
    files = [Path(files).expanduser()] if isinstance(files, str) else list(files)

    def pieces() -> Iterator[tuple[str, bool]]:
        for file in files:
            with open(file, encoding="utf-8", errors="replace") as f:
                while block := f.read(chunk_chars):
                    yield block, False
                yield "", True

    return files, pieces()


def dataset_documents(ds, field: str) -> Iterator[tuple[str, bool]]:
    """``field`` of each record of ``ds`` (``runner.data.records.load_records`` loaded and checked them),
    a document."""

    def pieces() -> Iterator[tuple[str, bool]]:
        for batch in ds.iter(batch_size=1000):
            yield from ((text, True) for text in batch[field] if text)

    return pieces()
