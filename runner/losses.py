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

from runner.errors import ConfigError

__all__ = ["cross_entropy", "build_loss", "check_loss"]


def build_loss(loss_cfg: DictConfig) -> Callable:
    """``loss._target_`` as a function (logits, targets) -> scalar (checked before launch)."""
    return instantiate(loss_cfg)


def check_loss(loss_cfg: DictConfig, vocab: int) -> None:
    """Call the loss on a tiny real microbatch of ``vocab`` logits: a wrong target or signature
    fails before launch."""
    target = loss_cfg.get("_target_")
    try:
        loss = build_loss(loss_cfg)(torch.randn(1, 2, vocab), torch.zeros(1, 2, dtype=torch.long))
    except Exception as e:  # the user's loss can fail in any way
        raise ConfigError(f"loss._target_={target!r} could not be built or called as loss(logits, targets): {e}\n"
                          "Fix: a function (logits (batch, seq, vocab), targets (batch, seq)) -> scalar tensor; "
                          "keep loss._partial_=true.") from e
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        raise ConfigError(f"loss._target_={target!r} returned {type(loss).__name__} "
                          f"{tuple(getattr(loss, 'shape', ()))}, not a scalar tensor. Fix: return the mean loss.")


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, *, label_smoothing: float = 0.0) -> torch.Tensor:
    """Mean next-token cross-entropy in fp32; targets of -100 (padding) are ignored. Logits sharded
    on the vocabulary (a DTensor: ``parallel.loss_parallel``, inside torch's ``loss_parallel()``,
    which the pipeline enters) give the replicated loss, returned as the plain tensor the
    schedules and the loss reduction take (a copy, not ``to_local``'s view: the split-backward
    schedules detach the loss in place); its backward still runs through the DTensor."""
    loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-100,
                           label_smoothing=label_smoothing)
    return loss.to_local().clone() if isinstance(loss, DTensor) else loss
