"""The launcher's watch over the rank processes it spawned: the first failure or a stall ends the
whole job in bounded time, reported from its root cause; SIGINT/SIGTERM to the launcher stop every
rank. Once a training rank has been silent for ``launch.timeout_s``, the rank that stopped on its
own is named with its coordinates and last action (``runner.ranks.watchdog``: each rank notes its
progress and its waits for peers in memory shared with the launcher)."""

from __future__ import annotations

import logging
import pickle
import re
import signal
import threading
from contextlib import contextmanager
from multiprocessing import connection as mp_connection
from multiprocessing.connection import Connection
from typing import Any, Collection, Iterator, NoReturn

from runner.errors import EXIT_INTERRUPTED, RankFailedError, RunnerError, StalledRankError, interrupted_exit_code
from runner.ranks import watchdog
from runner.ranks.processes import stop

__all__ = ["rank_failure", "wait_for_ranks", "forward_signals"]

log = logging.getLogger("runner.launch")  # the launcher's lines, as before the split


# How gloo/nccl report that a peer went away: a symptom on the survivors, not the root cause.
_PEER_GONE = re.compile(
    r"Connection (closed|reset) by peer|remote worker crash|Broken pipe|NCCL communicator was aborted")
# How they report a collective that waited out its timeout: a symptom of a stalled peer.
_TIMED_OUT = re.compile(r"[Tt]imed out|[Tt]imeout")


def _read_trace(path: str) -> str | None:
    try:
        with open(path, "rb") as f:
            return pickle.load(f)
    except (OSError, EOFError, pickle.UnpicklingError):  # absent, or cut short by a full disk
        return None


def _exit_description(process) -> str:
    code = process.exitcode
    if code is not None and code < 0:
        return f"process terminated with signal {signal.Signals(-code).name}"
    return f"process exited with code {code} and no traceback"


def rank_failure(failed: list[int], processes: list, error_files: list[str], heartbeats: watchdog.Heartbeats,
                 stopped: Collection[int] = ()) -> RunnerError:
    """The root cause among the ``failed`` ranks (the first whose traceback is not a peer's
    disappearance): a runner error's message, or that rank's full traceback. A peer's collective
    timeout is reported as the stall of the rank it waited for (``stopped``: the ranks the system
    showed stopped before they were ended)."""
    traces = {}
    for rank, path in enumerate(error_files):
        trace = _read_trace(path) or heartbeats.error(rank)
        if trace:
            traces[rank] = trace
    root = next((r for r, t in traces.items() if not _PEER_GONE.search(t)), None)
    if root is None:  # killed by a signal or exited without a traceback; its peers saw it go
        root = next((r for r in failed if r not in traces), failed[0])
        if root not in traces:
            return RankFailedError(f"rank {root}: {_exit_description(processes[root])}")
    text = traces[root]
    if _TIMED_OUT.search(text):  # it waited for a peer: name the one that stopped on its own
        done = set(traces) | {r for r, p in enumerate(processes) if p.exitcode == 0}  # they did not stall
        beats = heartbeats.beats()
        named = watchdog.culprits(beats, stopped, cleared=done)  # busy or not: it did not answer
        if named:
            them = "it" if len(named) == 1 else "them"
            return StalledRankError(f"{watchdog.describe(named, beats, stopped)} Rank {root} timed out waiting for "
                                    f"{them}. {_STALL_FIX}")
    match = re.search(r"^runner\.errors\.\w+: (.*)", text, flags=re.S | re.M)
    if match:
        return RunnerError(f"rank {root}: {match.group(1).strip()}")
    return RankFailedError(f"rank {root} failed:\n{text.strip()}")


_STALL_FIX = ("Fix: see what that rank waits for (its log; py-spy dump --pid), or a larger launch.timeout_s "
              "if that phase legitimately takes longer.")


def _stopped_ranks(processes: list) -> set[int]:
    """The ranks the system shows stopped (SIGSTOP, Ctrl-Z's job control, a debugger): state T or
    t in ``/proc``. Such a rank makes no progress of its own, wherever its heartbeat stopped."""
    found = set()
    for rank, p in enumerate(processes):
        try:
            with open(f"/proc/{p.pid}/stat") as f:
                state = f.read().rpartition(")")[2].split()[0]  # the name, in parentheses, may hold spaces
        except (OSError, IndexError):  # exited, or no /proc (not Linux): not known stopped
            continue
        if state in ("T", "t"):
            found.add(rank)
    return found


def _end_if_stalled(processes: list, heartbeats: watchdog.Heartbeats, timeout_s: float, grace_s: float) -> None:
    beats = heartbeats.beats([r for r, p in enumerate(processes) if p.is_alive()])
    if not watchdog.silent(beats, timeout_s):
        return
    stopped = _stopped_ranks(processes)
    message = watchdog.describe(watchdog.culprits(beats, stopped), beats, stopped)
    log.error("%s Stopping the job.", message)
    stop(processes, grace_s)
    raise StalledRankError(f"{message} (launch.timeout_s={timeout_s:g}). {_STALL_FIX}")


def _receive(results: Connection) -> Any:
    try:
        return results.recv()
    except EOFError:  # rank 0 ended without sending (it failed: its exit code says so)
        return None


def wait_for_ranks(processes: list, error_files: list[str], heartbeats: watchdog.Heartbeats, timeout_s: float,
                   grace_s: float, results: Connection | None = None) -> Any:
    """Until every rank has exited; returns the one message a rank sent on ``results`` (rank 0's
    summary), read as it arrives: one larger than the pipe's buffer would keep its sender from
    exiting. The first failure stops the others at once (``stop``) and is raised, as is a stall.
    (torch's ``ProcessContext.join`` would first wait ``grace_s`` for the others to fail too: a
    rank stalled in Python never does.)"""
    received = None
    while True:
        failed = [r for r, p in enumerate(processes) if p.exitcode not in (None, 0)]
        if failed:
            stopped = _stopped_ranks(processes)  # before they are ended
            killed = stop(processes, grace_s)
            codes = {processes[r].exitcode for r in failed}
            if codes <= set(EXIT_INTERRUPTED.values()):  # a signal reached the ranks themselves
                log.warning("rank(s) %s stopped by SIGINT/SIGTERM", failed)  # (Ctrl-C: the whole process group)
                _end_interrupted(max(codes))
            raise rank_failure(_failed_on_their_own(processes, failed, killed), processes, error_files,
                               heartbeats, stopped)
        running = [p for p in processes if p.exitcode is None]
        if not running:
            return _receive(results) if results is not None and results.poll() else received
        _end_if_stalled(processes, heartbeats, timeout_s, grace_s)
        ready = mp_connection.wait([p.sentinel for p in running] + ([results] if results is not None else []),
                                   timeout=0.5)
        for p in running:
            if p.sentinel in ready:  # its pipes closed as it exits: wait the moment until its exit code shows
                p.join()
        if results is not None and results in ready:
            received, results = _receive(results), None


# How the launcher's own ``stop`` ends a rank that it did not kill: through Python, or by the
# signal itself where it came before the rank's handlers.
_STOP_SIGNALS = (-signal.SIGTERM, -signal.SIGINT)


def _failed_on_their_own(processes: list, failed: list[int], killed: Collection[int]) -> list[int]:
    """``failed`` (the ranks seen failed first), and any rank that then ended by a signal that
    ``stop`` did not send: a rank killed (SIGKILL, a segfault) can close its sockets, and so fail
    its peers, a moment before its exit code shows; it is still the root cause."""
    late = [r for r, p in enumerate(processes) if r not in failed and r not in killed
            and p.exitcode is not None and p.exitcode < 0 and p.exitcode not in _STOP_SIGNALS]
    return sorted([*failed, *late])


def _end_interrupted(code: int) -> NoReturn:
    """End the launch as Python's own handlers would: Ctrl-C (130) as ``KeyboardInterrupt``, so that
    ``runner.run`` called from Python (a notebook) raises, never exits (the command line turns it
    into status 130: ``runner.exits``); SIGTERM (143) as ``SystemExit``."""
    if code == EXIT_INTERRUPTED[signal.SIGINT]:
        raise KeyboardInterrupt
    raise SystemExit(code)


@contextmanager
def forward_signals(processes: list, grace_s: float) -> Iterator[None]:
    """SIGINT/SIGTERM to the launcher stop every rank (``stop``: a SIGTERM, which ranks handle
    even when they inherited an ignored SIGINT); the launcher then exits with 130 or 143. With
    no processes (a one-rank run in this process) the signal ends the run here the same way."""

    def handler(signum, frame):
        log.warning("%s: stopping the run (%d rank processes)", signal.Signals(signum).name, len(processes))
        stop(processes, grace_s)
        _end_interrupted(interrupted_exit_code(signum))

    if threading.current_thread() is not threading.main_thread():  # signals reach the main thread only
        yield
        return
    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
