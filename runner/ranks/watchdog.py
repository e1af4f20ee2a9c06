"""Heartbeats: what each spawned rank last did, and when, in memory shared with the launcher.

A rank notes each pipeline action (from ``runner.pipeline.recorder``) and each step of its loop with
``beat``, and each wait for its peers outside an action (the schedule's messages, the step's
collectives) with ``waiting``: a write into shared memory, no system call. The launcher reads the
table while it waits for the ranks: once a training rank has made no progress for
``launch.timeout_s``, the job ends naming the rank that stopped on its own (``culprits``), its
coordinates and its last action; when a peer's collective times out first, the table names the
rank it waited for. Phases that may legitimately run long without a beat (startup, a checkpoint's
I/O, the final profile) are noted with ``busy``: they are not judged (their collectives still time
out). A rank that fails also leaves its error here, for when it cannot write torch's error file (a
full disk).

Telling the stalled rank from those waiting for it: the last beat's time cannot (tensor-parallel
peers block within microseconds of each other), so the table counts each rank's beats and marks.
Ranks holding the same stages (one pipeline rank's tp and dp peers) run the same actions and the
same waits in the same order, so their counts compare: a rank ahead of such a peer is waiting for
it. Every beat therefore happens on all of those ranks alike, never on some of them only.
"""

from __future__ import annotations

import ctypes
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Collection, Iterator, Sequence

if TYPE_CHECKING:  # the ranks' coordinates come from the launcher: the watchdog stays a leaf module
    from runner.parallel.dims import Coords

__all__ = ["Beat", "Heartbeats", "attach", "beat", "busy", "waiting", "leave_error", "silent", "culprits",
           "describe"]

_TEXT = 160  # bytes of "what it is doing" per rank
_WAIT = 64  # bytes of "what it waits for" per rank
_ERROR = 8192  # bytes of error text per rank


def _put(array, slot: int, size: int, text: str) -> None:
    data = text.encode(errors="replace")[:size - 1] + b"\0"
    ctypes.memmove(ctypes.addressof(array) + slot * size, data, len(data))  # ~1 us: a slice assignment costs 15


def _get(array, slot: int, size: int) -> str:
    return ctypes.string_at(ctypes.addressof(array) + slot * size, size).split(b"\0", 1)[0].decode(errors="replace")


@dataclass(frozen=True)
class Beat:
    """One rank's row of the table, read at one moment."""

    rank: int
    coords: Coords
    what: str  # its last beat: what it did last
    waiting: str  # what it waits for, inside a ``waiting`` mark; "" outside one
    age_s: float  # seconds since its last beat or mark
    count: int  # its beats and marks so far (see the module's docstring)
    busy: bool  # a phase not judged


class Heartbeats:
    """The table: per rank, the time (``time.monotonic``, the same clock in every process of a
    Linux host) of its last beat, what it was doing, what it waits for, how many beats and marks
    it made, whether its phase is one not judged, and its error if it failed. Created by the
    launcher from the start method's context and each rank's coordinates (``ParallelDims.coords``),
    and passed to the ranks as they start."""

    def __init__(self, ctx, coords: Sequence[Coords]):
        self.coords = list(coords)
        self.world = len(self.coords)
        self._times = ctx.RawArray(ctypes.c_double, self.world)
        self._counts = ctx.RawArray(ctypes.c_longlong, self.world)
        self._busy = ctx.RawArray(ctypes.c_bool, self.world)
        self._texts = ctx.RawArray(ctypes.c_char, self.world * _TEXT)
        self._waits = ctx.RawArray(ctypes.c_char, self.world * _WAIT)
        self._errors = ctx.RawArray(ctypes.c_char, self.world * _ERROR)
        for rank in range(self.world):
            self.set(rank, "starting", busy=True)

    def _progress(self, rank: int) -> None:
        self._counts[rank] += 1  # only the rank itself writes its row
        self._times[rank] = time.monotonic()

    def set(self, rank: int, what: str, *, busy: bool = False) -> None:
        _put(self._texts, rank, _TEXT, what)
        _put(self._waits, rank, _WAIT, "")
        self._busy[rank] = busy
        self._progress(rank)

    def set_waiting(self, rank: int, what: str) -> None:
        """``what`` the rank now waits for; "" as the wait ends."""
        _put(self._waits, rank, _WAIT, what)
        self._progress(rank)

    def set_error(self, rank: int, text: str) -> None:
        tail = text.encode(errors="replace")[-(_ERROR - 1):]  # a traceback's last lines matter most
        _put(self._errors, rank, _ERROR, tail.decode(errors="ignore"))

    def error(self, rank: int) -> str:
        return _get(self._errors, rank, _ERROR)

    def beats(self, ranks: Sequence[int] | None = None) -> list[Beat]:
        """The rows of ``ranks`` (default: all), their ages taken at one moment."""
        now = time.monotonic()
        return [Beat(r, self.coords[r], _get(self._texts, r, _TEXT), _get(self._waits, r, _WAIT),
                     now - self._times[r], self._counts[r], self._busy[r])
                for r in (range(self.world) if ranks is None else ranks)]


# -- the launcher's judgement, over rows read from the table ----------------------------------

def silent(beats: Sequence[Beat], timeout_s: float) -> bool:
    """Whether ``beats`` (the ranks still running) are to be judged stalled: one has been silent
    for over ``timeout_s`` and none is busy (its peers may be waiting for it; their collectives
    still time out)."""
    return bool(beats) and not any(b.busy for b in beats) and max(b.age_s for b in beats) > timeout_s


def culprits(beats: Sequence[Beat], stopped: Collection[int] = (), cleared: Collection[int] = ()) -> list[int]:
    """The ranks among ``beats`` that stopped making progress on their own, read from where each
    one stopped. ``stopped``: ranks the system shows stopped (SIGSTOP, a debugger): those, when
    any. Otherwise a rank is waiting for a peer, and not named, when it stopped
    - inside a ``waiting`` mark (a message from a pipeline neighbour, a collective of the step), or
    - ahead of a rank holding the same stages (more beats): every tp or dp collective inside an
      action waits for all of them, so it waits for that peer, directly or through another.
    What remains is the rank the others wait for; or, when several stopped in the same action (one
    stalled inside it, its peers then wait in that action's collectives), every one of them: the
    beats cannot tell them apart, and naming one would be a guess. When every rank waits, all are
    named. ``cleared``: ranks known not to be stalled (they raised); compared with, never named."""
    if frozen := sorted(set(stopped) & {b.rank for b in beats}):
        return frozen
    fewest: dict[int, int] = {}  # per pipeline rank, the fewest beats among the ranks holding its stages
    for b in beats:
        fewest[b.coords.pp] = min(b.count, fewest.get(b.coords.pp, b.count))
    found = [b.rank for b in beats if not b.waiting and b.rank not in cleared and b.count == fewest[b.coords.pp]]
    return found or [b.rank for b in beats if b.rank not in cleared]


def _coords(b: Beat) -> str:
    return ", ".join(f"{dim} {i}" for dim, i in b.coords.asdict().items())


def _row(b: Beat) -> str:
    waits = f", then waiting for {b.waiting}" if b.waiting else ""
    return f"rank {b.rank} ({_coords(b)}): {b.what}{waits}, {b.age_s:.1f} s ago"


def describe(named: list[int], beats: Sequence[Beat], stopped: Collection[int] = ()) -> str:
    """The message for the ``named`` ranks (``culprits``), with the other ranks' last actions."""
    rows = {b.rank: b for b in beats}
    if len(named) == 1:
        b = rows[named[0]]
        how = "; the system shows it stopped (SIGSTOP, a debugger)" if b.rank in stopped else ""
        head = (f"rank {b.rank} stalled: no progress for {b.age_s:.1f} s; its last action: {b.what}; "
                f"its coordinates: {_coords(b)}{how}.")
    else:
        head = (f"ranks {', '.join(map(str, named))} stalled, and the heartbeats cannot tell which of them stopped "
                f"on its own and which wait for it: " + "; ".join(_row(rows[r]) for r in named) + ".")
    others = "; ".join(_row(b) for b in beats if b.rank not in named)
    return head + (f" The others' last actions: {others}." if others else "")


# -- a rank's side ----------------------------------------------------------------------------

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


@contextmanager
def waiting(what: str) -> Iterator[None]:
    """Mark a wait for peers outside an action (``what``: a message, a collective): a rank
    blocked in it is never the one named stalled. Every rank holding the same stages makes the
    same marks (they count as beats)."""
    if _mine is None:
        yield
        return
    table, rank = _mine
    table.set_waiting(rank, what)
    yield
    table.set_waiting(rank, "")  # not after an error (a timeout): the row keeps what it waited for


def leave_error(text: str) -> None:
    if _mine is not None:
        _mine[0].set_error(_mine[1], text)
