"""Built-in losses. A loss takes one microbatch's logits ``(batch, seq, vocab)`` and targets
``(batch, seq)`` and returns the scalar mean over that microbatch's counted targets (those not
``IGNORE_INDEX``: padding, masked prompts). The pipeline schedules and the unsplit reference call
it through ``TargetWeighted``, which weights each microbatch by its share of the batch's counted
targets: the step's loss is then the mean over every counted target of the global batch, the
unsplit model's on the whole batch, whatever the microbatches and replicas it is split into (a
plain mean of microbatch means weights a target of a short microbatch more)."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from hydra.utils import instantiate
from omegaconf import DictConfig
from torch.distributed.tensor import DTensor

from runner.errors import ConfigError

__all__ = ["IGNORE_INDEX", "cross_entropy", "build_loss", "check_loss", "counted_targets", "TargetWeighted"]

IGNORE_INDEX = -100  # a target the loss skips (torch's and transformers' convention)


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
    loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE_INDEX,
                           label_smoothing=label_smoothing)
    return loss.to_local().clone() if isinstance(loss, DTensor) else loss


def counted_targets(targets: torch.Tensor) -> int:
    """How many of ``targets`` a loss counts (not ``IGNORE_INDEX``)."""
    return int((targets != IGNORE_INDEX).sum())


class TargetWeighted:
    """``loss_fn`` as the schedules call it, once per microbatch: its mean scaled by ``parts`` times
    the microbatch's share of the counted targets of the whole batch (``weigh``), where ``parts``
    is the count of microbatch means averaged into the step's loss (microbatches x dp replicas).
    The average of the scaled means is the mean over all counted targets, however unevenly
    padding falls between microbatches. Where every microbatch counts as many targets as any
    other (no padding) each scale would be exactly 1.0, so a batch that ignores no target is not
    weighed at all: the loss is ``loss_fn``'s, with no counting on the device in the step."""

    def __init__(self, loss_fn: Callable):
        self.loss_fn = loss_fn
        self.parts = 1
        self.counted = 0  # 0: not weighed, each microbatch's mean as it is

    def weigh(self, *, counted: int, total: int, parts: int) -> None:
        """The next step's (or evaluation batch's) counted targets over the whole batch of
        ``total`` targets, and the microbatch means its loss averages."""
        self.counted, self.parts = (0 if counted == total else counted), parts

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = self.loss_fn(logits, targets)
        if not self.counted:  # nothing counted anywhere: the mean is not finite either way
            return loss
        here = (targets != IGNORE_INDEX).sum()
        # A microbatch that counts nothing adds nothing (its mean, 0/0, is not finite); its
        # gradient through the unselected branch is zero.
        return torch.where(here > 0, loss * (here * self.parts / self.counted), torch.zeros_like(loss))
