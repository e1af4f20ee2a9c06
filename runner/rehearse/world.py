"""A rehearsed rank's process group: ``init_rehearsal`` makes this process rank ``rank`` of a
world of ``world_size`` whose peers are all answered here (``runner._torch.rehearsal.RehearsalGroup``), and
``collectives_by_dim`` reads what it issued, by kind and mesh dimension."""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist

from runner._torch.rehearsal import BACKEND, ledger, register
from runner.parallel.dims import ParallelDims
from runner.ranks.dist import DistEnv

__all__ = ["init_rehearsal", "collectives_by_dim", "reset_collectives"]


def init_rehearsal(rank: int, world_size: int, device: torch.device) -> DistEnv:
    """Join a rehearsal process group as ``rank`` of ``world_size`` (no peer process exists); the
    env is what ``runner.ranks.dist.init_distributed`` gives a real rank, so the training code takes it."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside 0..{world_size - 1}")
    register()
    if device.type == "cuda":  # before any mesh: DeviceMesh otherwise guesses the device from the rank
        torch.cuda.set_device(device)
    if world_size > 1:
        dist.init_process_group(BACKEND, store=dist.HashStore(), rank=rank, world_size=world_size)
    return DistEnv(rank=rank, world_size=world_size, device=device)


def reset_collectives() -> None:
    ledger().clear()


def _dimension(ranks: tuple[int, ...], dims: ParallelDims) -> str:
    """The mesh dimension a group of global ranks spans: ``pp``, ``dp``, ``tp``, ``dp+tp`` (a
    flattened one), ``world``."""
    if len(ranks) == dims.world_size:
        return "world"
    coords = [dims.coords(r) for r in ranks]
    varying = [d for d in dims.ORDER if len({getattr(c, d) for c in coords}) > 1]
    return "+".join(varying) if varying else "self"


def collectives_by_dim(dims: ParallelDims) -> dict[str, dict[str, dict[str, int]]]:
    """``{dimension: {kind: {"count": n, "bytes": b}}}`` of what this process issued since the last
    ``reset_collectives``."""
    out: dict[str, dict[str, dict[str, int]]] = defaultdict(dict)
    for kind, ranks, count, nbytes in ledger().snapshot():
        entry = out[_dimension(ranks, dims)].setdefault(kind, {"count": 0, "bytes": 0})
        entry["count"] += count
        entry["bytes"] += nbytes
    return {d: dict(sorted(k.items())) for d, k in sorted(out.items())}
