"""The ``data`` group's schemas, one per dataset form (``data=synthetic|text|hf|tokens``); a user's
dataset (``data._target_=pkg.mod.Class``) is built with the keys of the selected group. Imports
nothing heavy."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from omegaconf import II, MISSING

__all__ = ["SyntheticDataConfig", "TextDataConfig", "HFDataConfig", "TokensDataConfig"]


@dataclass
class SyntheticDataConfig:
    _target_: str = "runner.data.datasets.SyntheticData"
    vocab_size: int = 64
    # Probability that a token follows the hidden bigram rule instead of being uniform noise.
    signal: float = 0.9
    # Left-pad each sample by a random length and pass attention_mask=(batch, seq) bool to every
    # child whose forward takes it (padded targets are ignored by the loss).
    padding: bool = False


@dataclass
class TextDataConfig:
    _target_: str = "runner.data.datasets.TextData"
    path: str = MISSING  # a local text file (bytes), or with a tokenizer also a directory or glob of them
    tokenizer: Optional[str] = None  # a local Hugging Face tokenizer directory; null = bytes (vocabulary 256)
    vocab_size: Optional[int] = II("runner_vocab:${.tokenizer},256")  # the tokenizer's, or 256 bytes
    val_fraction: float = 0.1  # the tail of the token stream held out for evaluation
    cache_dir: Optional[str] = None  # tokenized files; null = $XDG_CACHE_HOME/runner/tokens
    # Key the token cache by a SHA-256 of the sources' bytes (read once per run), not by their path,
    # inode, size and times: a copy or a touch reuses it, and any edit is caught even where times lie.
    cache_by_content: bool = False


@dataclass
class HFDataConfig:
    """Local json/jsonl/parquet/arrow/csv files through ``datasets``, tokenized once and cached."""

    _target_: str = "runner.data.datasets.HFData"
    path: str = MISSING  # a file, directory or glob of one format
    field: str = "text"  # the column holding each document
    tokenizer: str = MISSING  # a local Hugging Face tokenizer directory (a model=hf directory has one)
    vocab_size: Optional[int] = II("runner_vocab:${.tokenizer},null")
    val_fraction: float = 0.01
    cache_dir: Optional[str] = None
    cache_by_content: bool = False  # as data=text's: the token cache keyed by the sources' bytes


@dataclass
class TokensDataConfig:
    """A pre-tokenized corpus: one flat binary of token ids (numpy memmap), or a .npy file."""

    _target_: str = "runner.data.datasets.TokensData"
    path: str = MISSING
    dtype: str = "uint16"  # uint16 (vocabularies up to 65536) | uint32
    vocab_size: Optional[int] = None  # needed by the built-in models; checked against every batch
    val_fraction: float = 0.01
