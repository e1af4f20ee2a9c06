"""This host's share of a run, resolved before launch: its cores, the intra-op threads of each
rank, the cores each rank the runner spawns is pinned to (``launch.threads_per_rank``,
``launch.pin_cpus``), and what its GPUs and compilers allow. Imports no torch at module level."""

from __future__ import annotations

import os
import shutil
from typing import Callable, MutableMapping

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from runner.errors import ConfigError
from runner.ranks.env import under_torchrun

__all__ = ["usable_cpus", "overloaded", "threads_per_rank", "rank_cpus", "check_host", "PASSIVE_THREADS",
           "passive_threads", "say_if_overloaded"]

# A thread of torch's OpenMP (GNU OpenMP in torch's CPU builds: ``torch.__config__.parallel_info()``)
# that finished its share of a parallel region spins, by default, before it sleeps: on a host where
# other work runs, the spinning threads hold the cores the others (and their own rank's last thread)
# need; a step of pp=1 on 2 threads took 20x its one-thread time. Passive threads sleep at once
# (BENCHMARKS.md, "Threads on a loaded host"). Read as OpenMP loads, with torch: set before that.
PASSIVE_THREADS = {"OMP_WAIT_POLICY": "PASSIVE"}
# The user's own choice of how OpenMP threads wait (GNU's, Intel's), which the runner then leaves alone.
_WAIT_SETTINGS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")
_overload_said = [False]


def _concurrent_jobs() -> int:
    """Jobs a Hydra launcher runs at once on this host (joblib's n_jobs; -1 = one per core)."""
    n_jobs = HydraConfig.get().launcher.get("n_jobs") if HydraConfig.initialized() else None
    if not n_jobs:
        return 1
    return n_jobs if n_jobs > 0 else os.cpu_count() or 1


def usable_cpus() -> list[int]:
    """The cores this process may run on (a container's or taskset's share, not the host's count)."""
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))


def _load_average() -> float | None:
    """The load average of the last minute (runnable and waiting tasks), where the OS tells it."""
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else None


def overloaded() -> float | None:
    """The last minute's load average where it exceeds this host's cores (other work already waits
    for them), else None."""
    load = _load_average()
    return load if load is not None and load > (os.cpu_count() or 1) else None


def threads_per_rank(cfg: DictConfig, ranks_on_host: int) -> int:
    """Ranks on one host, of every job running at once, share its cores: oversubscribed
    intra-op threads slow every rank down. Not the host's momentary load: the count decides how
    reductions split, so the same config on the same host computes the same numbers; threads
    wait passively (``passive_threads``), so on a loaded host they sleep instead of spinning
    against other work (BENCHMARKS.md, "Threads on a loaded host")."""
    return cfg.launch.threads_per_rank or max(1, len(usable_cpus()) // (ranks_on_host * _concurrent_jobs()))


def rank_cpus(cfg: DictConfig, device: str, ranks_on_host: int, threads: int) -> tuple[tuple[int, ...], ...] | None:
    """The cores each rank this runner spawns is pinned to (``launch.pin_cpus``), or None: not
    pinned. Consecutive blocks of ``threads`` cores, by rank."""
    pin = cfg.launch.pin_cpus
    if under_torchrun() and pin:
        raise ConfigError("launch.pin_cpus=true pins the ranks the runner starts itself; these ranks were "
                          "started by torchrun (or SLURM). Fix: launch.pin_cpus=null, and place them with the "
                          "launcher's own options (torchrun --numa-binding on GPUs) or numactl/taskset.")
    if under_torchrun() or pin is False or ranks_on_host == 1 or not hasattr(os, "sched_setaffinity"):
        return None
    cpus = usable_cpus()
    # Unasked, only where this job's ranks fill the cores: other jobs would be pinned to the same first
    # cores while the rest stay idle (a parallel sweep's, another user's). GPU runs' host threads: the OS's.
    if pin is None and (device != "cpu" or _concurrent_jobs() > 1 or len(cpus) // threads != ranks_on_host):
        return None
    if ranks_on_host * threads > len(cpus):  # asked for (unasked, the ranks fill the cores exactly)
        raise ConfigError(
            f"launch.pin_cpus=true: {ranks_on_host} ranks x {threads} threads (launch.threads_per_rank) need "
            f"{ranks_on_host * threads} cores, and this process may use {len(cpus)}. Fix: a smaller "
            "launch.threads_per_rank, or launch.pin_cpus=null to pin only where the threads fit.")
    return tuple(tuple(cpus[r * threads:(r + 1) * threads]) for r in range(ranks_on_host))


def check_host(cfg: DictConfig, device: str, ranks: int) -> None:
    """What depends on this host's GPUs and compilers (asks torch); ``device``: resolved."""
    import torch

    t = cfg.train
    if device == "cuda" and torch.cuda.device_count() < ranks:
        raise ConfigError(
            f"device=cuda needs one GPU per rank ({ranks}) but this host has "
            f"{torch.cuda.device_count()}. Fix: device=cpu, or fewer ranks."
        )
    if t.precision == "bf16" and device == "cuda" and not torch.cuda.is_bf16_supported():
        raise ConfigError("train.precision=bf16: this GPU has no bf16 support. Fix: train.precision=fp32.")
    if t.compile and device != "cuda" and not (os.environ.get("CXX") or shutil.which("g++") or shutil.which("clang++")):
        raise ConfigError("train.compile=true on CPU needs a C++ compiler for inductor, and none was found "
                          "(g++, clang++ or $CXX). Fix: install one, or train.compile=false.")


def passive_threads(environ: MutableMapping[str, str] = os.environ) -> bool:
    """``PASSIVE_THREADS`` in ``environ`` (this process's, which its ranks inherit) unless the user
    set how OpenMP threads wait; whether it did. Call it before torch is imported: OpenMP reads
    it as it loads (a forked rank inherits the loaded setting, a spawned one reads its environment)."""
    if any(key in environ for key in _WAIT_SETTINGS):
        return False
    environ.update(PASSIVE_THREADS)
    return True


def say_if_overloaded(say: Callable[[str], None]) -> bool:
    """Once per process: ``say`` that the host is overloaded (``overloaded``): every step will be
    slower than its numbers elsewhere. Whether it said so."""
    load = overloaded()
    if _overload_said[0] or load is None:
        return False
    _overload_said[0] = True
    say(f"this host is overloaded: load average {load:.1f} on {os.cpu_count()} cores (other work is waiting for "
        "them); steps will be slower than on an idle host (launch.threads_per_rank=1 may help where each rank "
        "has several threads).")
    return True
