"""Launching ranks: spawn ``pp * dp`` processes on this host, or join the ranks ``torchrun``
started, or (one rank) train right here. Ranks rendezvous through a ``FileStore`` in the run
directory: no listening socket, so two runs started together cannot collide on a port.

Spawned ranks die with the launcher, however it dies (a parent-death signal), stop on the SIGTERM
it forwards for SIGINT or SIGTERM, and report progress to it (``runner.watchdog``): a rank silent
for ``launch.timeout_s`` ends the job, named with its last action."""

from __future__ import annotations

import ctypes
import datetime
import json
import logging
import os
import pickle
import re
import signal
import socket
import sys
import threading
import time
import traceback
import uuid
from contextlib import contextmanager, nullcontext
from multiprocessing import connection as mp_connection
from pathlib import Path
from typing import Iterator

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from runner import watchdog
from runner.checkpoint import checkpoint_step, find_checkpoint, hold_run_lock
from runner.console import console_for_run, console_listener, rank_logging, torchrun_rank_log
from runner.dist import cleanup, init_distributed, local_rank_from_env, pick_device, resolve_device
from runner.errors import (
    EXIT_INTERRUPTED,
    CheckpointError,
    ConfigError,
    RankFailedError,
    RunnerError,
    StalledRankError,
    interrupted_exit_code,
)
from runner.rank_env import adopt_slurm_ranks, under_torchrun
from runner.train import train
from runner.validate import Layout, validate

__all__ = ["launch"]

log = logging.getLogger(__name__)


def _concurrent_jobs() -> int:
    """Jobs a Hydra launcher runs at once on this host (joblib's n_jobs; -1 = one per core)."""
    n_jobs = HydraConfig.get().launcher.get("n_jobs") if HydraConfig.initialized() else None
    if not n_jobs:
        return 1
    return n_jobs if n_jobs > 0 else os.cpu_count() or 1


def _threads_per_rank(cfg: DictConfig, ranks_on_host: int) -> int:
    """Ranks on one host, of every job running at once, share its cores: oversubscribed
    intra-op threads slow every rank down."""
    return cfg.launch.threads_per_rank or max(1, (os.cpu_count() or 1) // (ranks_on_host * _concurrent_jobs()))


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


def _rendezvous(cfg: DictConfig, run_dir: Path) -> tuple[str, str, dist.Store | None]:
    """(kind, address, the launcher's own store if it hosts one). Checked before spawning."""
    if cfg.launch.port is None:
        return "file", str(run_dir / f".rendezvous-{uuid.uuid4().hex}"), None
    try:
        fd = _loopback_listener(cfg.launch.port)
        server = dist.TCPStore("127.0.0.1", cfg.launch.port, is_master=True, wait_for_workers=False,
                               timeout=datetime.timedelta(seconds=cfg.launch.timeout_s), master_listen_fd=fd,
                               use_libuv=True)
    except (RuntimeError, OSError) as e:
        raise ConfigError(f"launch.port={cfg.launch.port} cannot be used ({e}); it is probably taken. "
                          "Fix: another launch.port, or launch.port=null (the default opens no port).") from e
    return "tcp", str(cfg.launch.port), server


def _connect(kind: str, address: str, world: int, timeout_s: float) -> dist.Store:
    if kind == "file":
        return dist.FileStore(address, world)
    return dist.TCPStore("127.0.0.1", int(address), is_master=False,
                         timeout=datetime.timedelta(seconds=timeout_s))


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


def _stop_on_signals() -> None:
    """SIGINT and SIGTERM end this rank through Python (its loggers mark the run failed),
    whatever SIGINT disposition it inherited. A rank already ending with an error (inside an
    ``except``: closing its loggers) is left to finish; the launcher kills it after the grace."""

    def stop(signum, frame):
        if sys.exc_info()[0] is None:
            raise SystemExit(interrupted_exit_code(signum))

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, stop)


def _spawned_rank(rank: int, world: int, cfg_dict: dict, layout: Layout, run_dir: str,
                  rendezvous: tuple[str, str], launch_time: float, marks: dict[str, float], console_queue,
                  heartbeats: watchdog.Heartbeats, launcher_pid: int) -> None:
    """Entry of each spawned rank process."""
    _die_with_launcher(launcher_pid)
    _stop_on_signals()
    watchdog.attach(heartbeats, rank)
    marks = {**marks, "spawn": time.time()}  # fork: milliseconds; spawn: a fresh interpreter and imports
    cfg = OmegaConf.create(cfg_dict)
    run_dir_path = Path(run_dir)
    rank_logging(rank, run_dir_path, console_queue)
    torch.set_num_threads(cfg.launch.threads_per_rank)
    try:
        device = pick_device(cfg.device, local_rank=rank)
        env = init_distributed(rank=rank, world_size=world, device=device, timeout_s=cfg.launch.timeout_s,
                               store=_connect(*rendezvous, world, cfg.launch.timeout_s))
        marks["process_group"] = time.time()
        train(cfg, layout, env, run_dir_path, launch_time=launch_time, startup_marks=marks)
    except Exception:
        # Also in memory: torch's error file cannot be written when the disk is full.
        watchdog.leave_error(traceback.format_exc())
        raise
    finally:
        cleanup()


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


def _rank_failure(failed: list[int], processes: list, error_files: list[str],
                  heartbeats: watchdog.Heartbeats) -> RunnerError:
    """The root cause among the ``failed`` ranks (the first whose traceback is not a peer's
    disappearance): a runner error's message, or that rank's full traceback. A peer's collective
    timeout is reported as the stall of the rank it waited for."""
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
    if _TIMED_OUT.search(text):  # it waited for a peer: the peer that went silent first stalled
        others = [r for r in range(heartbeats.world) if r not in traces and processes[r].exitcode != 0]
        stalled = max(others, key=heartbeats.age, default=None)  # busy or not: it did not answer
        if stalled is not None:
            return StalledRankError(f"{heartbeats.describe(stalled, list(range(heartbeats.world)))} Rank {root} "
                                    f"timed out waiting for it. {_STALL_FIX}")
    match = re.search(r"^runner\.errors\.\w+: (.*)", text, flags=re.S | re.M)
    if match:
        return RunnerError(f"rank {root}: {match.group(1).strip()}")
    return RankFailedError(f"rank {root} failed:\n{text.strip()}")


_STALL_FIX = ("Fix: see what that rank waits for (its log; py-spy dump --pid), or a larger launch.timeout_s "
              "if that phase legitimately takes longer.")


def _stop(processes: list, grace_s: float) -> None:
    """SIGTERM to every live rank (each ends through Python); SIGKILL to those still alive after
    ``grace_s`` (a rank inside a C++ collective runs no Python until it returns)."""
    for p in processes:
        if p.is_alive():
            try:
                os.kill(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + grace_s
    for p in processes:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in processes:
        if p.is_alive():
            p.kill()
            p.join()


def _end_if_stalled(processes: list, heartbeats: watchdog.Heartbeats, timeout_s: float, grace_s: float) -> None:
    running = [r for r, p in enumerate(processes) if p.is_alive()]
    stalled = heartbeats.stalled(running, timeout_s)
    if stalled is None:
        return
    message = heartbeats.describe(stalled, running)
    log.error("%s Stopping the job.", message)
    _stop(processes, grace_s)
    raise StalledRankError(f"{message} (launch.timeout_s={timeout_s:g}). {_STALL_FIX}")


def _wait_for_ranks(processes: list, error_files: list[str], heartbeats: watchdog.Heartbeats,
                    timeout_s: float, grace_s: float) -> None:
    """Until every rank has exited. The first failure stops the others at once (``_stop``) and is
    raised, as is a stall. (torch's ``ProcessContext.join`` would first wait ``grace_s`` for the
    others to fail too: a rank stalled in Python never does.)"""
    while True:
        failed = [r for r, p in enumerate(processes) if p.exitcode not in (None, 0)]
        if failed:
            _stop(processes, grace_s)
            codes = {processes[r].exitcode for r in failed}
            if codes <= set(EXIT_INTERRUPTED.values()):  # a signal reached the ranks themselves
                log.warning("rank(s) %s stopped by SIGINT/SIGTERM", failed)  # (Ctrl-C: the whole process group)
                raise SystemExit(max(codes))
            raise _rank_failure(failed, processes, error_files, heartbeats)
        running = [p for p in processes if p.exitcode is None]
        if not running:
            return
        _end_if_stalled(processes, heartbeats, timeout_s, grace_s)
        mp_connection.wait([p.sentinel for p in running], timeout=0.5)


@contextmanager
def _forward_signals(processes: list, grace_s: float) -> Iterator[None]:
    """SIGINT/SIGTERM to the launcher stop every rank (``_stop``: a SIGTERM, which ranks handle
    even when they inherited an ignored SIGINT); the launcher then exits with 130 or 143. With
    no processes (a one-rank run in this process) the signal ends the run here the same way."""

    def handler(signum, frame):
        log.warning("%s: stopping the run (%d rank processes)", signal.Signals(signum).name, len(processes))
        _stop(processes, grace_s)
        raise SystemExit(interrupted_exit_code(signum))

    if threading.current_thread() is not threading.main_thread():  # signals reach the main thread only
        yield
        return
    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def start_method(requested: str, device: str) -> str:
    """fork where it is safe: a CPU run on Linux (CUDA state and macOS frameworks do not survive a
    fork) from a single-threaded launcher (a lock another thread holds would stay held in the
    child: joblib's loky workers, for one, run helper threads)."""
    if requested != "auto":
        return requested
    safe = device == "cpu" and sys.platform.startswith("linux") and threading.active_count() == 1
    return "fork" if safe else "spawn"


def _spawn(cfg: DictConfig, layout: Layout, run_dir: Path, launch_time: float, marks: dict[str, float]) -> None:
    world = cfg.parallel.pp * cfg.parallel.dp
    if mp.get_start_method(allow_none=True) not in (None, "spawn", "fork", "forkserver"):
        # Inside a joblib (loky) worker: spawned children would re-apply "loky" and fail.
        mp.set_start_method("spawn", force=True)
    method = start_method(cfg.launch.start_method, cfg.device)
    log.info("starting %d rank processes (%s)", world, method)
    kind, address, server = _rendezvous(cfg, run_dir)
    heartbeats = watchdog.Heartbeats(mp.get_context(method), world)
    console_queue = mp.get_context(method).Queue()  # the ranks' console lines, printed here
    context = mp.start_processes(
        _spawned_rank,
        args=(world, OmegaConf.to_container(cfg, resolve=True), layout, str(run_dir), (kind, address),
              launch_time, marks, console_queue, heartbeats, os.getpid()),
        nprocs=world,
        join=False,
        start_method=method,
    )
    try:
        # The listener's thread starts after the ranks are forked: a fork copies no threads.
        with console_listener(console_queue), _forward_signals(context.processes, cfg.launch.grace_s):
            _wait_for_ranks(context.processes, context.error_files, heartbeats, cfg.launch.timeout_s,
                            cfg.launch.grace_s)
    finally:
        del server  # the TCP store (if any) closes with the launcher's last reference
        if kind == "file":
            Path(address).unlink(missing_ok=True)


def _join_torchrun(cfg: DictConfig, layout: Layout, run_dir: Path, launch_time: float,
                   marks: dict[str, float]) -> None:
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    expected = cfg.parallel.pp * cfg.parallel.dp
    if world != expected:
        raise ConfigError(
            f"torchrun started {world} ranks but parallel.pp x parallel.dp = {expected}. "
            f"Fix: --nproc-per-node {expected}, or parallel.pp={world}."
        )
    device = pick_device(cfg.device, local_rank=local_rank_from_env())
    torch.set_num_threads(cfg.launch.threads_per_rank)
    env = init_distributed(rank=rank, world_size=world, device=device, timeout_s=cfg.launch.timeout_s)
    marks = {**marks, "process_group": time.time()}
    try:
        # Each torchrun rank composed its own config; rank 0's Hydra run directory is the run's.
        box = [str(run_dir)]
        dist.broadcast_object_list(box, src=0)
        with torchrun_rank_log(rank, Path(box[0])), console_for_run():
            train(cfg, layout, env, Path(box[0]), launch_time=launch_time, startup_marks=marks)
    finally:
        cleanup()


def _launch_dir() -> Path:
    """Where the user started the runner (Hydra may have changed into the run directory)."""
    return Path(HydraConfig.get().runtime.cwd) if HydraConfig.initialized() else Path.cwd()


def _resume_point(cfg: DictConfig, run_dir: Path) -> Path:
    try:
        latest_root = _launch_dir() / Path(cfg.checkpoint.latest_root).expanduser()
        path = find_checkpoint(cfg.checkpoint.resume, run_dir, latest_root)
        step = checkpoint_step(path)
    except CheckpointError as e:  # before any rank starts: the configuration names a bad checkpoint
        raise ConfigError(f"checkpoint.resume={cfg.checkpoint.resume!r}: {e}") from None
    if step >= cfg.train.steps:
        raise ConfigError(f"checkpoint.resume: {path} is at step {step}, already "
                          f"train.steps={cfg.train.steps}. Fix: a larger train.steps.")
    return path


def launch(cfg: DictConfig, run_dir: Path, *, launch_time: float | None = None,
           composed_at: float | None = None) -> dict | None:
    """Validate, run every rank to the end, and return the run's summary (None on torchrun
    ranks other than 0). Raises ``RunnerError`` for anything that went wrong."""
    launch_time = launch_time or time.time()
    # From the launch: the interpreter, Hydra's compose and the checks that need no torch (until
    # ``composed_at``), then the imports a run needs (torch, the pipelining runtime, DCP).
    now = time.time()
    marks = {"compose": composed_at or now, "imports": now}
    adopt_slurm_ranks()  # under submitit, each task enters here without going through cli()
    layout = validate(cfg)
    ranks_on_host = int(os.environ.get("LOCAL_WORLD_SIZE", cfg.parallel.pp * cfg.parallel.dp))
    cfg.device = resolve_device(cfg.device, ranks_on_host)
    cfg.launch.threads_per_rank = _threads_per_rank(cfg, ranks_on_host)
    log.info("run directory: %s (device: %s)\n%s", run_dir, cfg.device, layout.describe())
    run_dir.mkdir(parents=True, exist_ok=True)
    if not os.access(run_dir, os.W_OK):
        raise ConfigError(f"hydra.run.dir={str(run_dir)!r} is not writable. Fix: hydra.run.dir=<writable dir>.")
    # In progress while this runs: resume=latest skips it, and no second run shares its directory.
    # (torchrun ranks other than 0 keep no run directory.)
    owns_run_dir = not under_torchrun() or os.environ["RANK"] == "0"
    with hold_run_lock(run_dir) if owns_run_dir else nullcontext():
        if cfg.checkpoint.resume:
            cfg.checkpoint.resume = str(_resume_point(cfg, run_dir))
        marks["validate"] = time.time()
        if under_torchrun():
            _join_torchrun(cfg, layout, run_dir, launch_time, marks)
            if int(os.environ["RANK"]) != 0:
                return None
        elif cfg.parallel.pp * cfg.parallel.dp == 1:
            torch.set_num_threads(cfg.launch.threads_per_rank)
            env = init_distributed(rank=0, world_size=1, device=pick_device(cfg.device, 0),
                                   timeout_s=cfg.launch.timeout_s)
            with console_for_run(), _forward_signals([], cfg.launch.grace_s):
                train(cfg, layout, env, run_dir, launch_time=launch_time, startup_marks=marks)
        else:
            _spawn(cfg, layout, run_dir, launch_time, marks)
    return json.loads((run_dir / "summary.json").read_text())
