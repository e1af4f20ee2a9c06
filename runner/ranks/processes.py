"""Rank processes on this host: ``spawn(world, fn, ...)`` starts them, lets them meet, and calls
``fn(env, ...)`` in each inside the process group. Runs (``runner.launch``), the planner's
calibration and the tests start their ranks with it, so every one of them gets what a run gets:

* a rendezvous that opens no port (a ``FileStore`` in a directory), or a TCP store the launcher
  hosts on 127.0.0.1 only (``port``);
* gloo bound to loopback, and the runner's collective timeout;
* ranks that die with their launcher, however it dies (a parent-death signal), and end through
  Python on SIGINT/SIGTERM;
* fork where it is safe (``start_method``), spawn elsewhere.
* ranks that, once done, end their process groups' threads before their interpreter exits
  (``runner.ranks.dist.cleanup``: a gloo thread that outlives it may abort the rank at exit);
  forked ranks, which end through ``os._exit`` without that exit, only leave their groups.
"""

from __future__ import annotations

import ctypes
import datetime
import faulthandler
import gc
import logging
import os
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from runner.errors import ConfigError, interrupted_exit_code
from runner.ranks import watchdog
from runner.ranks.clock import StartupClock
from runner.ranks.dist import cleanup, init_distributed, pick_device

__all__ = ["note_threads", "stop_progress_monitors", "forked_ranks_would_hang", "start_method", "spawn_reason",
           "Rendezvous", "rendezvous", "connect", "spawn", "Ranks", "stop", "raise_if_stopped"]

log = logging.getLogger("runner.processes")  # named as before runner/ became packages (runner.log)


# GNU OpenMP (torch's CPU threads) keeps its worker team across a fork, without the workers: a
# forked child of a process that ever ran a parallel region waits forever in its own first one.
# Every rank with more than one thread hung in its first layer norm on a 16-core host. A launcher
# that may have run torch on several threads therefore spawns ranks that would run on several.
_ran_threaded = [False]


def note_threads() -> None:
    """Remember whether torch may run (or have run) on several threads in this process: call it
    whenever this process's setting may have been above one before it computes on one."""
    _ran_threaded[0] = _ran_threaded[0] or torch.get_num_threads() > 1


def spawn_reason(device: str, threads: int | None = 1) -> str:
    """Why ranks cannot be forked from this process ("" where they can): CUDA state and macOS
    frameworks do not survive a fork, nor does a lock another thread holds (it would stay held in
    the child: joblib's loky workers, for one, run helper threads; tqdm's monitor is stopped where
    the runner's libraries start it: ``stop_progress_monitors``), nor OpenMP's team for ranks of
    ``threads`` threads (None: torch's default, this host's cores) where this process ran torch on
    several."""
    if device != "cpu":
        return f"device {device}: its state does not survive a fork"
    if not sys.platform.startswith("linux"):
        return f"{sys.platform}: only Linux forks safely"
    others = [t.name for t in threading.enumerate() if t is not threading.current_thread()]
    if others:
        return f"threads run in the launcher ({', '.join(others)}): a fork would copy the locks they hold"
    if forked_ranks_would_hang(threads):
        return ("this process ran torch on several threads: OpenMP's thread team does not survive a fork "
                "(ranks of several threads would hang in their first op)")
    return ""


def stop_progress_monitors() -> None:
    """End tqdm's monitor thread, which outlives the progress bars that start it (``datasets``',
    torch.compile's, transformers'): a launcher with a thread running starts its ranks by spawn,
    seconds slower than fork (``spawn_reason``). tqdm starts it again with its next bar."""
    monitor: type = getattr(sys.modules.get("tqdm.std"), "TMonitor", type(None))
    for thread in threading.enumerate():
        if isinstance(thread, monitor):
            thread.exit()  # type: ignore[attr-defined]  # wakes it and joins it


def forked_ranks_would_hang(threads: int | None) -> bool:
    """Ranks of ``threads`` threads (None: torch's default, this host's cores) forked from this
    process would wait forever in their first parallel region: it ran torch on several threads."""
    note_threads()
    return _ran_threaded[0] and (threads is None or threads > 1)


def start_method(requested: str, device: str, threads: int | None = 1) -> str:
    """``requested``, or for ``auto`` fork where it is safe (``spawn_reason``), spawn elsewhere."""
    if requested != "auto":
        return requested
    return "spawn" if spawn_reason(device, threads) else "fork"


# -- meeting: a file, or a TCP store on loopback ----------------------------------------------

@dataclass(frozen=True)
class Rendezvous:
    kind: str  # "file" or "tcp"
    address: str  # the store file, or the port on 127.0.0.1


def _loopback_listener(port: int) -> int:
    """A socket listening on 127.0.0.1:``port`` only, handed to torch's TCP store (which, given a
    port alone, listens on every interface). Returns its descriptor; the store owns it from then."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as torch's own: a port in TIME_WAIT
        sock.bind(("127.0.0.1", port))
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    return sock.detach()


def rendezvous(directory: Path, port: int | None, timeout_s: float) -> tuple[Rendezvous, dist.Store | None]:
    """Where the ranks meet, and the launcher's own store if it hosts one (it lives as long as the
    launcher holds it). ``port`` None: a new file in ``directory``, no listening socket."""
    if port is None:
        return Rendezvous("file", str(directory / f".rendezvous-{uuid.uuid4().hex}")), None
    try:
        fd = _loopback_listener(port)
        server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                               timeout=datetime.timedelta(seconds=timeout_s), master_listen_fd=fd, use_libuv=True)
    except (RuntimeError, OSError) as e:
        raise ConfigError(f"launch.port={port} cannot be used ({e}); it is probably taken. "
                          "Fix: another launch.port, or launch.port=null (the default opens no port).") from e
    return Rendezvous("tcp", str(port)), server


def connect(where: Rendezvous, world: int, timeout_s: float) -> dist.Store:
    """A rank's end of ``rendezvous``."""
    if where.kind == "file":
        return dist.FileStore(where.address, world)
    return dist.TCPStore("127.0.0.1", int(where.address), is_master=False,
                         timeout=datetime.timedelta(seconds=timeout_s))


# -- a rank's life ----------------------------------------------------------------------------

def _die_with_launcher(launcher_pid: int) -> None:
    """SIGKILL this rank when the launcher dies, however it dies. (torch sets a parent-death
    SIGINT, which a launcher started with SIGINT ignored, as ``cmd &`` in a script is, passes on
    to its ranks ignored.) The signal follows the thread that started this process, not the
    process: the launcher starts its ranks from the thread that then waits for them."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # 1 = PR_SET_PDEATHSIG
    else:  # no parent-death signal: watch for the launcher's death instead
        def watch() -> None:
            while os.getppid() == launcher_pid:
                time.sleep(1.0)
            os.kill(os.getpid(), signal.SIGKILL)

        threading.Thread(target=watch, daemon=True, name="launcher-watch").start()
    if os.getppid() != launcher_pid:  # the launcher died before the signal was set
        os.kill(os.getpid(), signal.SIGKILL)


_stop_signals: list[int] = []  # a stop signal that arrived while an exception was being handled


def _stop_on_signals() -> None:
    """SIGINT and SIGTERM end this rank through Python (its loggers mark the run failed),
    whatever SIGINT disposition it inherited. Inside an ``except`` (a rank already ending with an
    error, closing its loggers; or any library handling an exception of its own) raising would
    replace the exception being handled: the signal is kept for ``raise_if_stopped``, which the
    training loop calls between steps; a rank that is ending is killed after the grace."""

    def stop(signum, frame):
        if sys.exc_info()[0] is None:
            raise SystemExit(interrupted_exit_code(signum))
        _stop_signals.append(signum)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, stop)


def raise_if_stopped() -> None:
    """End this rank now if a stop signal arrived at a moment it could not (see ``_stop_on_signals``)."""
    if _stop_signals:
        raise SystemExit(interrupted_exit_code(_stop_signals[0]))


@dataclass(frozen=True)
class _RankSetup:
    """What every rank of one ``spawn`` starts from (pickled once per rank under spawn)."""

    world: int
    where: Rendezvous
    device: str
    timeout_s: float
    threads: int | None
    cpus: Sequence[Sequence[int]] | None  # each rank's cores (None: not pinned)
    launcher_pid: int
    prelude: Callable[[int], None] | None
    clock: StartupClock | None
    forked: bool  # the ranks leave through os._exit (multiprocessing's fork), without the interpreter's exit


def _pin_cpus(cpus: Iterable[int]) -> str:
    """Run this process, and the threads it starts from now on, on these cores only; returns the
    cores it now runs on, as a line for the log."""
    os.sched_setaffinity(0, set(cpus))
    return "on cores " + ",".join(map(str, sorted(os.sched_getaffinity(0))))


def _rank_main(rank: int, setup: _RankSetup, fn: Callable[..., None], args: tuple) -> None:
    """Entry of each spawned rank process: join the process group, run ``fn``, leave it."""
    _die_with_launcher(setup.launcher_pid)
    # Before any thread starts (threads inherit it); logged once the rank's logging is set up.
    pinned = _pin_cpus(setup.cpus[rank]) if setup.cpus else None
    _stop_on_signals()
    # A rank that dies in native code (an abort in a library, a segfault) shows every thread's
    # Python stack on its stderr, not only the launcher's "terminated with signal".
    faulthandler.enable(all_threads=True)
    if setup.prelude is not None:
        setup.prelude(rank)
    if pinned:
        log.info(pinned)
    if setup.clock is not None:
        setup.clock.mark("spawn")  # fork: milliseconds; spawn: a fresh interpreter and imports
    if setup.threads:
        torch.set_num_threads(setup.threads)
    done = False
    try:
        env = init_distributed(rank=rank, world_size=setup.world, device=pick_device(setup.device, local_rank=rank),
                               timeout_s=setup.timeout_s, store=connect(setup.where, setup.world, setup.timeout_s))
        if setup.clock is not None:
            setup.clock.mark("process_group")
            setup.clock.say(f"ranks started: {setup.world} processes")
            fn(env, *args, clock=setup.clock)
        else:
            fn(env, *args)
        done = True
    except Exception:
        # Also in memory (a supervised run's heartbeats): torch's error file cannot be written
        # when the disk is full.
        watchdog.leave_error(traceback.format_exc())
        raise
    finally:
        # Done: every group's threads end here, before the interpreter's exit (see ``cleanup``). A
        # forked rank has no such exit (os._exit ends it, threads and all): it only leaves its
        # groups, without ``cleanup``'s heap scan and collection (0.3 CPU-s a rank).
        cleanup(end_threads=done and not setup.forked)
        # Nothing this process still holds is garbage worth a collection: the interpreter's exit
        # (spawned ranks') would otherwise scan the whole heap of torch's modules once more.
        gc.freeze()


class Ranks:
    """The rank processes of one ``spawn``: ``processes`` and torch's per-rank ``error_files`` for
    a supervisor (``runner.ranks.supervise``), or ``join()``. Closing it (the end of its ``with``
    block) removes the rendezvous."""

    def __init__(self, context: Any, where: Rendezvous, server: dist.Store | None, own_dir: Any):
        self._context = context
        self._where = where
        self._server = server  # the TCP store, if the launcher hosts one: closes with its last reference
        self._own_dir = own_dir  # a temporary directory spawn made for the store file

    @property
    def processes(self) -> list:
        return self._context.processes

    @property
    def error_files(self) -> list[str]:
        return self._context.error_files

    def join(self) -> None:
        """Wait for every rank. A rank's failure is raised (torch's ``ProcessRaisedException`` with
        its traceback, or ``ProcessExitedException``) and the others are stopped."""
        while not self._context.join():
            pass

    def close(self) -> None:
        self._server = None
        if self._where.kind == "file":
            Path(self._where.address).unlink(missing_ok=True)
        if self._own_dir is not None:
            self._own_dir.cleanup()
            self._own_dir = None

    def __enter__(self) -> Ranks:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def spawn(world: int, fn: Callable[..., None], *args: Any, device: str = "cpu", timeout_s: float = 300.0,
          directory: Path | None = None, port: int | None = None, method: str = "auto", threads: int | None = None,
          cpus: Sequence[Sequence[int]] | None = None, prelude: Callable[[int], None] | None = None,
          clock: StartupClock | None = None) -> Ranks:
    """Start ``world`` rank processes that call ``fn(env, *args)`` (``env``: a ``DistEnv``) inside
    the process group, on ``device`` (``cpu``: gloo; ``cuda``: NCCL, a GPU per rank). They meet
    in a store file in ``directory`` (a temporary one if None) or, with ``port``, at a TCP store
    on 127.0.0.1 hosted here. ``method``: fork, spawn or auto (``start_method``); ``threads``:
    intra-op threads per rank; ``cpus[rank]``: the cores a rank is pinned to (None: not pinned);
    ``prelude(rank)`` runs first in each rank (its logging, its heartbeats); ``clock`` gets each
    rank's ``spawn`` and ``process_group`` marks and is passed on as ``fn(env, *args,
    clock=clock)``. Returns at once: ``with spawn(...) as ranks: ranks.join()``."""
    if mp.get_start_method(allow_none=True) not in (None, "spawn", "fork", "forkserver"):
        # Inside a joblib (loky) worker: spawned children would re-apply "loky" and fail.
        mp.set_start_method("spawn", force=True)
    own_dir = None
    if directory is None:
        own_dir = tempfile.TemporaryDirectory(prefix="runner-rendezvous-")
        directory = Path(own_dir.name)
    where, server = rendezvous(directory, port, timeout_s)
    method = start_method(method, device, threads)
    setup = _RankSetup(world, where, device, timeout_s, threads, cpus, os.getpid(), prelude, clock, method == "fork")
    try:
        context = mp.start_processes(_rank_main, args=(setup, fn, args), nprocs=world, join=False,
                                     start_method=method)
    except BaseException:
        Ranks(None, where, server, own_dir).close()
        raise
    return Ranks(context, where, server, own_dir)


def stop(processes: list, grace_s: float) -> set[int]:
    """SIGTERM to every live rank (each ends through Python); SIGKILL to those still alive after
    ``grace_s`` (a rank inside a C++ collective runs no Python until it returns). Returns the
    ranks it killed so: any other rank's end by a signal was not this stop's."""
    for p in processes:
        if p.is_alive():
            try:
                os.kill(p.pid, signal.SIGTERM)
                os.kill(p.pid, signal.SIGCONT)  # a stopped rank (SIGSTOP) handles it only once continued
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + grace_s
    for p in processes:
        p.join(max(0.0, deadline - time.monotonic()))
    killed = set()
    for rank, p in enumerate(processes):
        if p.is_alive():
            p.kill()
            p.join()
            killed.add(rank)
    return killed

