"""Ranks that someone else started: torchrun's variables, or one SLURM task per rank.

Inside a submitit job (``hydra/launcher=runner_slurm``) the ranks come from submitit's own
``TorchDistributedEnvironment`` (its node-list parsing, its port per job); under a plain ``srun``
the rendezvous host is the first of ``scontrol show hostnames``. SLURM's node-list syntax
(``node[001-004]-ib``, ``gpu[03-05,09],cpu1``) is never parsed here. Imports no torch."""

from __future__ import annotations

import os
import re
import subprocess
from typing import Mapping

from runner.errors import ConfigError

__all__ = ["under_torchrun", "slurm_rank_env", "adopt_slurm_ranks"]


def under_torchrun() -> bool:
    """Ranks were started by someone else: torchrun, or SLURM tasks adopted by ``adopt_slurm_ranks``."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _one_task_per_rank(environ: Mapping[str, str]) -> bool:
    """A SLURM job step with several tasks, whose ranks torch's own variables do not set yet."""
    return "RANK" not in environ and int(environ.get("SLURM_NTASKS", "1")) > 1 and "SLURM_PROCID" in environ


def _tasks_on_this_node(environ: Mapping[str, str]) -> str:
    """``SLURM_TASKS_PER_NODE`` (``2(x3),1``: 2 tasks on each of 3 nodes, then 1) at this node."""
    counts: list[int] = []
    tasks = environ.get("SLURM_TASKS_PER_NODE", environ["SLURM_NTASKS"])
    for group in tasks.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", group.strip())
        if match is None:
            raise ConfigError(f"SLURM_TASKS_PER_NODE={tasks!r}: cannot read {group!r} (SLURM writes counts such as "
                              "'2(x3),1'). Fix: set torch's rank variables (RANK, WORLD_SIZE, LOCAL_RANK, "
                              "LOCAL_WORLD_SIZE) yourself, or start the ranks with torchrun.")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return str(counts[min(int(environ.get("SLURM_NODEID", "0")), len(counts) - 1)])


def _first_host(nodelist: str) -> str:
    """The first host of a SLURM node list, as SLURM itself expands it."""
    try:
        done = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True,
                              timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        done = None
        reason = str(e)
    if done is None or done.returncode != 0 or not done.stdout.split():
        reason = reason if done is None else (done.stderr.strip() or "no host names")
        raise ConfigError(f"SLURM_JOB_NODELIST={nodelist!r}: `scontrol show hostnames` failed ({reason}), so the "
                          "rendezvous host is unknown. Fix: run inside a SLURM allocation, or set MASTER_ADDR.")
    return done.stdout.split()[0]


def slurm_rank_env(environ: Mapping[str, str]) -> dict[str, str]:
    """torch's rank variables for a plain ``srun`` job step with one task per rank; empty when
    this is not one, or torch's are set already."""
    if not _one_task_per_rank(environ):
        return {}
    return {
        "RANK": environ["SLURM_PROCID"],
        "WORLD_SIZE": environ["SLURM_NTASKS"],
        "LOCAL_RANK": environ.get("SLURM_LOCALID", "0"),
        "LOCAL_WORLD_SIZE": _tasks_on_this_node(environ),
        "MASTER_ADDR": environ.get("MASTER_ADDR") or _first_host(environ["SLURM_JOB_NODELIST"]),
        # One port per job: steps of different jobs may share the first node.
        "MASTER_PORT": environ.get("MASTER_PORT") or str(20000 + int(environ.get("SLURM_JOB_ID", "0")) % 20000),
    }


def adopt_slurm_ranks() -> None:
    """Set torch's rank variables from SLURM's, once per process (a no-op outside SLURM)."""
    if not _one_task_per_rank(os.environ):
        return
    if os.environ.get("SUBMITIT_EXECUTOR") == "slurm":  # a submitit job: its own environment
        from submitit.helpers import TorchDistributedEnvironment

        # Not its CUDA_VISIBLE_DEVICES rewrite: the runner picks each rank's GPU by LOCAL_RANK.
        TorchDistributedEnvironment().export(set_cuda_visible_devices=False)
        return
    os.environ.update(slurm_rank_env(os.environ))
