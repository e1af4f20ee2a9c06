"""Spans timed by CUDA events on the stream that runs them, put on the host's clock once the device
has passed them, with no wait for the device of their own.

A CUDA call returns before its kernels run, so the host's clock around a call reads its launches.
Here each span records an event as it begins and one as it ends (on the current stream: where the
call's kernels go), and the host's clock (``time.perf_counter_ns``) is read just before each is
recorded. Events give exact durations between them (``elapsed_time``: the device's timer, to about
0.5 us), but no host time; that comes from two facts:

* causality: the device reaches an event no sooner than the host recorded it, so for every event
  ``e`` of a group, the host time of the group's first event is at least ``host(e) - elapsed(first, e)``;
* the anchor: an event recorded right after a wait that drained the stream (the step's loss
  all-reduce read by ``.tolist()``: ``runner.train``) is reached within a launch's latency (a few
  microseconds) of its host time, so its bound is the true one less that latency.

A group (the spans ended since the previous anchor, and the anchor) is placed by the largest of
these bounds: never earlier than any of its events was launched, and, where the anchor's stream
was drained, early by at most the anchor's launch latency (plus the drift between the device's
timer and the host's clock over the group: parts per million). Where the stream was not drained
at the anchor (work queued on it by another thread; a span's kernels on another stream than the
one the wait drained; a GPU shared by other processes delaying the anchor), the starts come out
early by up to what was still queued, but never before their own launch; the durations are exact
either way.

A group is read once its anchor and its spans' ends have completed (``resolve``: asked after each
anchor, so usually one step later), in the order the anchors were recorded; its events are then
dropped (freed). ``settle`` drains the stream and reads everything: at the end of the recorded
window, never on the hot path.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Generic, TypeVar

__all__ = ["DeviceSpans"]

T = TypeVar("T")

# What a span becomes: from its start and end on the host's clock, and the host's readings around its call.
Make = Callable[[int, int, tuple[int, int]], T]


@dataclass
class _Open(Generic[T]):
    step: int
    make: Make[T]
    start: Any  # the event recorded as the span began
    called: tuple[int, int]  # the host's clock read just before each event was recorded (ns)
    end: Any = None  # None: not ended yet


@dataclass
class _Group(Generic[T]):
    spans: list[_Open[T]]
    anchor: Any
    anchor_ns: int  # the host's clock read just before the anchor was recorded


class DeviceSpans(Generic[T]):
    """Spans timed on the device. ``event``: makes a timing event (``torch.cuda.Event(enable_timing=True)``,
    or the tests' stand-in: ``record()``, ``query()``, ``synchronize()``, ``elapsed_time(other)`` in ms);
    ``now``: the host's clock in ns."""

    def __init__(self, event: Callable[[], Any], now: Callable[[], int] = time.perf_counter_ns):
        self._event = event
        self._now = now
        self._open: list[_Open[T]] = []  # begun since the last anchor (or not ended by it)
        self._anchored: list[_Group[T]] = []  # closed by an anchor, not read yet

    def _record(self) -> tuple[Any, int]:
        host = self._now()  # before the record: the device cannot reach the event sooner
        event = self._event()
        event.record()
        return event, host

    @property
    def pending(self) -> int:
        """How many spans are recorded and not read yet (their events held)."""
        return len(self._open) + sum(len(g.spans) for g in self._anchored)

    def begin(self, step: int, make: Make[T]) -> _Open[T]:
        event, host = self._record()
        span = _Open(step, make, event, (host, host))
        self._open.append(span)
        return span

    def end(self, span: _Open[T]) -> None:
        span.end, host = self._record()
        span.called = (span.called[0], host)

    def drop(self, span: _Open[T]) -> None:
        """Forget a span begun and not ended (what ran inside it raised)."""
        self._open.remove(span)

    def anchor(self) -> None:
        """The stream was just drained (a wait for the device returned): the spans ended so far are
        placed from an event recorded now. Nothing where no span ended since the last anchor."""
        ended = [s for s in self._open if s.end is not None]
        if not ended:
            return
        self._open = [s for s in self._open if s.end is None]
        event, host = self._record()
        self._anchored.append(_Group(ended, event, host))

    def resolve(self, *, wait: bool = False) -> list[T]:
        """The groups the device has passed, in anchor order, stopping at the first it has not
        (``wait``: waiting for each instead), as the spans they hold; their events are let go."""
        out: list[T] = []
        while self._anchored:
            group = self._anchored[0]
            if wait:
                group.anchor.synchronize()
                for span in group.spans:
                    span.end.synchronize()
            elif not (group.anchor.query() and all(span.end.query() for span in group.spans)):
                break
            self._anchored.pop(0)
            out += _place(group)
        return out

    def settle(self) -> list[T]:
        """Every span read, waiting for the device: the spans ended since the last anchor are
        anchored after a wait for the stream (so the anchor's stream is drained)."""
        if any(s.end is not None for s in self._open):
            drain, _ = self._record()
            drain.synchronize()
            self.anchor()
        return self.resolve(wait=True)

    def discard(self, step: int) -> None:
        """Forget step ``step``'s spans not read yet."""
        self._open = [s for s in self._open if s.step != step]
        for group in self._anchored:
            group.spans = [s for s in group.spans if s.step != step]
        self._anchored = [g for g in self._anchored if g.spans]


def _place(group: _Group[T]) -> list[T]:
    """The group's spans on the host's clock: the device's times after the group's first event,
    moved by the largest lower bound its events give (see the module's docstring)."""
    first = group.spans[0].start  # the earliest event of the group: spans begin in order

    def after(event: Any) -> float:  # ns after ``first``, by the device's timer
        return 0.0 if event is first else first.elapsed_time(event) * 1e6

    times = [(after(s.start), after(s.end)) for s in group.spans]
    bounds = [host - at for s, ats in zip(group.spans, times) for host, at in zip(s.called, ats)]
    offset = max(group.anchor_ns - after(group.anchor), *bounds)
    return [s.make(round(offset + start), round(offset + end), s.called) for s, (start, end) in zip(group.spans, times)]
