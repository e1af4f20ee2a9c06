"""Built-in losses. A loss takes one microbatch's logits ``(batch, seq, vocab)`` and targets
``(batch, seq)`` and returns the scalar mean over that microbatch: the pipeline schedules and the
unsplit reference both average it over microbatches."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from hydra.utils import instantiate
from omegaconf import DictConfig
from torch.distributed.tensor import DTensor

__all__ = ["cross_entropy", "build_loss"]


def build_loss(loss_cfg: DictConfig) -> Callable:
    """``loss._target_`` as a function (logits, targets) -> scalar (checked before launch)."""
    return instantiate(loss_cfg)


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, *, label_smoothing: float = 0.0) -> torch.Tensor:
    """Mean next-token cross-entropy in fp32; targets of -100 (padding) are ignored. Logits sharded
    on the vocabulary (a DTensor: ``parallel.loss_parallel``, inside torch's ``loss_parallel()``,
    which the pipeline enters) give the replicated loss, returned as the plain tensor the
    schedules and the loss reduction take (a copy, not ``to_local``'s view: the split-backward
    schedules detach the loss in place); its backward still runs through the DTensor."""
    loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-100,
                           label_smoothing=label_smoothing)
    return loss.to_local().clone() if isinstance(loss, DTensor) else loss
