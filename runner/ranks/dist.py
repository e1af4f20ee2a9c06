"""Process group setup and teardown, device choice, and the few collectives the loop needs."""

from __future__ import annotations

import datetime
import gc
import logging
import os
import socket
import sys
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

__all__ = ["DistEnv", "resolve_device", "pick_device", "synchronize", "init_distributed", "cleanup",
           "new_cpu_group", "release_at_cleanup", "live_group_threads", "all_reduce_sum", "start_all_reduce_sum",
           "gather_to_main"]

log = logging.getLogger("runner.dist")  # named as before runner/ became packages (runner.log)


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    device: torch.device
    timeout_s: float = 300.0  # the collectives' timeout (launch.timeout_s)

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
    *, rank: int, world_size: int, device: torch.device, timeout_s: float, store: dist.Store | None = None,
    loopback: bool | None = None,
) -> DistEnv:
    """Join the process group: ``store`` for ranks spawned on this host (``loopback``, by default
    where a store is given: gloo on loopback) or a restarted torchrun worker's, else torchrun's env://."""
    if world_size > 1:
        if store is not None if loopback is None else loopback:
            _gloo_on_loopback()
        dist.init_process_group(
            backend="nccl" if device.type == "cuda" else "gloo",
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
            device_id=device if device.type == "cuda" else None,
        )
    return DistEnv(rank=rank, world_size=world_size, device=device, timeout_s=timeout_s)


def new_cpu_group(env: DistEnv) -> dist.ProcessGroup | None:
    """A gloo group of every rank, for collectives issued off the training's thread (a background
    checkpoint save): on a group of its own they cannot interleave with the training's, and gloo
    runs on CPU tensors whatever the device. A collective: every rank calls it, in the same order.
    None for one rank (nothing to meet)."""
    if env.world_size == 1:
        return None
    return dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=env.timeout_s))


# What keeps references to process groups (the cached meshes, DTensor's caches): dropped by ``cleanup``.
_releases: list[Callable[[], None]] = []
# Native threads of process groups (gloo's workers and transport loop; NCCL's watchdog, heartbeat).
_GROUP_THREADS = ("gloo", "pt_gloo", "pt_nccl")


def release_at_cleanup(release: Callable[[], None]) -> None:
    """Have ``cleanup`` call ``release()``, which drops references to process groups kept elsewhere."""
    _releases.append(release)


def live_group_threads() -> list[str]:
    """The names of this process's process-group threads still running (Linux; elsewhere none)."""
    if not sys.platform.startswith("linux"):
        return []
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                names.append(f.read().strip())
        except OSError:  # the thread ended meanwhile
            continue
    return sorted(n for n in names if n.startswith(_GROUP_THREADS))


def cleanup(*, end_threads: bool = True) -> None:
    """Leave the process group, and with ``end_threads`` end its threads before this process exits.
    ``destroy_process_group`` only unregisters the groups: a group's threads stop when its last
    reference goes (a cached ``DeviceMesh`` keeps its groups, in reference cycles too). A thread
    still running while the interpreter finalizes that then asks for the GIL (a work's callback,
    the release of a tensor Python also held) is ended by ``pthread_exit`` in Python 3.11, which
    aborts the process: "terminate called without an active exception", after all its work was
    done. A rank that is failing passes ``end_threads=False``: a peer may still be inside a
    collective with it, and joining a thread that waits for that peer would hang its exit."""
    if not dist.is_initialized():
        return
    dist.destroy_process_group()
    if not end_threads:
        return
    for release in _releases:
        release()
    gc.collect()
    left = live_group_threads()
    if left:
        log.warning("process-group threads still running after destroy_process_group (%s): something still "
                    "references a process group; this process may abort at exit", ", ".join(left))


def all_reduce_sum(tensor: torch.Tensor, env: DistEnv) -> torch.Tensor:
    if env.world_size > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def start_all_reduce_sum(tensor: torch.Tensor, env: DistEnv) -> dist.Work | None:
    """``all_reduce_sum`` started without blocking: ``tensor`` holds the sum once the returned
    work's ``wait()`` returns (None: one rank, nothing to wait for)."""
    if env.world_size == 1:
        return None
    return dist.all_reduce(tensor, op=dist.ReduceOp.SUM, async_op=True)


def gather_to_main(obj: Any, env: DistEnv) -> list[Any] | None:
    """Every rank's ``obj`` on rank 0 (in rank order), None elsewhere."""
    if env.world_size == 1:
        return [obj]
    out = [None] * env.world_size if env.is_main else None
    dist.gather_object(obj, out, dst=0)
    return out


def local_rank_from_env() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))
