"""Restarts: which attempt of a job this process belongs to, and, for torchrun's restarts, the run
directory of the job's first attempt.

``launch.max_restarts`` restarts spawned ranks from the launcher (``runner.launch``), which tells
each rank its attempt in ``RUNNER_RESTART_COUNT``; torchrun (``--max-restarts``) restarts its
workers itself and says so in ``TORCHELASTIC_RESTART_COUNT``. A restarted torchrun worker composes
its config again, and rank 0 would get a new timestamped run directory: the first attempt's rank 0
leaves its run directory in torchrun's agent store, which outlives the workers, and the restarted
rank 0 runs in it again (``first_run_dir``, read by the command line before Hydra picks the
directory)."""

from __future__ import annotations

import datetime
import logging
import os
from pathlib import Path

__all__ = ["RESTART_VARIABLE", "restart_count", "attempt_store", "publish_run_dir", "first_run_dir"]

log = logging.getLogger("runner.launch")

RESTART_VARIABLE = "RUNNER_RESTART_COUNT"  # set in each spawned rank: 0, then 1, 2, ... on restarts
_KEY = "runner/run_dir"  # in torchrun's agent store: the run directory of the job's first attempt


def restart_count() -> int:
    """This process's attempt: 0 for the first, N after N restarts (the launcher's or torchrun's)."""
    value = os.environ.get(RESTART_VARIABLE) or os.environ.get("TORCHELASTIC_RESTART_COUNT") or "0"
    return int(value)


def _agent_store(timeout_s: float = 60.0):
    """A client of torchrun's agent store (it lives as long as the torchrun job, across restarts), or
    None where the workers do not share it (``TORCHELASTIC_USE_AGENT_STORE``)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    import torch.distributed as dist

    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                         timeout=datetime.timedelta(seconds=timeout_s))


def attempt_store(timeout_s: float):
    """On a restarted torchrun worker: the agent store under a prefix of this attempt, for the process
    group, or None (the first attempt, or no agent store: torch's own ``env://``). torch 2.13's workers
    use the agent store as it is, where the previous attempt's keys remain: a rank of the new attempt
    that reads a gloo address its peer published in the last one connects to a dead process and fails
    (seen whenever rank 1 started first)."""
    if "TORCHELASTIC_RESTART_COUNT" not in os.environ or restart_count() == 0:
        return None
    store = _agent_store(timeout_s)
    if store is None:
        return None
    import torch.distributed as dist

    return dist.PrefixStore(f"runner/attempt-{restart_count()}", store)


def publish_run_dir(run_dir: Path) -> None:
    """On a torchrun job's rank 0: its run directory, for the ranks 0 of later attempts. The first
    attempt's stays."""
    store = _agent_store()
    if store is not None and not store.check([_KEY]):
        store.set(_KEY, str(run_dir))


def first_run_dir() -> str | None:
    """On a restarted torchrun worker: the run directory its job's first attempt ran in, or None
    (not restarted, no agent store, or the first attempt never got that far)."""
    if "TORCHELASTIC_RESTART_COUNT" not in os.environ or restart_count() == 0:
        return None
    store = _agent_store()
    if store is None:
        log.warning("torchrun restart %d: torchrun's agent store is not shared with the workers, so the first "
                    "attempt's run directory is unknown and this attempt starts over in a new one. Fix: "
                    "hydra.run.dir=<a fixed directory> (every attempt then runs, and resumes, there).",
                    restart_count())
        return None
    return store.get(_KEY).decode() if store.check([_KEY]) else None
