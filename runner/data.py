"""Datasets. Every batch is a pure function of (seed, step): all ranks draw the same global
batch without communicating, and a run can resume at any step."""

from __future__ import annotations

from pathlib import Path

import torch
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig

from runner.errors import ConfigError

__all__ = ["build_dataset", "SyntheticData", "TextData"]


def build_dataset(data_cfg: DictConfig, *, seed: int):
    """Instantiate ``data._target_``; its own config errors surface unwrapped."""
    try:
        return instantiate(data_cfg, seed=seed)
    except InstantiationException as e:
        if isinstance(e.__cause__, ConfigError):
            raise e.__cause__ from None
        raise ConfigError(f"data._target_={data_cfg.get('_target_')!r} could not be built: {e}") from e


def _generator(seed: int, step: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 1_000_003 + step)


class SyntheticData:
    """Token streams from a hidden bigram rule (``next = perm[current]``) with probability
    ``signal``, uniform noise otherwise: deterministic, and learnable, so the loss drops quickly
    from ln(vocab_size) towards the noise floor."""

    def __init__(self, *, vocab_size: int, signal: float, seed: int):
        if not 0.0 <= signal <= 1.0:
            raise ConfigError(f"data.signal={signal} is not a probability. Fix: 0 <= data.signal <= 1.")
        self.vocab_size = vocab_size
        self.signal = signal
        self.seed = seed
        self.rule = torch.randperm(vocab_size, generator=_generator(seed, -1))

    def batch(self, step: int, batch_size: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = _generator(self.seed, step)
        tokens = torch.empty(batch_size, seq_len + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(self.vocab_size, (batch_size,), generator=g)
        noise = torch.randint(self.vocab_size, (batch_size, seq_len), generator=g)
        keep = torch.rand(batch_size, seq_len, generator=g) < self.signal
        for t in range(seq_len):
            tokens[:, t + 1] = torch.where(keep[:, t], self.rule[tokens[:, t]], noise[:, t])
        return tokens[:, :-1], tokens[:, 1:]


class TextData:
    """Byte-level language modelling on a local text file: random windows of ``seq_len + 1``
    bytes per sample."""

    def __init__(self, *, path: str, vocab_size: int, seed: int):
        file = Path(path)
        if not file.is_file():
            raise ConfigError(f"data.path={path!r}: no such file. Fix: data.path=<a local text file>.")
        if vocab_size != 256:
            raise ConfigError(f"data.vocab_size={vocab_size}: text data is byte-level. Fix: 256.")
        self.tokens = torch.frombuffer(bytearray(file.read_bytes()), dtype=torch.uint8).long()
        self.vocab_size = vocab_size
        self.seed = seed

    def batch(self, step: int, batch_size: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        if len(self.tokens) < seq_len + 2:
            raise ConfigError(
                f"data.path holds {len(self.tokens)} bytes, fewer than train.seq_len + 2 = "
                f"{seq_len + 2}. Fix: a longer file or a smaller train.seq_len."
            )
        starts = torch.randint(len(self.tokens) - seq_len - 1, (batch_size,), generator=_generator(self.seed, step))
        windows = torch.stack([self.tokens[s : s + seq_len + 1] for s in starts.tolist()])
        return windows[:, :-1], windows[:, 1:]
