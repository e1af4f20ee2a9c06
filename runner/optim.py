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
           "clip_grads", "clip_coefficient", "UpdateSnapshot"]

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


def clip_coefficient(max_norm: float, total_norm: float) -> float:
    """The factor ``clip_grads`` scales every gradient by, computed as torch computes it (float32
    ``max_norm / (total_norm + 1e-6)``, at most 1): 1.0 exactly where clipping leaves the gradients
    as they are (a product with 1.0 is exact), so an update made without clipping stands."""
    if max_norm <= 0:
        return 1.0
    return torch.clamp(max_norm / (torch.tensor(total_norm) + 1e-6), max=1.0).item()


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class UpdateSnapshot:
    """What an AdamW step changes on this rank, copied before it (``train.optimizer_sync=
    post_validate``): every parameter, and each one's optimizer state (both moments and ``step``), so
    that an update applied before its global check can be undone exactly, not by an inverse of
    AdamW. The copies are made once and refilled at each step; ``restore`` writes the values back
    into the same tensors (what the checkpointer holds stays what it holds). The LR schedule needs
    no copy: the trainer steps it after the validation."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer
        self.params: list[torch.Tensor] = [p for g in optimizer.param_groups for p in g["params"]]
        self.values: list[torch.Tensor] = []
        self.state: list[dict[str, object] | None] = []  # None: no state yet (before the first step)

    @torch.no_grad()
    def take(self) -> None:
        if not self.values:
            self.values = [p.detach().clone() for p in self.params]
        else:
            for p, copy in zip(self.params, self.values):
                copy.copy_(p)
        old = self.state or [None] * len(self.params)
        self.state = [_copy_state(self.optimizer.state.get(p), kept) for p, kept in zip(self.params, old)]

    @torch.no_grad()
    def restore(self) -> None:
        for p, copy, saved in zip(self.params, self.values, self.state):
            p.copy_(copy)
            if saved is None:
                self.optimizer.state.pop(p, None)  # the step made it: the redo makes it again
                continue
            state = self.optimizer.state[p]
            for key, value in saved.items():
                if isinstance(value, torch.Tensor):
                    state[key].copy_(value)
                else:
                    state[key] = value

    def numel(self) -> int:
        """The parameters' elements on this rank."""
        return sum(_local(p).numel() for p in self.params)

    def tensors(self) -> list[torch.Tensor]:
        """The copies on this rank (local shards): none before the first ``take``."""
        copies = [*self.values, *(v for s in self.state if s for v in s.values() if isinstance(v, torch.Tensor))]
        return [_local(t) for t in copies]

    def nbytes(self) -> int:
        """The memory the copies take on this rank."""
        return sum(t.numel() * t.element_size() for t in self.tensors())


def _copy_state(state: dict | None, kept: dict[str, object] | None) -> dict[str, object] | None:
    """A copy of one parameter's optimizer state, into ``kept``'s tensors where it has them."""
    if not state:
        return None
    out: dict[str, object] = {}
    for key, value in state.items():
        old = (kept or {}).get(key)
        if isinstance(value, torch.Tensor):
            if isinstance(old, torch.Tensor) and old.shape == value.shape and old.dtype == value.dtype:
                out[key] = old.copy_(value)
            else:
                out[key] = value.detach().clone()
        else:
            out[key] = value
    return out


def _by_kind(params: Sequence[nn.Parameter]) -> list[list[nn.Parameter]]:
    """The parameters grouped by the mesh their DTensors live on, and the plain ones: torch's
    foreach ops take neither a mix of DTensors and tensors nor DTensors of two meshes (with FSDP
    over tp, the tp-sharded weights are on the (dp, tp) mesh, the others on dp's alone)."""
    kinds: dict[object, list[nn.Parameter]] = {}
    for p in params:
        kinds.setdefault(p.device_mesh if isinstance(p, DTensor) else None, []).append(p)
    return list(kinds.values())
