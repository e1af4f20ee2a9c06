"""The ``rehearse`` config group's schema (``rehearse=on`` selects
``conf/rehearse/on.yaml``; Hydra reads ``rehearse=true`` as a boolean, not an option name).
Imports nothing heavy: every command line composes the config."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

__all__ = ["RehearseConfig"]


@dataclass
class RehearseConfig:
    # Rehearse the run instead of running it: each rehearsed rank alone, in a process of its own,
    # its peers answered by a rehearsal process group (docs/rehearsal.md).
    enabled: bool = False
    # The global ranks to rehearse; null = one per pipeline rank (dp=0, tp=0): tp shards and dp
    # replicas are assumed to do what their rank 0 does (said so in the output).
    ranks: Optional[List[int]] = None
    # Training steps per rehearsed rank: memory is tracked over all but the last (the first creates the
    # optimizer state, so 3 or more for its peak), the last is timed; one more step, untimed, is profiled.
    steps: int = 3
    # Each rank's memory is reported against this (bytes, or with a unit: 80GiB); null = the local
    # device's (a GPU's total memory), or no verdict on CPU.
    capacity: Optional[str] = None
