"""Fault points, for the reliability tests: real failures at chosen places, switched on by the
``RUNNER_FAULT`` environment variable and inert otherwise.

``RUNNER_FAULT=<what>:<rank>:<step>`` with ``what`` one of ``raise`` (an exception), ``kill``
(SIGKILL), ``stall`` (sleep far past the collective timeout), ``nan`` (a non-finite loss) or
``nangrad`` (a finite loss with a non-finite gradient), on that rank at the start of that step
(numbered from 1, as in the logs and metrics.jsonl).
``RUNNER_FAULT=checkpoint-commit-step-<N>`` kills rank 0 between the shard writes and the commit
of step N's checkpoint.
"""

from __future__ import annotations

import functools
import os
import signal
import time

__all__ = ["fault_point", "train_fault"]


def fault_point(name: str, rank: int) -> None:
    if os.environ.get("RUNNER_FAULT") == name and rank == 0:
        os.kill(os.getpid(), signal.SIGKILL)


@functools.cache
def _train_fault_spec() -> tuple[str, int, int] | None:
    spec = os.environ.get("RUNNER_FAULT", "").split(":")
    return (spec[0], int(spec[1]), int(spec[2])) if len(spec) == 3 else None


def train_fault(step: int, rank: int) -> str | None:
    """Act on a ``<what>:<rank>:<step>`` fault due here; returns ``"nan"`` or ``"nangrad"`` for the
    loop to apply."""
    spec = _train_fault_spec()
    if spec is None or spec[1:] != (rank, step):
        return None
    what = spec[0]
    if what == "raise":
        raise RuntimeError(f"injected fault on rank {rank} at step {step}")
    if what == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if what == "stall":
        time.sleep(3600)
    return what
