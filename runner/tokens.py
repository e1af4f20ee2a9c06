"""Token streams: every text dataset becomes one flat array of token ids on disk, read through a
memory map, and batches are windows of it.

* ``data=tokens``: pre-tokenized flat binaries (``uint16``/``uint32``, or ``.npy``), as large
  corpora are kept (``runner.token_files``);
* ``data=text`` with ``data.tokenizer``, and ``data=hf`` (json/jsonl/parquet/arrow/csv through
  ``datasets``): documents are tokenized once, the tokenizer's EOS after each, into a cache file
  keyed by the sources and the tokenizer; later runs (and every rank) map the cached file.

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
import os
import re
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Iterator, Sequence

import numpy as np
import torch

from runner.errors import ConfigError

if TYPE_CHECKING:
    from runner.token_files import Shards

__all__ = ["TokenStream", "window_index", "tokenize_to_cache", "load_tokenizer", "tokenizer_vocab", "text_documents",
           "dataset_documents", "default_cache_dir"]

log = logging.getLogger(__name__)


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

    def batch(self, step: int, batch_size: int, seq_len: int, *, split: str = "train"):
        """Step ``step``'s batch (steps are numbered from 1): samples ``(step - 1) * batch_size`` on."""
        if step < 1:
            raise ValueError(f"step {step}: steps are numbered from 1")
        start, end = self.splits[split]
        window = seq_len + 1
        windows = (end - start) // window
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


def default_cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "runner" / "tokens"


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
    try:
        tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
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


def _source_key(files: Sequence[Path], tokenizer_dir: str, extra: str) -> str:
    h = hashlib.sha256(extra.encode())
    for f in files:
        st = f.stat()
        h.update(f"{f.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode())
    for f in sorted(Path(tokenizer_dir).expanduser().iterdir()):
        if f.is_file():
            h.update(f.name.encode() + hashlib.sha256(f.read_bytes()).digest())
    return h.hexdigest()[:24]


def tokenize_to_cache(pieces: Iterable[tuple[str, bool]], *, files: Sequence[Path], tokenizer_dir: str,
                      cache_dir: str | None, extra: str = "", batch: int = 256) -> tuple[np.ndarray, int]:
    """Token ids of the text ``pieces`` (a text, and whether a document ends with it; the
    tokenizer's EOS follows each document), as a memory map of a cache file named by the sources
    and the tokenizer: written once (atomically, by a rename), then reused. Returns the tokens and
    the tokenizer's vocabulary size."""
    tokenizer = load_tokenizer(tokenizer_dir)
    vocab = len(tokenizer)
    dtype = np.uint16 if vocab <= 1 << 16 else np.uint32
    cache = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
    target = cache / f"{_source_key(files, tokenizer_dir, extra)}.{np.dtype(dtype).name}"
    if not target.is_file():
        cache.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(f".{target.name}.{uuid.uuid4().hex[:8]}.partial")
        log.info("tokenizing %s%s into %s", ", ".join(str(f) for f in files[:3]), " …" if len(files) > 3 else "",
                 target)
        count = 0
        try:
            with open(partial, "wb") as out:
                for group in _batched(pieces, batch):
                    ids = tokenizer([text for text, _ in group], add_special_tokens=False)["input_ids"]
                    for piece, (_, ends) in zip(ids, group):
                        out.write(np.asarray(piece + [tokenizer.eos_token_id] * ends, dtype=dtype).tobytes())
                        count += len(piece) + ends
            partial.rename(target)
        finally:
            partial.unlink(missing_ok=True)
        log.info("%d tokens", count)
    return np.memmap(target, dtype=dtype, mode="r"), vocab


def _batched(items: Iterable, size: int) -> Iterator[list]:
    group = []
    for item in items:
        group.append(item)
        if len(group) == size:
            yield group
            group = []
    if group:
        yield group


# A chunk ends at a newline before a non-space: tokenizers' pre-tokenizers split there anyway,
# so tokenizing a document chunk by chunk gives the ids of the whole.
_CHUNK_END = re.compile(r"\n(?=\S)")


def text_documents(files: str | Sequence[Path], chunk_chars: int = 1 << 20
                   ) -> tuple[list[Path], Iterator[tuple[str, bool]]]:
    """Each of ``files`` (``runner.data_files.text_files`` chose them; or one file's path) is a
    document, read in chunks (never a whole file at once)."""
    files = [Path(files).expanduser()] if isinstance(files, str) else list(files)

    def pieces() -> Iterator[tuple[str, bool]]:
        for file in files:
            with open(file, encoding="utf-8", errors="replace") as f:
                rest = ""
                while block := f.read(chunk_chars):
                    text = rest + block
                    cuts = [m.end() for m in _CHUNK_END.finditer(text)]
                    text, rest = (text[:cuts[-1]], text[cuts[-1]:]) if cuts else ("", text)
                    if text:
                        yield text, False
                yield rest, True

    return files, pieces()


def dataset_documents(ds, field: str) -> Iterator[tuple[str, bool]]:
    """``field`` of each record of ``ds`` (``runner.records.load_records`` loaded and checked them),
    a document."""

    def pieces() -> Iterator[tuple[str, bool]]:
        for batch in ds.iter(batch_size=1000):
            yield from ((text, True) for text in batch[field] if text)

    return pieces()
