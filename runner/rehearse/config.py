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
    # Training steps per rehearsed rank. AdamW's state is made before the first (its own first step, on
    # zero gradients: no forward or backward), so every step is a steady one: memory is tracked over
    # all but the last, the last is timed (2 or more); one more, untimed, is profiled where
    # profile.enabled (the rank's chrome trace).
    steps: int = 2
    # Memory only: one tracked step per rank (a forward and backward of every microbatch, and the
    # optimizer's step), nothing timed or profiled, no composed step time; rehearse.steps is not used.
    # For shapes whose full step takes hours on this host (a 70B model on CPU).
    memory_only: bool = False
    # Times measured at this shorter sequence and scaled to train.seq_len (each stage's F/B/I/W action by
    # the ratio of its FLOPs at the two lengths, counted as the planner counts them); memory, held bytes
    # and collectives are still measured at train.seq_len, by one tracked step. null = times measured at
    # train.seq_len.
    time_seq_len: Optional[int] = None
    # With rehearse.time_seq_len: times also measured at this second, shorter sequence, and each stage
    # action's time at train.seq_len read off the line a + b * FLOPs through its times at the two (a: what
    # the action costs whatever the length, e.g. adding a vocabulary-sized weight's gradient), instead of
    # the FLOP ratio from rehearse.time_seq_len alone; e.g. train.seq_len/8 with time_seq_len train.seq_len/4
    # on CPU; on a GPU /4 with /2 (shorter actions there are bound by their launches: docs/rehearsal.md).
    # null = the FLOP ratio.
    time_fit_seq_len: Optional[int] = None
    # Each rank's memory is reported against this (bytes, or with a unit: 80GiB); null = the local
    # device's (a GPU's total memory), or no verdict on CPU.
    capacity: Optional[str] = None
