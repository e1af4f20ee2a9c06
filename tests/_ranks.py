"""Run a function on N gloo ranks, spawned once; the tests put many cases into one spawn."""

from __future__ import annotations

import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from omegaconf import OmegaConf

from runner.dist import cleanup, init_distributed
from runner.errors import RunnerError
from runner.train import train
from runner.validate import validate


def spawn(world: int, fn, *args) -> None:
    Path(args[0]).mkdir(parents=True, exist_ok=True)
    store = Path(args[0]) / f".store-{time.time_ns()}"
    mp.start_processes(_entry, args=(world, str(store), fn, args), nprocs=world, join=True,
                       start_method="spawn")


def _entry(rank: int, world: int, store: str, fn, args) -> None:
    torch.set_num_threads(1)
    env = init_distributed(rank=rank, world_size=world, device=torch.device("cpu"), timeout_s=120,
                           store=dist.FileStore(store, world))
    try:
        fn(env, *args)
    finally:
        cleanup()


def train_cases(env, out_dir: str, cases: dict[str, dict]) -> None:
    """Train every case on the same process group; rank 0 saves losses, first-step gradients
    and the summary, or the runner error every rank raised, to ``<out_dir>/<case>.pt``."""
    for name, cfg_dict in cases.items():
        cfg = OmegaConf.create(cfg_dict)
        run_dir = Path(out_dir) / name
        run_dir.mkdir(parents=True, exist_ok=True)
        try:
            result = train(cfg, validate(cfg), env, run_dir, launch_time=time.time(), keep_first_grads=True)
            record = {"losses": result.losses, "grads": result.first_grads,
                      "clipped": result.first_clipped_grads, "summary": result.summary}
        except RunnerError as e:
            record = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        if env.is_main:
            torch.save(record, Path(out_dir) / f"{name}.pt")
