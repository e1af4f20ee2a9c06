"""What a step's reported time is: ``metrics.jsonl``'s ``step_time_s`` (and ``tokens_per_s`` from
it), and the median of them in ``summary.json``.

On CPU, the host's seconds from the step's start to its end. On CUDA, kernels run after their
launches return, and under ``train.optimizer_sync=deferred`` nothing waits for the device at a
step's end (its loss is validated during the next step), so the host's time of one step is its
launches', not its work's. There, each step records two CUDA events on the current stream (as it
begins, and after its update is launched), and its time is the device's between them: from where
the stream reached the step's start (after the previous step's work) to the end of its own work.
They are read without a synchronization of their own: once the end event has completed
(``ready``: a later step's wait for its loss, an evaluation, a checkpoint's copies have passed it),
or when the run is over (``wait``). Only the rank that writes the metrics records events.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable

import torch

__all__ = ["StepTimer"]


class StepTimer:
    """Each step's reported seconds, by step number. ``event``: makes a CUDA event (the tests' stand-in);
    by default ``torch.cuda.Event(enable_timing=True)`` on a CUDA ``device``, none on CPU."""

    def __init__(self, device: torch.device, *, event: Callable[[], Any] | None = None):
        if event is None and device.type == "cuda":
            event = partial(torch.cuda.Event, enable_timing=True)
        self._event = event
        self._open: dict[int, list[Any]] = {}  # step -> [start event, end event]: not read yet
        self._seconds: dict[int, float] = {}
        self.host: dict[int, float] = {}  # step -> the host's seconds of its call

    @property
    def on_device(self) -> bool:
        """Whether the times are the device's (CUDA events), not the host's."""
        return self._event is not None

    def begin(self, step: int) -> None:
        if self._event is not None:
            start = self._event()
            start.record()
            self._open[step] = [start]

    def end(self, step: int, host_s: float) -> None:
        """Step ``step`` ended after ``host_s`` seconds on the host (its update launched)."""
        self.host[step] = host_s
        if self._event is None:
            self._seconds[step] = host_s
            return
        end = self._event()
        end.record()
        self._open[step].append(end)

    def ready(self, step: int) -> bool:
        """Whether ``seconds(step)`` is known without waiting for the device."""
        return step in self._seconds or self._open[step][1].query()

    def seconds(self, step: int, *, wait: bool = False) -> float:
        """Step ``step``'s reported seconds; ``wait``: for the device where it has not finished the step
        (at the run's end only: otherwise ask ``ready`` first)."""
        if step not in self._seconds:
            start, end = self._open[step]
            if wait:
                end.synchronize()
            self._seconds[step] = start.elapsed_time(end) / 1e3  # milliseconds
            del self._open[step]
        return self._seconds[step]

    def all_seconds(self) -> list[float]:
        """Every ended step's seconds, in step order (waiting for the device: at the run's end)."""
        return [self.seconds(step, wait=True) for step in sorted(self.host)]
