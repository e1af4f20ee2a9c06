"""AdamW with decoupled weight decay on the parameters that should decay, and the learning-rate
schedule."""

from __future__ import annotations

import math

import torch
from omegaconf import DictConfig
from torch import nn

from runner.config import LR_SCHEDULES, NO_DECAY_NAMES

__all__ = ["LR_SCHEDULES", "NO_DECAY_KINDS", "lr_factor", "param_groups", "build_optimizer"]

NORMS = (nn.LayerNorm, nn.RMSNorm, nn.GroupNorm, nn.modules.batchnorm._NormBase)
NO_DECAY_KINDS = {
    "bias": lambda module, name: name == "bias",
    "norm": lambda module, name: isinstance(module, NORMS),
    "embedding": lambda module, name: isinstance(module, nn.Embedding),
}
assert tuple(NO_DECAY_KINDS) == NO_DECAY_NAMES, "the names checked before launch (runner.config)"


def lr_factor(step: int, *, steps: int, warmup_steps: int, min_lr_ratio: float, schedule: str = "cosine") -> float:
    """Linear warmup to 1, then ``schedule`` from 1 to ``min_lr_ratio`` at the last step."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    progress = min((step - warmup_steps) / max(1, steps - warmup_steps - 1), 1.0)
    decay = 1 - progress if schedule == "linear" else 0.5 * (1 + math.cos(math.pi * progress))
    return min_lr_ratio + (1 - min_lr_ratio) * decay


def param_groups(modules: list[nn.Module], weight_decay: float, no_decay: list[str]) -> list[dict]:
    """Two AdamW groups: decayed, and the parameter kinds in ``no_decay``. A parameter shared by
    two modules (tied embedding and head) is listed once, and skips decay if either owner says so."""
    decayed: dict[int, nn.Parameter] = {}
    exempt: dict[int, nn.Parameter] = {}
    for root in modules:
        for module in root.modules():
            for name, p in module.named_parameters(recurse=False):
                if any(NO_DECAY_KINDS[kind](module, name) for kind in no_decay):
                    exempt[id(p)] = p
                else:
                    decayed[id(p)] = p
    decayed = {k: p for k, p in decayed.items() if k not in exempt}
    return [{"params": list(decayed.values()), "weight_decay": weight_decay},
            {"params": list(exempt.values()), "weight_decay": 0.0}]


def build_optimizer(modules: list[nn.Module], train: DictConfig):
    """AdamW over this rank's stage modules and its LambdaLR schedule."""
    optimizer = torch.optim.AdamW(param_groups(modules, train.weight_decay, list(train.no_decay)),
                                  lr=train.lr, betas=tuple(train.betas))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(
        s, steps=train.steps, warmup_steps=train.warmup_steps, min_lr_ratio=train.min_lr_ratio,
        schedule=train.lr_schedule))
    return optimizer, scheduler
