"""Launching a run: the config is validated into its ``ResolvedRun`` (``runner.validate``), then the
ranks start one of three ways: ``resolved.world_size`` processes spawned on this host (``runner.ranks.processes``,
watched by ``runner.ranks.supervise``), the ranks ``torchrun`` (or SLURM) started, or, for one rank,
right here. The run directory is locked while the run is in progress."""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
from contextlib import nullcontext
from pathlib import Path
from typing import TextIO

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from omegaconf import DictConfig, OmegaConf

from runner.errors import ConfigError
from runner.layout import ResolvedRun
from runner.ranks import watchdog
from runner.ranks.clock import StartupClock
from runner.ranks.console import console_for_run, console_listener, rank_logging, torchrun_rank_log
from runner.ranks.dist import DistEnv, cleanup, init_distributed, local_rank_from_env, pick_device
from runner.ranks.env import adopt_slurm_ranks, under_torchrun
from runner.ranks.processes import forked_ranks_would_hang, note_threads, spawn, spawn_reason, start_method
from runner.ranks.supervise import forward_signals, wait_for_ranks
from runner.rundir import hold_run_lock
from runner.train import train
from runner.validate import validate

__all__ = ["launch"]

log = logging.getLogger(__name__)


def _rank_prelude(heartbeats: watchdog.Heartbeats, run_dir: Path, console_queue, rank: int) -> None:
    """First thing in each spawned rank: its heartbeats and its logging (``runner.log``, and the
    launcher's console)."""
    watchdog.attach(heartbeats, rank)
    rank_logging(rank, run_dir, console_queue)


def _train_rank(env: DistEnv, resolved: ResolvedRun, cfg_dict: dict, results, *, clock: StartupClock) -> None:
    """Each spawned rank, inside the process group: train; rank 0 sends the summary back."""
    result = train(resolved, OmegaConf.create(cfg_dict), env, clock=clock)
    if env.is_main:
        results.send(result.summary)
    results.close()


def _spawn(resolved: ResolvedRun, cfg: DictConfig, clock: StartupClock, console: TextIO | None) -> dict:
    timeout_s, grace_s = cfg.launch.timeout_s, cfg.launch.grace_s
    method = start_method(cfg.launch.start_method, resolved.device, resolved.threads_per_rank)
    if method == "fork" and forked_ranks_would_hang(resolved.threads_per_rank):  # asked for: auto would spawn
        raise ConfigError(
            f"launch.start_method=fork: this process ran torch on several threads, and OpenMP's thread team does "
            f"not survive a fork: ranks of {resolved.threads_per_rank} threads would hang in their first op. Fix: "
            "launch.start_method=auto (spawns them), or launch.threads_per_rank=1.")
    auto = method == "spawn" and cfg.launch.start_method == "auto"
    why = spawn_reason(resolved.device, resolved.threads_per_rank) if auto else ""
    log.info("starting %d rank processes (%s%s)", resolved.world_size, method, f": {why}" if why else "")
    ctx = mp.get_context(method)
    heartbeats = watchdog.Heartbeats(ctx, [resolved.dims.coords(r) for r in range(resolved.world_size)])
    console_queue = ctx.Queue()  # the ranks' console lines, printed here
    results, sender = ctx.Pipe(duplex=False)
    assert resolved.run_dir is not None  # launch() validated with its run directory
    with spawn(resolved.world_size, _train_rank, resolved, OmegaConf.to_container(cfg, resolve=True), sender,
               device=resolved.device, timeout_s=timeout_s, directory=resolved.run_dir, port=cfg.launch.port,
               method=method,
               threads=resolved.threads_per_rank, cpus=resolved.rank_cpus, clock=clock,
               prelude=functools.partial(_rank_prelude, heartbeats, resolved.run_dir, console_queue)) as ranks:
        sender.close()  # the ranks hold theirs
        # The listener's thread starts after the ranks are forked: a fork copies no threads.
        with console_listener(console_queue, console), forward_signals(ranks.processes, grace_s):
            return wait_for_ranks(ranks.processes, ranks.error_files, heartbeats, timeout_s, grace_s, results)


def _join_torchrun(resolved: ResolvedRun, cfg: DictConfig, clock: StartupClock) -> dict | None:
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    resolved.dims.check(world, started_by="torchrun", restart=f"--nproc-per-node {resolved.world_size}")
    device = pick_device(resolved.device, local_rank=local_rank_from_env())
    torch.set_num_threads(resolved.threads_per_rank)
    env = init_distributed(rank=rank, world_size=world, device=device, timeout_s=cfg.launch.timeout_s)
    clock.mark("process_group")
    clock.say(f"ranks started: {world} processes (torchrun)")
    done = False
    try:
        # Each torchrun rank composed its own config; rank 0's Hydra run directory is the run's.
        box = [str(resolved.run_dir)]
        dist.broadcast_object_list(box, src=0)
        run_dir = Path(box[0])
        resolved = dataclasses.replace(resolved, run_dir=run_dir)
        with torchrun_rank_log(rank, run_dir), console_for_run():
            summary = train(resolved, cfg, env, clock=clock).summary
        done = True
        return summary
    finally:
        cleanup(end_threads=done)  # done: the groups' threads end before the interpreter exits


def _train_here(resolved: ResolvedRun, cfg: DictConfig, clock: StartupClock) -> dict | None:
    """One rank: in this process."""
    torch.set_num_threads(resolved.threads_per_rank)
    note_threads()  # a later launch from this process (a sweep's next job) must not fork then
    env = init_distributed(rank=0, world_size=1, device=pick_device(resolved.device, 0), timeout_s=cfg.launch.timeout_s)
    clock.say("ranks started: one, in this process")
    with console_for_run(), forward_signals([], cfg.launch.grace_s):
        return train(resolved, cfg, env, clock=clock).summary


def launch(cfg: DictConfig, run_dir: Path, *, clock: StartupClock | None = None,
           console: TextIO | None = None) -> dict | None:
    """Validate, run every rank to the end, and return the run's summary (None on torchrun
    ranks other than 0). Raises ``RunnerError`` for anything that went wrong. ``clock``: the
    command line's, started before its imports (else one starting now). ``console``: where
    spawned ranks' console lines go (stdout; the planner's probes keep them in a file)."""
    if clock is None:
        clock = StartupClock()
        clock.mark("compose")
    # From the launch: the interpreter, Hydra's compose and the checks that need no torch (until
    # "compose"), then the imports a run needs (torch, the pipelining runtime, DCP).
    clock.mark("imports")
    # The launcher computes on one thread (its checks), so that its ranks can be forked
    # (``runner.ranks.processes.spawn_reason``); a caller that ran torch on several is remembered.
    threads = torch.get_num_threads()
    note_threads()
    torch.set_num_threads(1)
    try:
        return _launch(cfg, run_dir, clock, console)
    finally:
        torch.set_num_threads(threads)


def _launch(cfg: DictConfig, run_dir: Path, clock: StartupClock, console: TextIO | None) -> dict | None:
    adopt_slurm_ranks()  # under submitit, each task enters here without going through cli()
    resolved = validate(cfg, run_dir, progress=clock.say)
    log.info("run directory: %s (device: %s%s)\n%s", run_dir, resolved.device,
             f", ranks pinned to cores {' | '.join(','.join(map(str, c)) for c in resolved.rank_cpus)}"
             if resolved.rank_cpus else "", resolved.layout.describe())
    run_dir.mkdir(parents=True, exist_ok=True)
    if not os.access(run_dir, os.W_OK):
        raise ConfigError(f"hydra.run.dir={str(run_dir)!r} is not writable. Fix: hydra.run.dir=<writable dir>.")
    # In progress while this runs: resume=latest skips it, and no second run shares its directory.
    # (torchrun ranks other than 0 keep no run directory.)
    owns_run_dir = not under_torchrun() or os.environ["RANK"] == "0"
    with hold_run_lock(run_dir) if owns_run_dir else nullcontext():
        clock.mark("validate")
        if under_torchrun():
            return _join_torchrun(resolved, cfg, clock)
        if resolved.world_size == 1:
            return _train_here(resolved, cfg, clock)
        return _spawn(resolved, cfg, clock, console)
