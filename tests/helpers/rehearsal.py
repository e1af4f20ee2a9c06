"""What a real run's ranks hold, for the rehearsal's comparison (``runner.rehearse.memory``)."""

from __future__ import annotations

from typing import Any

from runner.hooks import Hook, StepContext, StepState
from runner.ranks.dist import gather_to_main
from runner.rehearse.memory import held_bytes


class HeldBytes(Hook):
    """Every rank's parameter, gradient and optimizer-state bytes after the last step, on rank 0
    (the summary's ``held_bytes``, by rank)."""

    def __init__(self) -> None:
        self.by_rank: list | None = None

    def after_step(self, ctx: StepContext, state: StepState) -> None:
        if state.step == ctx.resolved.steps:
            self.by_rank = gather_to_main(held_bytes(ctx.params, ctx.optimizer), ctx.env)

    def summary(self) -> dict[str, Any]:
        return {"held_bytes": self.by_rank} if self.by_rank is not None else {}


def held_bytes_hooks() -> list[Hook]:
    return [HeldBytes()]
