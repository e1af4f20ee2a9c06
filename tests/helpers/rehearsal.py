"""What a real run's ranks hold, for the rehearsal's comparison (``runner.rehearse.memory``), and
their peak measured as a rehearsal measures it (torch's ``MemTracker``, ``peak_tracker``)."""

from __future__ import annotations

from typing import Any

from runner._torch.rehearsal import peak_split, peak_tracker
from runner.hooks import Hook, StepContext, StepState
from runner.ranks.dist import gather_to_main
from runner.rehearse.memory import held_bytes

# The cases whose ranks' peaks are tracked (the tracker's dispatch mode slows every op: only the
# case a rehearsal is compared with), by run directory name.
TRACKED_CASES = frozenset({"llama-1f1b", "builtin-pp4-dp2-fsdp"})


class HeldBytes(Hook):
    """Every rank's parameter, gradient and optimizer-state bytes after the last step, on rank 0
    (the summary's ``held_bytes``, by rank); in ``TRACKED_CASES`` also each rank's peak over the
    step before the last (``tracked_peak_bytes``, by rank): a steady step, after verify's reference steps,
    with the optimizer state made."""

    def __init__(self) -> None:
        self.by_rank: list | None = None
        self.peaks: list | None = None
        self._tracker: Any = None

    def _tracked(self, ctx: StepContext, state: StepState) -> bool:
        run_dir = ctx.resolved.run_dir
        return run_dir is not None and run_dir.name in TRACKED_CASES and state.step == ctx.resolved.steps - 1

    def begin_step(self, ctx: StepContext, state: StepState) -> None:
        if self._tracked(ctx, state):
            self._tracker = peak_tracker(ctx.modules, ctx.optimizer)
            self._tracker.__enter__()

    def after_step(self, ctx: StepContext, state: StepState) -> None:
        if self._tracker is not None and self._tracked(ctx, state):
            self._tracker.__exit__(None, None, None)
            peaks, self._tracker = peak_split(self._tracker), None  # it holds the modules: let them go
            self.peaks = gather_to_main(peaks, ctx.env)
        if state.step == ctx.resolved.steps:
            self.by_rank = gather_to_main(held_bytes(ctx.params, ctx.optimizer), ctx.env)

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {"held_bytes": self.by_rank} if self.by_rank is not None else {}
        if self.peaks is not None:
            out["tracked_peak_bytes"] = self.peaks
        return out


def held_bytes_hooks() -> list[Hook]:
    return [HeldBytes()]
