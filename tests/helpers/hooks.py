"""A user's hook, as a config's ``callbacks`` names it (``runner.callbacks``): a factory that
returns a ``runner.hooks.Hook``, importable as ``helpers.hooks.step_recorder`` on every rank."""

from __future__ import annotations

from typing import Any

from runner.hooks import Hook, StepContext, StepState


class StepRecorder(Hook):
    """The steps it saw end, reported in rank 0's summary under ``key`` (with this rank's number)."""

    def __init__(self, key: str) -> None:
        self.key = key
        self.steps: list[int] = []
        self.rank = -1

    def after_step(self, ctx: StepContext, state: StepState) -> None:
        self.rank = ctx.env.rank
        self.steps.append(state.step)

    def summary(self) -> dict[str, Any]:
        return {self.key: {"rank": self.rank, "steps": self.steps}}


def step_recorder(key: str = "seen_steps") -> StepRecorder:
    return StepRecorder(key)


class LibraryWarning(Hook):
    """Warns on each rank's first step as a library does (``warnings.warn``): what the console
    leaves to ``runner.log``."""

    def after_step(self, ctx: StepContext, state: StepState) -> None:
        if state.first:
            import warnings

            warnings.warn(f"a library's UserWarning on rank {ctx.env.rank}", UserWarning, stacklevel=1)


class FailsAt(Hook):
    """A user's hook that fails: raises ``RuntimeError`` as step ``step`` ends, on every rank."""

    def __init__(self, step: int) -> None:
        self.step = step

    def after_step(self, ctx: StepContext, state: StepState) -> None:
        if state.step == self.step:
            raise RuntimeError(f"a user's hook failed at step {self.step}")


def fails_at(step: int = 2) -> FailsAt:
    return FailsAt(step)


class InterruptsAt(Hook):
    """Ctrl-C as step ``step`` ends: SIGINT to this process (a one-rank run's launcher and rank)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def after_step(self, ctx: StepContext, state: StepState) -> None:
        if state.step == self.step:
            import os
            import signal

            os.kill(os.getpid(), signal.SIGINT)


def interrupts_at(step: int = 2) -> InterruptsAt:
    return InterruptsAt(step)
