"""Heartbeats: what each spawned rank last did, and when, in memory shared with the launcher.

A rank notes each pipeline action (from the stage wrappers of ``runner.pipeline.recorder``) and each step of
its loop with ``beat``: a write into shared memory, no system call. The launcher reads the table
while it waits for the ranks: a training rank with no progress for ``launch.timeout_s`` is stalled,
and the job ends naming it and its last action; when a peer's collective times out first, the
table names the rank it waited for. Phases that may legitimately run long without a beat (startup,
a checkpoint's I/O, the final profile) are noted with ``busy``: they are not judged (their
collectives still time out). A rank that fails also leaves its error here, for when it cannot
write torch's error file (a full disk).
"""

from __future__ import annotations

import ctypes
import time

__all__ = ["Heartbeats", "attach", "beat", "busy", "leave_error"]

_TEXT = 160  # bytes of "what it is doing" per rank
_ERROR = 8192  # bytes of error text per rank


def _put(array, slot: int, size: int, text: str) -> None:
    data = text.encode(errors="replace")[:size - 1] + b"\0"
    ctypes.memmove(ctypes.addressof(array) + slot * size, data, len(data))  # ~1 us: a slice assignment costs 15


def _get(array, slot: int, size: int) -> str:
    return ctypes.string_at(ctypes.addressof(array) + slot * size, size).split(b"\0", 1)[0].decode(errors="replace")


class Heartbeats:
    """The table: per rank, the time (``time.monotonic``, the same clock in every process of a
    Linux host) of its last beat, what it was doing, whether that is a phase not judged, and its
    error if it failed. Created by the launcher from the start method's context and passed to the
    ranks as they start."""

    def __init__(self, ctx, world: int):
        self.world = world
        self._times = ctx.RawArray(ctypes.c_double, world)
        self._busy = ctx.RawArray(ctypes.c_bool, world)
        self._texts = ctx.RawArray(ctypes.c_char, world * _TEXT)
        self._errors = ctx.RawArray(ctypes.c_char, world * _ERROR)
        for rank in range(world):
            self.set(rank, "starting", busy=True)

    def set(self, rank: int, what: str, *, busy: bool = False) -> None:
        _put(self._texts, rank, _TEXT, what)
        self._busy[rank] = busy
        self._times[rank] = time.monotonic()

    def set_error(self, rank: int, text: str) -> None:
        tail = text.encode(errors="replace")[-(_ERROR - 1):]  # a traceback's last lines matter most
        _put(self._errors, rank, _ERROR, tail.decode(errors="ignore"))

    def error(self, rank: int) -> str:
        return _get(self._errors, rank, _ERROR)

    def age(self, rank: int) -> float:
        return time.monotonic() - self._times[rank]

    def last(self, rank: int) -> str:
        return _get(self._texts, rank, _TEXT)

    def stalled(self, ranks: list[int], timeout_s: float) -> int | None:
        """Among ``ranks`` (those still running), the one silent the longest, if for over
        ``timeout_s``. A stalled rank stops first; its peers go on until they wait for it, so
        their last beats are later. While any rank is busy, its peers may be waiting for it:
        nobody is judged (their collectives still time out)."""
        if not ranks or any(self._busy[r] for r in ranks):
            return None
        oldest = max(ranks, key=self.age)
        return oldest if self.age(oldest) > timeout_s else None

    def describe(self, stalled: int, ranks: list[int]) -> str:
        others = "; ".join(f"rank {r}: {self.last(r)}, {self.age(r):.1f} s ago" for r in ranks if r != stalled)
        return (f"rank {stalled} stalled: no progress for {self.age(stalled):.1f} s; its last action: "
                f"{self.last(stalled)}." + (f" The others' last actions: {others}." if others else ""))


_mine: tuple[Heartbeats, int] | None = None  # this process's table and rank, if it is a spawned rank


def attach(heartbeats: Heartbeats | None, rank: int) -> None:
    global _mine
    _mine = None if heartbeats is None else (heartbeats, rank)


def beat(what: str) -> None:
    """Note progress (``what`` this rank is doing now); nothing outside a spawned rank."""
    if _mine is not None:
        _mine[0].set(_mine[1], what)


def busy(what: str) -> None:
    """Note a phase that may run long without beats (I/O, a summary): not judged until the next
    ``beat``."""
    if _mine is not None:
        _mine[0].set(_mine[1], what, busy=True)


def leave_error(text: str) -> None:
    if _mine is not None:
        _mine[0].set_error(_mine[1], text)
