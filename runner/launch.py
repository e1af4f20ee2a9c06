"""Launching a run: the config is validated into its ``ResolvedRun`` (``runner.validate``), then the
ranks start one of three ways: ``resolved.world_size`` processes spawned on this host (``runner.ranks.processes``,
watched by ``runner.ranks.supervise``; started again from the run's newest checkpoint after a failure,
``launch.max_restarts`` times), the ranks ``torchrun`` (or SLURM) started (a restarted worker resumes
the run in its own directory), or, for one rank, right here. The run directory is locked while the run
is in progress, across restarts."""

from __future__ import annotations

import copy
import dataclasses
import functools
import gc
import logging
import os
from contextlib import nullcontext
from pathlib import Path
from typing import TextIO

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from omegaconf import DictConfig, OmegaConf, read_write

from runner.checkpoint.files import complete_steps
from runner.errors import ConfigError, RunnerError
from runner.layout import ResolvedRun
from runner.outputs.sweep_report import ERROR_FILE
from runner.ranks import watchdog
from runner.ranks.clock import StartupClock
from runner.ranks.console import console_for_run, console_listener, rank_logging, torchrun_rank_log
from runner.ranks.dist import DistEnv, cleanup, init_distributed, local_rank_from_env, pick_device
from runner.ranks.env import adopt_slurm_ranks, under_torchrun
from runner.ranks.host import say_if_overloaded
from runner.ranks.processes import (
    forked_ranks_would_hang,
    note_threads,
    spawn,
    spawn_reason,
    start_method,
    stop_progress_monitors,
)
from runner.ranks.restarts import RESTART_VARIABLE, attempt_store, publish_run_dir, restart_count
from runner.ranks.supervise import forward_signals, wait_for_ranks
from runner.rundir import hold_run_lock
from runner.train import train
from runner.validate import validate

__all__ = ["launch"]

log = logging.getLogger(__name__)


def _rank_prelude(heartbeats: watchdog.Heartbeats, run_dir: Path, console_queue, restart: int, rank: int) -> None:
    """First thing in each spawned rank: its attempt (``runner.ranks.restarts``), its heartbeats and
    its logging (``runner.log``, and the launcher's console)."""
    os.environ[RESTART_VARIABLE] = str(restart)
    watchdog.attach(heartbeats, rank)
    rank_logging(rank, run_dir, console_queue)


def _train_rank(env: DistEnv, resolved: ResolvedRun, cfg_dict: dict, results, *, clock: StartupClock) -> None:
    """Each spawned rank, inside the process group: train; rank 0 sends the summary back."""
    result = train(resolved, OmegaConf.create(cfg_dict), env, clock=clock)
    if env.is_main:
        results.send(result.summary)
    results.close()


def _spawn(resolved: ResolvedRun, cfg: DictConfig, clock: StartupClock, console: TextIO | None,
           restart: int = 0) -> dict:
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
               prelude=functools.partial(_rank_prelude, heartbeats, resolved.run_dir, console_queue, restart)) as ranks:
        sender.close()  # the ranks hold theirs
        # The listener's thread starts after the ranks are forked: a fork copies no threads.
        with console_listener(console_queue, console), forward_signals(ranks.processes, grace_s):
            return wait_for_ranks(ranks.processes, ranks.error_files, heartbeats, timeout_s, grace_s, results)


def _join_torchrun(resolved: ResolvedRun, cfg: DictConfig, clock: StartupClock) -> dict | None:
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    resolved.dims.check(world, started_by="torchrun", restart=f"--nproc-per-node {resolved.world_size}")
    device = pick_device(resolved.device, local_rank=local_rank_from_env())
    torch.set_num_threads(resolved.threads_per_rank)
    env = init_distributed(rank=rank, world_size=world, device=device, timeout_s=cfg.launch.timeout_s,
                           store=attempt_store(cfg.launch.timeout_s), loopback=False)
    clock.mark("process_group")
    clock.say(f"ranks started: {world} processes (torchrun)")
    done = False
    try:
        # Each torchrun rank composed its own config; rank 0's Hydra run directory is the run's, and
        # so is the checkpoint it resumes from (a restart's is its own newest: ``_launch``).
        box = [str(resolved.run_dir), None if resolved.resume is None else str(resolved.resume)]
        dist.broadcast_object_list(box, src=0)
        run_dir, resume = Path(str(box[0])), box[1]
        resolved = dataclasses.replace(resolved, run_dir=run_dir, resume=None if resume is None else Path(resume))
        if rank == 0:
            publish_run_dir(run_dir)  # for a restarted rank 0 (``runner.ranks.restarts``)
        with torchrun_rank_log(rank, run_dir), console_for_run():
            summary = train(resolved, cfg, env, clock=clock).summary
        done = True
        return summary
    finally:
        cleanup(end_threads=done)  # done: the groups' threads end before the interpreter exits


def _train_here(resolved: ResolvedRun, cfg: DictConfig, clock: StartupClock) -> dict | None:
    """One rank: in this process. Its GPU's random generator is the caller's again after it (the
    CPU's: ``launch``)."""
    torch.set_num_threads(resolved.threads_per_rank)
    note_threads()  # a later launch from this process (a sweep's next job) must not fork then
    device = pick_device(resolved.device, 0)
    env = init_distributed(rank=0, world_size=1, device=device, timeout_s=cfg.launch.timeout_s)
    clock.say("ranks started: one, in this process")
    callers_rng = torch.random.fork_rng(devices=[device], enabled=device.type == "cuda")
    try:
        with console_for_run(), forward_signals([], cfg.launch.grace_s), callers_rng:
            return train(resolved, cfg, env, clock=clock).summary
    finally:
        if resolved.train.compile:
            _drop_compiled()
        stop_progress_monitors()  # torch.compile's, a Hugging Face model's: a later launch forks its ranks


def _drop_compiled() -> None:
    """torch.compile's in-memory caches emptied after a compiled run in this process (its on-disk
    cache stays): the next run compiles as it would in a fresh process. Torch keeps the programs of
    a model's forward for the process's life and stops compiling it after ``recompile_limit`` (8) of
    them: the ninth compiled run of a sweep over shapes ran that forward eagerly, not compiled as
    asked (a warning its only trace), and ranks forked later inherited the count. The caller's own
    compiled functions compile again on their next call."""
    torch.compiler.reset()


_launched: list[bool] = []  # whether this process launched a run before


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
    if _launched:  # an earlier run of this process left garbage in reference cycles: freed before the
        gc.collect()  # ranks, forked or run here, count their peak memory from their setup (reset_peak_memory)
    _launched.append(True)
    # The caller's CPU random generator is as it was after the launch (a one-rank run's GPU's too:
    # ``_train_here``): the run seeds its dropout from ``train.seed`` (``runner.train``), a resumed
    # one restores its checkpoint's state, and the checks draw, which made every random draw after
    # a ``runner.run`` in one process the same (a sweep drawing its trials' values between runs drew
    # one value).
    try:
        with torch.random.fork_rng(devices=[]):
            return _launch(cfg, run_dir, clock, console)
    finally:
        torch.set_num_threads(threads)


def _own_checkpoint(cfg: DictConfig, run_dir: Path) -> DictConfig:
    """The config of a restart: resumed from the run's newest complete checkpoint in ``run_dir`` if
    it saved one, else as it was launched."""
    if not complete_steps(run_dir / "checkpoints", log_skipped=False):
        return cfg
    cfg = copy.deepcopy(cfg)
    with read_write(cfg):
        cfg.checkpoint.resume = str(run_dir)
    return cfg


def _spawn_with_restarts(resolved: ResolvedRun, cfg: DictConfig, run_dir: Path, clock: StartupClock,
                         console: TextIO | None) -> dict:
    """``_spawn``, again after a rank failed (``launch.max_restarts`` times at most): each attempt a
    fresh rendezvous and fresh rank processes, resumed from the run's newest complete checkpoint.
    The last failure is raised as it would be without restarts."""
    restarts = cfg.launch.max_restarts
    for restart in range(restarts + 1):
        try:
            return _spawn(resolved, cfg, clock, console, restart)
        except ConfigError:  # nothing started: a restart would meet it again
            raise
        except RunnerError as e:
            if restart == restarts:
                raise
            cfg = _own_checkpoint(cfg, run_dir)
            resolved = validate(cfg, run_dir)
            log.warning("restart %d of %d (launch.max_restarts): new rank processes, from %s, after this failure:\n%s",
                        restart + 1, restarts, resolved.resume or "step 1 (the run saved no checkpoint yet)", e)
            clock = StartupClock()
            clock.mark("validate")
    raise AssertionError("unreachable")


def _launch(cfg: DictConfig, run_dir: Path, clock: StartupClock, console: TextIO | None) -> dict | None:
    adopt_slurm_ranks()  # under submitit, each task enters here without going through cli()
    if under_torchrun() and os.environ["RANK"] == "0" and restart_count() > 0:
        cfg = _own_checkpoint(cfg, run_dir)  # restarted by torchrun: from its newest checkpoint
        (run_dir / ERROR_FILE).unlink(missing_ok=True)  # the failed attempt's: this one may succeed
    if not under_torchrun() or os.environ["RANK"] == "0":
        say_if_overloaded(log.warning)
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
            if cfg.launch.max_restarts:
                log.warning("launch.max_restarts=%d has no effect under torchrun, which restarts its workers "
                            "itself: torchrun --max-restarts=N.", cfg.launch.max_restarts)
            return _join_torchrun(resolved, cfg, clock)
        if resolved.world_size == 1 and not cfg.launch.max_restarts:
            return _train_here(resolved, cfg, clock)
        return _spawn_with_restarts(resolved, cfg, run_dir, clock, console)
