"""User datasets (``data._target_=helpers.datasets...``) for the tests of the dataset contract."""

from __future__ import annotations

import torch

CALLS: list[tuple[int, str]] = []  # (step, split) of every batch() call, in this process


class StepLog:
    """Records the step each batch is asked for; the batch is a pure function of (seed, step, split)."""

    def __init__(self, *, vocab_size: int, seed: int, **unused):
        self.vocab_size, self.seed = vocab_size, seed

    def batch(self, step, batch_size, seq_len, *, split="train"):
        CALLS.append((step, split))
        g = torch.Generator().manual_seed(self.seed * 1000 + step * 2 + (split == "val"))
        tokens = torch.randint(self.vocab_size, (batch_size, seq_len + 1), generator=g)
        return tokens[:, :-1], tokens[:, 1:]
