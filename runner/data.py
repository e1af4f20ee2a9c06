"""Datasets. Every batch is a pure function of (seed, split, step): all ranks draw the same global
batch without communicating, and a run can resume at any step.

A dataset is any object with ``batch(step, batch_size, seq_len, *, split)`` (split "train" or "val",
the held-out data) returning ``(inputs, targets)`` or ``(inputs, targets, keyword_inputs)``; keyword
inputs are batch-first tensors that reach every model child whose forward names them."""

from __future__ import annotations

from pathlib import Path

import torch
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig

from runner.errors import ConfigError

__all__ = ["SPLITS", "build_dataset", "get_batch", "SyntheticData", "TextData"]

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
    """``(inputs, targets, keyword_inputs)`` whichever form the dataset returns."""
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
        g = _generator(self.seed, step, split)
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


class TextData:
    """Byte-level language modelling on a local text file: random windows of ``seq_len + 1``
    bytes per sample; the last ``val_fraction`` of the file is held out for evaluation."""

    def __init__(self, *, path: str, vocab_size: int, seed: int, val_fraction: float = 0.1):
        file = Path(path)
        if not file.is_file():
            raise ConfigError(f"data.path={path!r}: no such file. Fix: data.path=<a local text file>.")
        if vocab_size != 256:
            raise ConfigError(f"data.vocab_size={vocab_size}: text data is byte-level. Fix: 256.")
        if not 0.0 < val_fraction < 1.0:
            raise ConfigError(f"data.val_fraction={val_fraction} must be between 0 and 1. Fix: e.g. 0.1.")
        tokens = torch.frombuffer(bytearray(file.read_bytes()), dtype=torch.uint8).long()
        cut = len(tokens) - int(len(tokens) * val_fraction)
        self.splits = {"train": tokens[:cut], "val": tokens[cut:]}
        self.vocab_size = vocab_size
        self.seed = seed

    def batch(self, step: int, batch_size: int, seq_len: int, *, split: str = "train"):
        tokens = self.splits[split]
        if len(tokens) < seq_len + 2:
            raise ConfigError(
                f"data.path's {split} split holds {len(tokens)} bytes, fewer than train.seq_len + 2 = "
                f"{seq_len + 2}. Fix: a longer file, a smaller train.seq_len or another data.val_fraction."
            )
        starts = torch.randint(len(tokens) - seq_len - 1, (batch_size,), generator=_generator(self.seed, step, split))
        windows = torch.stack([tokens[s : s + seq_len + 1] for s in starts.tolist()])
        return windows[:, :-1], windows[:, 1:]
