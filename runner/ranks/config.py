"""The ``launch.*`` keys (schema ``LaunchConfig``): how the ranks start, their threads and CPUs, the
rendezvous, timeouts. Imports nothing heavy."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from runner.options import StartMethod, choices

__all__ = ["LaunchConfig"]


@dataclass
class LaunchConfig:
    # Seconds without progress before the job is declared stuck (> 0): the gloo/nccl collective
    # timeout, and a spawned rank silent this long while training ends the job, named.
    timeout_s: float = 300.0
    # Intra-op threads per rank; null = this host's cores divided among the ranks it runs.
    threads_per_rank: Optional[int] = None
    # Pin each rank's threads to cores of its own (consecutive blocks of the cores this process
    # may use: `taskset -c` chooses which), so ranks neither share a core nor migrate (on a
    # 2-core host, models with actions of a few ms stepped 8-18% faster and steadier; with
    # 30-250 ms actions, no difference beyond run-to-run noise). null = pin CPU runs whose ranks
    # fill those cores (one job at a time); true = pin, or a config error if the threads do not
    # fit; false = leave placement to the OS. Ranks torchrun or SLURM started are theirs to place.
    pin_cpus: Optional[bool] = None
    # Rendezvous: null = a file in the run directory (no port, no collisions); N = a TCP store on
    # 127.0.0.1:N hosted by the launcher (bound to loopback only).
    port: Optional[int] = None
    # After SIGINT/SIGTERM, a stall or a failed rank: how long ranks get to exit before SIGKILL (>= 0).
    grace_s: float = 10.0
    # Restart the whole job when a rank fails (an error, a kill, a stall past timeout_s), up to this
    # many times, each from the run's newest complete checkpoint (from its start if it saved none),
    # in the same run directory; 0 = a failed rank ends the job. Under torchrun: its --max-restarts.
    max_restarts: int = 0
    # How rank processes start: fork (children inherit the launcher's imports: startup in
    # milliseconds instead of seconds), spawn (fresh interpreters), or auto: fork for CPU runs
    # on Linux, spawn where fork is unsafe (CUDA, macOS, OpenMP threads: runner.ranks.processes).
    start_method: str = field(default="auto", metadata=choices(StartMethod))
