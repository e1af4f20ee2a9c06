"""A stand-in for one CUDA stream and its timing events, on a host clock of its own (ns): a call
returns at once, its kernels run later, each in turn, starting no sooner than ``LATENCY`` after their
launch; an event is reached as the stream passes it. What the tests of the recorder's device times
assert against: each action's time on this device is known exactly, its launch's is not it."""

from __future__ import annotations

import weakref

LATENCY = 2_000  # ns from a launch (or an event's record) to the device's earliest start of it


class FakeStream:
    def __init__(self, host_ns: int = 1_000_000_000) -> None:
        self.host = host_ns  # the host's clock
        self.free_at = 0  # when the stream has run everything queued so far (host's clock)
        self.recorded = 0  # events recorded
        self.alive: weakref.WeakSet[FakeEvent] = weakref.WeakSet()  # those still held by someone
        self.waits = 0  # the host's waits for the device (an event's synchronize, ``drain``)

    def now(self) -> int:
        """The host's clock, a nanosecond later at each reading (reading it takes time)."""
        self.host += 1
        return self.host

    def host_work(self, ns: int) -> None:
        self.host += ns

    def launch(self, host_ns: int, device_ns: int) -> None:
        """A call: ``host_ns`` on the host, then kernels of ``device_ns`` queued on the stream."""
        self.host += host_ns
        self.free_at = max(self.free_at, self.host + LATENCY) + device_ns

    def drain(self) -> None:
        """The host waits for the stream (a CUDA ``.tolist()``'s synchronization)."""
        self.waits += 1
        self.host = max(self.host, self.free_at)

    def event(self) -> FakeEvent:
        return FakeEvent(self)


class FakeEvent:
    """``torch.cuda.Event(enable_timing=True)``'s methods the runner calls."""

    def __init__(self, stream: FakeStream) -> None:
        self.stream = stream
        self.at: int | None = None  # when the stream reaches it (host's clock)

    def record(self) -> None:
        s = self.stream
        s.free_at = self.at = max(s.free_at, s.host + LATENCY)
        s.recorded += 1
        s.alive.add(self)

    def query(self) -> bool:
        assert self.at is not None
        return self.at <= self.stream.host

    def synchronize(self) -> None:
        assert self.at is not None
        self.stream.waits += 1
        self.stream.host = max(self.stream.host, self.at)

    def elapsed_time(self, end: FakeEvent) -> float:
        assert self.query() and end.query(), "cudaErrorNotReady: an event not completed yet"
        assert self.at is not None and end.at is not None
        return (end.at - self.at) / 1e6  # milliseconds, as CUDA's
