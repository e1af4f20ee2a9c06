"""The startup clock: when a job was launched and when each startup phase ended, carried from the
command line through the launcher into every rank (each rank a copy of its own), which add their
phases. The summary reports each phase's duration (``startup_phases_s``) and their sum up to the
end of setup (``startup_s``)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

__all__ = ["StartupClock"]

log = logging.getLogger("runner.startup")


@dataclass
class StartupClock:
    """Phases in the order they end: compose (the interpreter, Hydra, the checks that need no
    torch), imports, validate, spawn (rank processes up), process_group, build (stage modules,
    schedule), setup (optimizer, checkpoint, profiler, loggers), first_step. A phase that did not
    happen in this run (no spawn for one rank) is simply absent."""

    launched_at: float = field(default_factory=time.time)  # epoch seconds
    marks: dict[str, float] = field(default_factory=dict)  # phase -> epoch seconds it ended

    def mark(self, phase: str, at: float | None = None) -> None:
        self.marks[phase] = time.time() if at is None else at

    def say(self, what: str) -> None:
        """One line of the startup's progress, with the seconds since the launch: what a user
        watches while nothing else shows (``config checked``, ``data ready``, ``ranks started``,
        ``model built``, ``first step``)."""
        log.info("%s (%.1f s)", what, time.time() - self.launched_at)

    def since_launch(self, phase: str) -> float:
        return self.marks[phase] - self.launched_at

    def phases(self) -> dict[str, float]:
        """Each phase's duration: from the end of the one before (the first from the launch)."""
        ends = list(self.marks.values())
        return {name: end - start for name, start, end in zip(self.marks, [self.launched_at, *ends], ends)}
