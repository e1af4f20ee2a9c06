"""What ran: every compute action, timed at the stage itself.

The schedules differ in what they annotate (single-stage ones name microbatches, the runtime
ones wrap compute *and* the wait for its input in ``PP:`` ranges), and the declared
``pipeline_order`` is not always what executes. So the recorder wraps each ``PipelineStage``'s
forward, backward and weight-backward calls: whatever the schedule, each action becomes an
``Action`` with its own start and end, and a ``compute:<stage><F|B|I|W><microbatch>`` range in the
torch profiler trace. Outside the recorded window an action costs one flag check and two
heartbeats (``runner.ranks.watchdog``: what the rank is doing, for the launcher), at pp=1 too.

On CPU a span is the host's clock around the call. On CUDA the call returns before its kernels run:
there (given ``event``) each span is timed by CUDA events on the stream the call launches on, and
put on the host's clock later (``runner.pipeline.device_spans``: exact durations, starts placed from
an anchor recorded after the step's own wait for the device, ``anchor``), with no wait of its own;
the host's readings stay in ``call_ns``. A rehearsal (``wait_for_device``) waits for the device
around each span instead, and reads the host's clock.
"""

from __future__ import annotations

import functools
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, TypeVar

from torch.profiler import record_function

from runner.pipeline.device_spans import DeviceSpans
from runner.pipeline.ops import Op
from runner.ranks.watchdog import beat

__all__ = ["Action", "StepSpan", "Recorder"]


class _Called:
    start_ns: int
    end_ns: int
    call_ns: tuple[int, int] | None

    @property
    def host_ns(self) -> tuple[int, int]:
        """The host's readings around the call: on CUDA its launches (``call_ns``), else the span itself."""
        return self.call_ns or (self.start_ns, self.end_ns)


@dataclass(frozen=True)
class Action(_Called):
    step: int
    op: Op  # stage, kind (F, B, I or W) and microbatch
    start_ns: int  # time.perf_counter_ns(): the host's monotonic clock, the same in every process
    end_ns: int  # (on CUDA: when the stream reached the action's start and end events, on that clock)
    call_ns: tuple[int, int] | None = None  # CUDA: the host's readings around the call; None: the same


@dataclass(frozen=True)
class StepSpan(_Called):
    step: int
    start_ns: int
    end_ns: int
    call_ns: tuple[int, int] | None = None


Span = TypeVar("Span", Action, StepSpan)


class Recorder:
    """Records this rank's actions and pipeline-step spans while ``active``, on the host's
    monotonic clock (``time.perf_counter_ns``: CLOCK_MONOTONIC on Linux), which every rank of a
    host reads alike. No per-rank origin: one taken as a barrier releases differs between ranks
    by the barrier's own skew, and turned messages backwards in time. ``event`` (CUDA: makes a
    timing event, ``torch.cuda.Event(enable_timing=True)``): the spans are the device's, read lazily
    (``actions`` and ``steps`` grow as the device passes them; ``settle`` reads the rest)."""

    def __init__(self, event: Callable[[], Any] | None = None, *, now: Callable[[], int] = time.perf_counter_ns):
        self.active = False
        self.step = -1
        self.actions: list[Action] = []
        self.steps: list[StepSpan] = []
        # Steps after which the run did something else before its next step (an evaluation, a
        # checkpoint's save): the gap is no training step's (``runner.outputs.timeline.steady_bubble``).
        self.interrupted: set[int] = set()
        self._now = now
        self.device: DeviceSpans[Action | StepSpan] | None = DeviceSpans(event, now) if event is not None else None
        # Called before a span's start and end are read (an action's, a pipeline step's), while active
        # and without device events: a rehearsal waits for the device there (``wait_for_device``, set
        # by ``runner.rehearse.rank``), so that a CUDA span's time is its kernels', not their launch
        # (kernels run after their calls return). None: the host's clock as it is.
        self.synchronize: Callable[[], None] | None = None

    def wait_for_device(self, synchronize: Callable[[], None]) -> None:
        """A rehearsal: ``synchronize`` waits for the device before each span's start and end are
        read on the host's clock (no events: the host's times are then the device's)."""
        self.synchronize, self.device = synchronize, None

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
            with self._span(functools.partial(Action, self.step, Op(stage, kind, microbatch)), self.actions):
                yield

    @contextmanager
    def _span(self, make: Callable[[int, int, tuple[int, int] | None], Span], out: list[Span]) -> Iterator[None]:
        """What runs inside, timed: by the device's events where there are (read later, into ``out``
        by ``_read``), else on the host's clock (after a rehearsal's wait for the device)."""
        if self.device is not None:
            span = self.device.begin(self.step, make)
            try:
                yield
            except BaseException:
                self.device.drop(span)  # no action to report, and its event let go
                raise
            self.device.end(span)
            return
        if self.synchronize is not None:
            self.synchronize()
        start = self._now()
        yield
        if self.synchronize is not None:
            self.synchronize()
        out.append(make(start, self._now(), None))

    def anchor(self) -> None:
        """A wait for the device just returned (the step's loss read on the host): the spans ended
        so far are placed on the host's clock from here (``runner.pipeline.device_spans``), and those
        the device has passed are read. Nothing without device events (CPU, rehearsals)."""
        if self.device is not None:
            self.device.anchor()
            self._read(self.device.resolve())

    def settle(self) -> None:
        """Every span read, waiting for the device where it has not passed them (at the end of the
        recorded window: never on the hot path). Nothing without device events."""
        if self.device is not None:
            self._read(self.device.settle())

    def _read(self, spans: list[Action | StepSpan]) -> None:
        for span in spans:
            if isinstance(span, Action):
                self.actions.append(span)
            else:
                self.steps.append(span)

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
        if not self.active:
            yield
            return
        with self._span(functools.partial(StepSpan, step), self.steps):
            yield

    def interrupt(self, step: int) -> None:
        """Something else than training runs after step ``step``, before the next one (``interrupted``)."""
        self.interrupted.add(step)

    def discard(self, step: int) -> None:
        """Forget what step ``step`` recorded: a pass whose results were thrown away
        (``train.optimizer_sync=deferred`` runs a step again after the previous one's rollback)."""
        self.actions = [a for a in self.actions if a.step != step]
        self.steps = [s for s in self.steps if s.step != step]
        if self.device is not None:
            self.device.discard(step)

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
