"""Datasets. Every batch is a pure function of (seed, split, step): all ranks draw the same global
batch without communicating, and a run can resume at any step.

A dataset is any object with ``batch(step, batch_size, seq_len, *, split)`` (split "train" or "val",
the held-out data) returning ``(inputs, targets)`` or ``(inputs, targets, keyword_inputs)``; keyword
inputs are batch-first tensors that reach every model unit whose forward names them. ``step`` is
numbered from 1, as everywhere steps are shown: optimizer step N trains on ``batch(N)``, and an
evaluation reads ``batch(1..eval.steps, split="val")``. Text, Hugging Face datasets and pre-tokenized
corpora are token streams (``runner.data.tokens``; ``runner.data.token_files``)."""

from __future__ import annotations

import hashlib
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig

from runner.data.files import default_cache_dir, file_identity, find_files, text_files
from runner.data.records import load_records, naming_bad_records
from runner.data.token_cache import tokenize_to_cache
from runner.data.token_files import as_stream, check_ids, open_tokens
from runner.data.tokens import TokenStream, dataset_documents, load_tokenizer, text_documents
from runner.errors import ConfigError

__all__ = ["SPLITS", "build_dataset", "get_batch", "check_batches", "check_eval_windows", "check_vocab",
           "train_windows", "SyntheticData", "TextData", "HFData", "TokensData"]

SPLITS = ("train", "val")


def build_dataset(data_cfg: DictConfig, *, seed: int):
    """Instantiate ``data._target_``; its own config errors surface unwrapped."""
    try:
        return instantiate(data_cfg, seed=seed)
    except InstantiationException as e:
        if isinstance(e.__cause__, ConfigError):
            raise e.__cause__ from None
        raise ConfigError(f"data._target_={data_cfg.get('_target_')!r} could not be built: {e}") from e


def get_batch(data, step: int, batch_size: int, seq_len: int, split: str = "train"):
    """``(inputs, targets, keyword_inputs)`` of step ``step`` (from 1), whichever form the dataset
    returns."""
    batch = data.batch(step, batch_size, seq_len, split=split)
    return (*batch, {}) if len(batch) == 2 else tuple(batch)


def _generator(seed: int, step: int, split: str = "train") -> torch.Generator:
    # Held-out batches come from their own stream: no val batch repeats a train batch. (The CPU
    # generator keeps only the seed's low 32 bits: the val stream differs there.)
    base = seed * 1_000_003 + step
    return torch.Generator().manual_seed(base if split == "train" else base ^ 0x5BD1E995)


class SyntheticData:
    """Token streams from a hidden bigram rule (``next = perm[current]``) with probability
    ``signal``, uniform noise otherwise: deterministic, and learnable, so the loss drops quickly
    from ln(vocab_size) towards the noise floor. With ``padding``, each sample is left-padded by
    0 to seq_len/2 tokens and comes with ``attention_mask`` (True = real token); padded targets
    are -100, which the loss ignores."""

    def __init__(self, *, vocab_size: int, signal: float, seed: int, padding: bool = False):
        if not 0.0 <= signal <= 1.0:
            raise ConfigError(f"data.signal={signal} is not a probability. Fix: 0 <= data.signal <= 1.")
        self.vocab_size = vocab_size
        self.signal = signal
        self.seed = seed
        self.padding = padding
        self.rule = torch.randperm(vocab_size, generator=_generator(seed, -1))

    def batch(self, step: int, batch_size: int, seq_len: int, *, split: str = "train"):
        if step < 1:
            raise ValueError(f"step {step}: steps are numbered from 1")
        g = _generator(self.seed, step - 1, split)  # (step - 1: the streams of the 0-based numbering before)
        tokens = torch.empty(batch_size, seq_len + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(self.vocab_size, (batch_size,), generator=g)
        noise = torch.randint(self.vocab_size, (batch_size, seq_len), generator=g)
        keep = torch.rand(batch_size, seq_len, generator=g) < self.signal
        for t in range(seq_len):
            tokens[:, t + 1] = torch.where(keep[:, t], self.rule[tokens[:, t]], noise[:, t])
        inputs, targets = tokens[:, :-1], tokens[:, 1:].clone()
        if not self.padding:
            return inputs, targets
        pad = torch.randint(seq_len // 2 + 1, (batch_size, 1), generator=g)
        mask = torch.arange(seq_len) >= pad
        return inputs.masked_fill(~mask, 0), targets.masked_fill(~mask, -100), {"attention_mask": mask}


class TextData(TokenStream):
    """Language modelling on local text: bytes of the file (``data.vocab_size`` 256), or, with
    ``data.tokenizer`` (a local Hugging Face tokenizer directory), its tokens; ``data.path`` may
    also be a directory or a glob, each file a document. Batches are windows of the token stream
    (``runner.data.tokens``); the last ``val_fraction`` is held out for evaluation."""

    def __init__(self, *, path: str, vocab_size: int | None, seed: int, val_fraction: float = 0.1,
                 tokenizer: str | None = None, cache_dir: str | None = None, cache_by_content: bool = False):
        if tokenizer is None:
            files, kind = find_files(path)
            if kind == "directory" or len(files) > 1:
                raise ConfigError(f"data.path={path!r} names {len(files)} files ({kind}); text without "
                                  "data.tokenizer is the bytes of one file. Fix: data.path=<a local text file>, or "
                                  "data.tokenizer=<dir> for a directory or glob of files, each a document.")
            file = files[0]
            if vocab_size != 256:
                raise ConfigError(f"data.vocab_size={vocab_size}: text data without data.tokenizer is byte-level. "
                                  "Fix: 256, or data.tokenizer=<a tokenizer directory>.")
            tokens = np.memmap(file, dtype=np.uint8, mode="r") if file.stat().st_size else np.zeros(0, np.uint8)
        else:
            files, pieces = text_documents(text_files(path))
            tokens, vocab = tokenize_to_cache(pieces, files=files, tokenizer=load_tokenizer(tokenizer),
                                              tokenizer_dir=tokenizer, cache_dir=cache_dir, extra="text",
                                              by_content=cache_by_content)
            _check_tokenizer_vocab(vocab_size, vocab, tokenizer)
            vocab_size = vocab_size or vocab
        super().__init__(tokens, seed=seed, val_fraction=val_fraction, vocab_size=vocab_size, source=path)


class HFData(TokenStream):
    """Local json/jsonl/parquet/arrow/csv files read with ``datasets``: ``data.field`` of each record
    is a document, tokenized with ``data.tokenizer`` (once, cached) and packed with EOS between."""

    def __init__(self, *, path: str, tokenizer: str, seed: int, field: str = "text", vocab_size: int | None = None,
                 val_fraction: float = 0.01, cache_dir: str | None = None, cache_by_content: bool = False):
        field = str(field)  # a column's name, even where YAML read a number
        files = find_files(path)[0]
        # datasets keys its Arrow copy by path and modification time: one directory per identity of the sources.
        identity = hashlib.sha256("\n".join(file_identity(f) for f in files).encode()).hexdigest()[:16]
        cache = (Path(cache_dir).expanduser() if cache_dir else default_cache_dir()) / "datasets" / identity
        files, ds = load_records(path, files, field, str(cache))
        pieces = dataset_documents(ds, field)
        with naming_bad_records(path, files):
            tokens, vocab = tokenize_to_cache(pieces, files=files, tokenizer=load_tokenizer(tokenizer),
                                              tokenizer_dir=tokenizer, cache_dir=cache_dir, extra=f"hf/{field}",
                                              by_content=cache_by_content)
        _check_tokenizer_vocab(vocab_size, vocab, tokenizer)
        super().__init__(tokens, seed=seed, val_fraction=val_fraction, vocab_size=vocab_size or vocab, source=path)


class TokensData(TokenStream):
    """A pre-tokenized corpus: flat binaries of ``data.dtype`` token ids (or ``.npy`` arrays of an
    integer dtype), memory-mapped; a directory or glob of them is read as one stream, in name order
    (``runner.data.token_files``)."""

    def __init__(self, *, path: str, seed: int, dtype: str = "uint16", vocab_size: int | None = None,
                 val_fraction: float = 0.01):
        self.files = find_files(path)[0]
        self.arrays = open_tokens(path, self.files, dtype)
        super().__init__(as_stream(self.files, self.arrays), seed=seed, val_fraction=val_fraction,
                         vocab_size=vocab_size, source=path)

    def check_ids(self, limit: int, bound: str) -> None:
        """Every id in ``0 .. limit - 1``, read once per file (before launch; see ``check_vocab``)."""
        check_ids(self.source, self.files, self.arrays, limit, bound, default_cache_dir())


def check_batches(data_cfg: DictConfig, *, seed: int, batch_size: int, seq_len: int, splits: tuple[str, ...],
                  microbatch: int) -> tuple[Any, dict[str, torch.Tensor]]:
    """Build the dataset and draw the first batch of each of ``splits``, checking their shapes
    before launch: the dataset, and one microbatch's keyword inputs (of the last split drawn)."""
    data = build_dataset(data_cfg, seed=seed)  # e.g. a missing text file fails here
    kwargs: dict[str, torch.Tensor] = {}
    for split in splits:
        try:
            inputs, targets, kwargs = get_batch(data, 1, batch_size, seq_len, split)
        except (TypeError, ValueError) as e:
            raise ConfigError(
                f"data._target_={data_cfg.get('_target_')!r}: batch(step, batch_size, seq_len, split={split!r}) "
                f"failed: {e}\nFix: return (inputs, targets) or (inputs, targets, keyword_inputs); see docs/models.md."
            ) from e
        bad = [k for k, v in kwargs.items() if not isinstance(v, torch.Tensor) or v.shape[:1] != (batch_size,)]
        if bad or inputs.shape != (batch_size, seq_len) or targets.shape != inputs.shape:
            raise ConfigError(
                f"data._target_={data_cfg.get('_target_')!r} returned inputs {tuple(inputs.shape)}, targets "
                f"{tuple(targets.shape)}, keyword inputs {bad or 'ok'}: expected (batch_size, seq_len) = "
                f"{(batch_size, seq_len)} and batch-first tensors. Fix: the dataset's batch()."
            )
    return data, {k: v[:microbatch] for k, v in kwargs.items()}


def check_eval_windows(data, *, eval_steps: int, batch_size: int, seq_len: int) -> None:
    """An evaluation reads ``eval_steps x batch_size`` held-out samples, epoch after epoch of a token
    stream's validation windows (a permutation each). Each window then weighs the same in the
    held-out loss where the reads are at most one epoch or whole epochs of them; otherwise some
    windows would be read once more than the others, so that is refused before launch."""
    if not isinstance(data, TokenStream):
        return  # synthetic and user datasets draw their own held-out batches
    windows, reads = data.num_windows("val", seq_len), eval_steps * batch_size
    if windows < 1 or reads <= windows or reads % windows == 0:
        return
    whole = windows // math.gcd(batch_size, windows)  # eval.steps of whole passes are its multiples
    below = max(windows // batch_size, (eval_steps - 1) // whole * whole)  # one pass at most, or whole ones
    above = (eval_steps // whole + 1) * whole
    fixes = " or ".join(f"eval.steps={k} ({k * batch_size} samples)" for k in (below, above) if k)
    raise ConfigError(
        f"eval.steps={eval_steps} x train.batch_size={batch_size} = {reads} held-out samples, but "
        f"{data.key}={data.source!r}'s validation split holds {windows} windows of train.seq_len + 1 = "
        f"{seq_len + 1} tokens: an evaluation would read {reads % windows} of them once more than the others, "
        f"weighting the held-out loss unevenly. Fix: {fixes} (at most one pass over the windows, or whole "
        f"passes), or another data.val_fraction.")


def train_windows(data, seq_len: int) -> int | None:
    """How many windows of ``seq_len + 1`` tokens a token stream's training split holds (its epoch:
    which window a step reads depends on it), or None for data without windows (synthetic, a
    user's dataset). A checkpoint records it; a resume compares (``runner.checkpoint.resume_check``)."""
    return data.num_windows("train", seq_len) if isinstance(data, TokenStream) else None


def check_vocab(data, data_vocab: int | None, model_vocab: int) -> None:
    """Token ids index the embedding: the data's vocabulary must fit the model's (``model_vocab``:
    the width of its logits), and a dataset that can check its ids (``TokensData``) checks them,
    all of them, before any rank starts. With ``data.vocab_size=null`` the data's is the one the
    dataset took (a tokenizer's: ``TextData``, ``HFData``)."""
    built = getattr(data, "vocab_size", None)
    vocab = data_vocab if data_vocab is not None else built if isinstance(built, int) else None
    if vocab is not None and vocab > model_vocab:
        key = (f"data.vocab_size={data_vocab}" if data_vocab is not None else
               f"data.vocab_size=null takes the data's vocabulary, data.tokenizer's ({vocab}), which")
        raise ConfigError(f"{key} is larger than the model's vocabulary ({model_vocab}): token ids would fall outside "
                          "its embedding. Fix: a tokenizer or data of the model's vocabulary, or a model with a larger "
                          "one.")
    if isinstance(data, TokensData):
        limit = min(model_vocab, data_vocab or model_vocab)
        data.check_ids(limit, "data.vocab_size" if limit < model_vocab else "the model's vocabulary")


def _check_tokenizer_vocab(vocab_size: int | None, tokenizer_vocab: int, tokenizer: str) -> None:
    if vocab_size is not None and vocab_size < tokenizer_vocab:
        raise ConfigError(f"data.vocab_size={vocab_size} is smaller than data.tokenizer={tokenizer!r}'s vocabulary "
                          f"({tokenizer_vocab}). Fix: data.vocab_size={tokenizer_vocab}, or null (the tokenizer's).")
