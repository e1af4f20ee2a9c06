"""Launching ranks: spawn ``pp * dp`` processes on this host, or join the ranks ``torchrun``
started, or (one rank) train right here. Ranks rendezvous through a ``FileStore`` in the run
directory: no listening socket, so two runs started together cannot collide on a port."""

from __future__ import annotations

import datetime
import json
import logging
import os
import pickle
import re
import signal
import sys
import threading
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from runner.checkpoint import checkpoint_step, find_checkpoint
from runner.console import console_for_run, console_listener, rank_logging, torchrun_rank_log
from runner.dist import cleanup, init_distributed, local_rank_from_env, pick_device, resolve_device
from runner.errors import ConfigError, RankFailedError, RunnerError
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


def _rendezvous(cfg: DictConfig, run_dir: Path) -> tuple[str, str, dist.Store | None]:
    """(kind, address, the launcher's own store if it hosts one). Checked before spawning."""
    if cfg.launch.port is None:
        return "file", str(run_dir / f".rendezvous-{uuid.uuid4().hex}"), None
    try:
        server = dist.TCPStore("127.0.0.1", cfg.launch.port, is_master=True, wait_for_workers=False,
                               timeout=datetime.timedelta(seconds=cfg.launch.timeout_s))
    except (RuntimeError, OSError) as e:
        raise ConfigError(f"launch.port={cfg.launch.port} cannot be used ({e}); it is probably taken. "
                          "Fix: another launch.port, or launch.port=null (the default opens no port).") from e
    return "tcp", str(cfg.launch.port), server


def _connect(kind: str, address: str, world: int, timeout_s: float) -> dist.Store:
    if kind == "file":
        return dist.FileStore(address, world)
    return dist.TCPStore("127.0.0.1", int(address), is_master=False,
                         timeout=datetime.timedelta(seconds=timeout_s))


def _spawned_rank(rank: int, world: int, cfg_dict: dict, layout: Layout, run_dir: str,
                  rendezvous: tuple[str, str], launch_time: float, marks: dict[str, float], console_queue) -> None:
    """Entry of each spawned rank process."""
    marks = {**marks, "spawn": time.time()}  # fork: milliseconds; spawn: a fresh interpreter and imports
    cfg = OmegaConf.create(cfg_dict)
    run_dir_path = Path(run_dir)
    rank_logging(rank, run_dir_path, console_queue)
    torch.set_num_threads(cfg.launch.threads_per_rank)
    device = pick_device(cfg.device, local_rank=rank)
    env = init_distributed(rank=rank, world_size=world, device=device, timeout_s=cfg.launch.timeout_s,
                           store=_connect(*rendezvous, world, cfg.launch.timeout_s))
    marks["process_group"] = time.time()
    try:
        train(cfg, layout, env, run_dir_path, launch_time=launch_time, startup_marks=marks)
    finally:
        cleanup()


# How gloo/nccl report that a peer went away: a symptom on the survivors, not the root cause.
_PEER_GONE = re.compile(
    r"Connection (closed|reset) by peer|remote worker crash|Broken pipe|NCCL communicator was aborted")


def _rank_failure(error: Exception, error_files: list[str]) -> RunnerError:
    """The root cause among the failed ranks (the first whose traceback is not a peer's
    disappearance): a runner error's message, or that rank's full traceback."""
    traces = {}
    for rank, path in enumerate(error_files):
        if os.access(path, os.R_OK):
            with open(path, "rb") as f:
                traces[rank] = pickle.load(f)
    root = next((r for r, t in traces.items() if not _PEER_GONE.search(t)), None)
    if root is None:
        root = error.error_index
        if root not in traces:  # killed by a signal or exited without a traceback
            return RankFailedError(f"rank {root}: {error}")
    text = traces[root]
    match = re.search(r"^runner\.errors\.\w+: (.*)", text, flags=re.S | re.M)
    if match:
        return RunnerError(f"rank {root}: {match.group(1).strip()}")
    return RankFailedError(f"rank {root} failed:\n{text.strip()}")


@contextmanager
def _forward_signals(processes: list, grace_s: float) -> Iterator[None]:
    """SIGINT/SIGTERM to the launcher go to every rank; ranks still alive after ``grace_s`` are
    killed; the launcher then exits with 128 + the signal (130, 143)."""

    def handler(signum, frame):
        log.warning("%s: stopping %d ranks", signal.Signals(signum).name, len(processes))
        for p in processes:
            if p.is_alive():
                os.kill(p.pid, signum)
        deadline = time.monotonic() + grace_s
        for p in processes:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in processes:
            if p.is_alive():
                p.kill()
                p.join()
        raise SystemExit(128 + signum)

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
    console_queue = mp.get_context(method).Queue()  # the ranks' console lines, printed here
    context = mp.start_processes(
        _spawned_rank,
        args=(world, OmegaConf.to_container(cfg, resolve=True), layout, str(run_dir), (kind, address),
              launch_time, marks, console_queue),
        nprocs=world,
        join=False,
        start_method=method,
    )
    try:
        # The listener's thread starts after the ranks are forked: a fork copies no threads.
        with console_listener(console_queue), _forward_signals(context.processes, cfg.launch.grace_s):
            # join() re-raises the first rank failure and terminates the other ranks.
            while not context.join(timeout=1.0, grace_period=cfg.launch.grace_s):
                pass
    except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:
        raise _rank_failure(e, context.error_files) from None
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
    if cfg.checkpoint.resume:
        path = find_checkpoint(cfg.checkpoint.resume, run_dir)
        if checkpoint_step(path) >= cfg.train.steps:
            raise ConfigError(f"checkpoint.resume: {path} is at step {checkpoint_step(path)}, already "
                              f"train.steps={cfg.train.steps}. Fix: a larger train.steps.")
        cfg.checkpoint.resume = str(path)
    log.info("run directory: %s (device: %s)\n%s", run_dir, cfg.device, layout.describe())
    run_dir.mkdir(parents=True, exist_ok=True)
    if not os.access(run_dir, os.W_OK):
        raise ConfigError(f"hydra.run.dir={str(run_dir)!r} is not writable. Fix: hydra.run.dir=<writable dir>.")
    marks["validate"] = time.time()
    if under_torchrun():
        _join_torchrun(cfg, layout, run_dir, launch_time, marks)
        if int(os.environ["RANK"]) != 0:
            return None
    elif cfg.parallel.pp * cfg.parallel.dp == 1:
        torch.set_num_threads(cfg.launch.threads_per_rank)
        env = init_distributed(rank=0, world_size=1, device=pick_device(cfg.device, 0),
                               timeout_s=cfg.launch.timeout_s)
        with console_for_run():
            train(cfg, layout, env, run_dir, launch_time=launch_time, startup_marks=marks)
    else:
        _spawn(cfg, layout, run_dir, launch_time, marks)
    return json.loads((run_dir / "summary.json").read_text())
