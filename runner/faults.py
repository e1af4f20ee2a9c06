"""Fault points, for the reliability tests: real failures at chosen places, switched on by the
``RUNNER_FAULT`` environment variable and inert otherwise.

``RUNNER_FAULT=<what>:<rank>:<step>`` with ``what`` one of ``raise`` (an exception), ``kill``
(SIGKILL), ``stall`` (sleep far past the collective timeout), ``nan`` (a non-finite loss) or
``nangrad`` (a finite loss with a non-finite gradient), on that rank at the start of that step
(numbered from 1, as in the logs and metrics.jsonl): a hook (``fault_hooks``) the trainer holds
only when such a fault is set.
``RUNNER_FAULT=checkpoint-commit-step-<N>`` kills rank 0 between the shard writes and the commit
of step N's checkpoint.
"""

from __future__ import annotations

import os
import signal
import time

from runner.hooks import Hook, StepState

__all__ = ["fault_point", "fault_hooks", "TrainFault"]


def fault_point(name: str, rank: int) -> None:
    if os.environ.get("RUNNER_FAULT") == name and rank == 0:
        os.kill(os.getpid(), signal.SIGKILL)


class TrainFault(Hook):
    """``what`` on ``rank`` at ``step``: raise, kill and stall as the step begins; nan and nangrad
    once its backward has run."""

    def __init__(self, what: str, rank: int, step: int):
        self.what, self.rank, self.step = what, rank, step

    def _due(self, trainer, state: StepState) -> bool:
        return (trainer.env.rank, state.step) == (self.rank, self.step)

    def begin_step(self, trainer, state: StepState) -> None:
        if not self._due(trainer, state):
            return
        if self.what == "raise":
            raise RuntimeError(f"injected fault on rank {self.rank} at step {self.step}")
        if self.what == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if self.what == "stall":
            time.sleep(3600)

    def after_backward(self, trainer, state: StepState) -> None:
        if not self._due(trainer, state):
            return
        if self.what == "nan" and state.local_loss is not None:
            state.local_loss = state.local_loss * float("nan")
        if self.what == "nangrad":  # a finite loss with a non-finite gradient
            next(p.grad for p in trainer.params if p.grad is not None).mul_(float("nan"))


def fault_hooks() -> list[Hook]:
    """The ``<what>:<rank>:<step>`` fault ``RUNNER_FAULT`` sets, if any."""
    spec = os.environ.get("RUNNER_FAULT", "").split(":")
    return [TrainFault(spec[0], int(spec[1]), int(spec[2]))] if len(spec) == 3 else []
