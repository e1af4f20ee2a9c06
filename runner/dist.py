"""Process group setup and teardown, device choice, and the few collectives the loop needs."""

from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["DistEnv", "resolve_device", "pick_device", "synchronize", "init_distributed", "cleanup",
           "all_reduce_sum", "gather_to_main"]


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def resolve_device(choice: str, ranks_on_host: int) -> str:
    """``auto`` means CUDA only when this host has a GPU for each of its ranks: every rank must
    use the same backend, and NCCL cannot put two ranks on one GPU."""
    if choice == "auto":
        return "cuda" if torch.cuda.device_count() >= ranks_on_host else "cpu"
    return choice


def pick_device(kind: str, local_rank: int) -> torch.device:
    """This rank's device for a resolved ``kind`` (``cpu`` or ``cuda``)."""
    if kind == "cuda":
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def synchronize(device: torch.device) -> None:
    """Wait for ``device``'s queued work: CUDA kernels and NCCL calls return before it is done,
    so a wall-clock timing must sync on both ends."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _gloo_on_loopback() -> None:
    """Ranks spawned on one host: gloo binds to loopback and talks to nobody else, whatever
    ``GLOO_SOCKET_IFNAME`` the launching shell set (that value names the interface for jobs across
    hosts; here it would only expose the ranks' sockets and could fail where it does not route
    back). torchrun's and SLURM's ranks keep the variable: across nodes it is how they find each
    other."""
    interface = next((n for _, n in socket.if_nameindex() if n.startswith("lo")), None)
    if interface:
        os.environ["GLOO_SOCKET_IFNAME"] = interface


def init_distributed(
    *, rank: int, world_size: int, device: torch.device, timeout_s: float, store: dist.Store | None = None
) -> DistEnv:
    """Join the process group: ``store`` for ranks spawned on this host, else torchrun's env://."""
    if world_size > 1:
        if store is not None:
            _gloo_on_loopback()
        dist.init_process_group(
            backend="nccl" if device.type == "cuda" else "gloo",
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
            device_id=device if device.type == "cuda" else None,
        )
    return DistEnv(rank=rank, world_size=world_size, device=device)


def cleanup() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def all_reduce_sum(tensor: torch.Tensor, env: DistEnv) -> torch.Tensor:
    if env.world_size > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def gather_to_main(obj: Any, env: DistEnv) -> list[Any] | None:
    """Every rank's ``obj`` on rank 0 (in rank order), None elsewhere."""
    if env.world_size == 1:
        return [obj]
    out = [None] * env.world_size if env.is_main else None
    dist.gather_object(obj, out, dst=0)
    return out


def local_rank_from_env() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))
