"""AdamW with decoupled weight decay on the parameters that should decay, and the learning-rate
schedule."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, AbstractSet, Sequence

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from runner.options import LRSchedule, NoDecay

if TYPE_CHECKING:
    from runner.config import TrainConfig

__all__ = ["NO_DECAY_KINDS", "lr_factor", "param_groups", "check_distinct_storage", "build_optimizer",
           "clip_grads"]

# By shape and role, not by a list of classes (transformers' LlamaRMSNorm is no torch norm):
# every 1-D parameter is a bias or a gain (the weights of norms of any class), and embedding tables
# are lookups, not projections.
NO_DECAY_KINDS = {
    "bias": lambda module, name, p: p.dim() == 1 and name == "bias",
    "norm": lambda module, name, p: p.dim() == 1 and name != "bias",
    "embedding": lambda module, name, p: isinstance(module, nn.Embedding),
}
assert tuple(NO_DECAY_KINDS) == NoDecay.values(), "a rule for every train.no_decay kind (runner.options)"


def lr_factor(step: int, *, steps: int, warmup_steps: int, min_lr_ratio: float, schedule: str = "cosine") -> float:
    """Linear warmup to 1, then ``schedule`` from 1 to ``min_lr_ratio`` at the last step."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == LRSchedule.constant:
        return 1.0
    progress = min((step - warmup_steps) / max(1, steps - warmup_steps - 1), 1.0)
    decay = 1 - progress if schedule == LRSchedule.linear else 0.5 * (1 + math.cos(math.pi * progress))
    return min_lr_ratio + (1 - min_lr_ratio) * decay


def param_groups(modules: Sequence[nn.Module], weight_decay: float, no_decay: list[str],
                 embeddings: AbstractSet[int] = frozenset()) -> list[dict]:
    """Two AdamW groups: decayed, and the parameter kinds in ``no_decay``. A parameter shared by
    two modules (tied embedding and head) is listed once, and skips decay if either owner says so;
    ``embeddings`` are the ids of parameters tied to an embedding held by another stage."""
    decayed: dict[int, nn.Parameter] = {}
    exempt: dict[int, nn.Parameter] = {}
    for root in modules:
        for module in root.modules():
            for name, p in module.named_parameters(recurse=False):
                tied_embedding = "embedding" in no_decay and id(p) in embeddings
                if tied_embedding or any(NO_DECAY_KINDS[kind](module, name, p) for kind in no_decay):
                    exempt[id(p)] = p
                else:
                    decayed[id(p)] = p
    decayed = {k: p for k, p in decayed.items() if k not in exempt}
    return [{"params": list(decayed.values()), "weight_decay": weight_decay},
            {"params": list(exempt.values()), "weight_decay": 0.0}]


def _memory(p: torch.Tensor) -> tuple[int, int, int] | None:
    """(storage, first byte, end byte) of the elements ``p`` holds on this rank (None: none). A
    DTensor or FSDP parameter is a wrapper without storage of its own: its local tensor has it."""
    local = p.to_local() if isinstance(p, DTensor) else p
    if local.numel() == 0 or local.device.type == "meta":  # no memory to share
        return None
    size = local.element_size()
    start = int(local.storage_offset()) * size
    span = sum((int(n) - 1) * stride for n, stride in zip(local.shape, local.stride())) + 1
    return local.untyped_storage().data_ptr(), start, start + span * size


def check_distinct_storage(modules: Sequence[nn.Module], groups: list[dict]) -> None:
    """Refuse an optimizer whose parameters overlap in memory: it would update those elements once
    per parameter (a tied weight wrapped twice, e.g. by two stages' tensor-parallel styles).
    Parameters listed once by ``param_groups`` are distinct objects; this checks their memory."""
    names = {id(p): name for m in modules for name, p in m.named_parameters(remove_duplicate=False)}
    spans = sorted((memory, names.get(id(p), "?")) for g in groups for p in g["params"]
                   if (memory := _memory(p)) is not None)
    for (a, a_name), (b, b_name) in zip(spans, spans[1:]):
        if a[0] == b[0] and b[1] < a[2]:
            raise RuntimeError(f"runner: the optimizer holds {a_name} and {b_name} as two parameters over the same "
                               "memory, so each step would update it twice. This is a bug in how the runner ties or "
                               "wraps weights: please report it with the run's config.")


def build_optimizer(modules: Sequence[nn.Module], train: TrainConfig, *, embeddings: AbstractSet[int] = frozenset()):
    """AdamW over this rank's stage modules and its LambdaLR schedule."""
    groups = param_groups(modules, train.weight_decay, list(train.no_decay), embeddings)
    check_distinct_storage(modules, groups)
    optimizer = torch.optim.AdamW(groups, lr=train.lr, betas=(train.betas[0], train.betas[1]))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(
        s, steps=train.steps, warmup_steps=train.warmup_steps, min_lr_ratio=train.min_lr_ratio,
        schedule=train.lr_schedule))
    return optimizer, scheduler


def clip_grads(params: Sequence[nn.Parameter], max_norm: float, total_norm: float) -> None:
    """Scale every gradient by ``max_norm / total_norm`` where the norm exceeds it (``max_norm`` 0:
    no clipping). ``total_norm`` is the global one, the same on every rank: a per-rank clip would
    scale each stage differently. The training step and verify's unsplit reference both clip here."""
    if max_norm <= 0:
        return
    norm = torch.tensor(total_norm)
    for group in _by_kind(params):  # torch's foreach ops take DTensors or tensors, not both
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, norm)


def _by_kind(params: Sequence[nn.Parameter]) -> list[list[nn.Parameter]]:
    """The parameters grouped by the mesh their DTensors live on, and the plain ones: torch's
    foreach ops take neither a mix of DTensors and tensors nor DTensors of two meshes (with FSDP
    over tp, the tp-sharded weights are on the (dp, tp) mesh, the others on dp's alone)."""
    kinds: dict[object, list[nn.Parameter]] = {}
    for p in params:
        kinds.setdefault(p.device_mesh if isinstance(p, DTensor) else None, []).append(p)
    return list(kinds.values())
