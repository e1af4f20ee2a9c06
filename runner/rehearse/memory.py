"""What a rank holds: its parameters, gradients and optimizer state, in bytes of its local
tensors (a DTensor's shard, an FSDP parameter's shard): the same function for a rehearsed rank
and for a real one (the tests compare them)."""

from __future__ import annotations

from typing import Iterable

import torch
from torch.distributed.tensor import DTensor

__all__ = ["held_bytes", "tensor_bytes"]


def tensor_bytes(t: torch.Tensor) -> int:
    local = t.to_local() if isinstance(t, DTensor) else t
    return local.numel() * local.element_size()


def held_bytes(params: Iterable[torch.nn.Parameter], optimizer: torch.optim.Optimizer | None) -> dict[str, int]:
    """``{"params", "grads", "optimizer_state"}``: bytes of this rank's local tensors (a weight
    counted once however many names it has)."""
    unique = list({id(p): p for p in params}.values())
    state = [v for s in (optimizer.state.values() if optimizer is not None else ())
             for v in s.values() if isinstance(v, torch.Tensor)]
    return {"params": sum(tensor_bytes(p) for p in unique),
            "grads": sum(tensor_bytes(p.grad) for p in unique if p.grad is not None),
            "optimizer_state": sum(tensor_bytes(v) for v in state)}
