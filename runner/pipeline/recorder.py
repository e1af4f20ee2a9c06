"""What ran: every compute action, timed at the stage itself.

The schedules differ in what they annotate (single-stage ones name microbatches, the runtime
ones wrap compute *and* the wait for its input in ``PP:`` ranges), and the declared
``pipeline_order`` is not always what executes. So the recorder wraps each ``PipelineStage``'s
forward, backward and weight-backward calls: whatever the schedule, each action becomes an
``Action`` with its own start and end, and a ``compute:<stage><F|B|I|W><microbatch>`` range in the
torch profiler trace. Outside the recorded window an action costs one flag check and two
heartbeats (``runner.ranks.watchdog``: what the rank is doing, for the launcher), at pp=1 too.
"""

from __future__ import annotations

import functools
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

from torch.profiler import record_function

from runner.pipeline.ops import Op
from runner.ranks.watchdog import beat

__all__ = ["Action", "StepSpan", "Recorder"]


@dataclass(frozen=True)
class Action:
    step: int
    op: Op  # stage, kind (F, B, I or W) and microbatch
    start_ns: int  # time.perf_counter_ns(): the host's monotonic clock, the same in every process
    end_ns: int


@dataclass(frozen=True)
class StepSpan:
    step: int
    start_ns: int
    end_ns: int


class Recorder:
    """Records this rank's actions and pipeline-step spans while ``active``, on the host's
    monotonic clock (``time.perf_counter_ns``: CLOCK_MONOTONIC on Linux), which every rank of a
    host reads alike. No per-rank origin: one taken as a barrier releases differs between ranks
    by the barrier's own skew, and turned messages backwards in time."""

    def __init__(self):
        self.active = False
        self.step = -1
        self.actions: list[Action] = []
        self.steps: list[StepSpan] = []
        # Called before an action's start and end are read, while active: a rehearsal waits for the
        # device there (``runner.rehearse.rank``), so that a CUDA action's time is its kernels', not
        # their launch (kernels run after their calls return). None: the host's clock as it is.
        self.synchronize: Callable[[], None] | None = None

    @staticmethod
    def _now() -> int:
        return time.perf_counter_ns()

    @contextmanager
    def action(self, stage: int, kind: str, microbatch: int) -> Iterator[None]:
        """One compute action: a heartbeat as it starts and as it ends (the launcher's watchdog names
        a stalled rank's last action), and its time while ``active``."""
        name = f"stage {stage} action {stage}{kind}{microbatch} of step {self.step}"
        beat(f"running {name}")
        with self._timed(stage, kind, microbatch):
            yield
        beat(f"finished {name}")

    @contextmanager
    def _timed(self, stage: int, kind: str, microbatch: int) -> Iterator[None]:
        if not self.active:
            yield
            return
        with record_function(f"compute:{stage}{kind}{microbatch}"):
            if self.synchronize is not None:
                self.synchronize()
            start = self._now()
            yield
            if self.synchronize is not None:
                self.synchronize()
            end = self._now()
        self.actions.append(Action(self.step, Op(stage, kind, microbatch), start, end))

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Calls made meanwhile (evaluation's forwards) are not part of the recorded schedule."""
        active, self.active = self.active, False
        try:
            yield
        finally:
            self.active = active

    @contextmanager
    def pipeline_step(self, step: int) -> Iterator[None]:
        self.step = step
        start = self._now()
        yield
        if self.active:
            self.steps.append(StepSpan(step, start, self._now()))

    def discard(self, step: int) -> None:
        """Forget what step ``step`` recorded: a pass whose results were thrown away
        (``train.optimizer_sync=deferred`` runs a step again after the previous one's rollback)."""
        self.actions = [a for a in self.actions if a.step != step]
        self.steps = [s for s in self.steps if s.step != step]

    def wrap_stage(self, stage) -> None:
        """Time a ``PipelineStage``'s compute calls (its methods are replaced on the instance)."""
        index = stage.stage_index

        def timed(method, kind_of):
            @functools.wraps(method)
            def call(chunk_id, *args, **kwargs):
                kind = kind_of(kwargs)
                try:
                    with self.action(index, kind, chunk_id):
                        return method(chunk_id, *args, **kwargs)
                except Exception as e:  # say where in the pipeline it happened
                    e.add_note(f"runner: in pipeline stage {index}, action {index}{kind}{chunk_id}")
                    raise

            return call

        stage.forward_one_chunk = timed(stage.forward_one_chunk, lambda kw: "F")
        stage.backward_one_chunk = timed(
            stage.backward_one_chunk, lambda kw: "B" if kw.get("full_backward", True) else "I"
        )
        stage.backward_weight_one_chunk = timed(stage.backward_weight_one_chunk, lambda kw: "W")
