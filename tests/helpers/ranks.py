"""Run a function on N gloo ranks, spawned once (``runner.ranks.processes.spawn``, as runs start
theirs); the tests put many cases into one spawn (``run_cases``) and assert each case apart."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import traceback
from pathlib import Path

import torch
from omegaconf import OmegaConf

from runner.errors import RunnerError
from runner.hooks import Hook, StepContext, StepState
from runner.ranks.processes import spawn as spawn_ranks
from runner.train import train
from runner.validate import validate
from runner.verify.hook import gather, gather_grads


def spawn(world: int, fn, *args, threads_left_because: str | None = None) -> None:
    """``fn(env, *args)`` on ``world`` ranks; ``args[0]`` is the cases' directory (made here). Every
    rank must also end cleanly: no process-group thread left running into its interpreter's exit
    (``runner.ranks.dist.cleanup`` warns; a rank with such threads could abort after all its work),
    unless ``threads_left_because`` says why a test accepts them."""
    directory = Path(args[0])
    directory.mkdir(parents=True, exist_ok=True)
    with spawn_ranks(world, fn, *args, directory=directory, timeout_s=120, method="spawn", threads=1,
                     prelude=functools.partial(_keep_exit_warnings, str(directory))) as ranks:
        ranks.join()
    warned = sorted(directory.glob("exit-warnings-rank*.log"))
    assert threads_left_because or not warned, "\n".join(f"{f.name}: {f.read_text()}" for f in warned)


def _keep_exit_warnings(directory: str, rank: int) -> None:
    """In each rank: ``runner.ranks.dist``'s warnings (its cleanup's) go to a file the spawn looks for."""
    handler = logging.FileHandler(Path(directory) / f"exit-warnings-rank{rank}.log", delay=True)  # made if used
    handler.setLevel(logging.WARNING)
    logging.getLogger("runner.dist").addHandler(handler)


class FirstGrads(Hook):
    """The first step's gradients on rank 0 (by full parameter name), before and after clipping."""

    def __init__(self) -> None:
        self.grads: dict[str, torch.Tensor | None] = {}
        self.clipped: dict[str, torch.Tensor | None] = {}

    def after_reduce(self, ctx: StepContext, state: StepState) -> None:
        if state.first:
            self.grads = gather_grads(ctx.modules, ctx.env, skip=ctx.not_counted)

    def after_clip(self, ctx: StepContext, state: StepState) -> None:
        if state.first:
            self.clipped = gather_grads(ctx.modules, ctx.env, skip=ctx.not_counted)


class FinalWeights(Hook):
    """After the run's last step, every weight (by full name, a tied weight once) and its AdamW
    moments in rank 0's run directory, ``weights.pt``: what a run ends with, to compare exactly."""

    def after_step(self, ctx: StepContext, state: StepState) -> None:
        if state.step != ctx.resolved.steps:
            return
        state_of = ctx.optimizer.state
        final = {"weights": gather(ctx.modules, ctx.env, lambda p: p, ctx.not_counted)}
        for key in ("exp_avg", "exp_avg_sq"):
            final[key] = gather(ctx.modules, ctx.env, lambda p, key=key: state_of[p][key], ctx.not_counted)
        if ctx.env.is_main:
            assert ctx.resolved.run_dir is not None
            torch.save(final, ctx.resolved.run_dir / "weights.pt")


def final_weights() -> list[Hook]:
    """``run_cases``' ``more_hooks`` for ``FinalWeights``."""
    return [FinalWeights()]


@contextlib.contextmanager
def _fault(spec: str | None):
    """``RUNNER_FAULT=<spec>`` (``runner.faults``) in this rank while one case trains."""
    if spec is None:
        yield
        return
    os.environ["RUNNER_FAULT"] = spec
    try:
        yield
    finally:
        del os.environ["RUNNER_FAULT"]


def train_cases(env, out_dir: str, cases: dict[str, dict], more_hooks=None, faults=None) -> None:
    """Train every case on the same process group; rank 0 saves losses, first-step gradients
    and the summary, or the runner error every rank raised, to ``<out_dir>/<case>.pt``.
    ``more_hooks``: a function (importable by the ranks) making each case's other hooks;
    ``faults``: case -> the ``RUNNER_FAULT`` it trains under."""
    for name, cfg_dict in cases.items():
        cfg = OmegaConf.create(cfg_dict)
        run_dir = Path(out_dir) / name
        run_dir.mkdir(parents=True, exist_ok=True)
        try:
            grads = FirstGrads()
            with _fault((faults or {}).get(name)):
                result = train(validate(cfg, run_dir), cfg, env,
                               hooks=[grads, *(more_hooks() if more_hooks else [])])
            record = {"losses": result.losses, "grads": grads.grads, "clipped": grads.clipped,
                      "summary": result.summary}
        except RunnerError as e:
            record = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        if env.is_main:
            torch.save(record, Path(out_dir) / f"{name}.pt")


def run_cases(out_dir: Path, world: int, cases: dict[str, dict], more_hooks=None,
              faults: dict[str, str] | None = None, threads_left_because: str | None = None) -> dict[str, dict]:
    """One spawn of ``world`` ranks trains every case (name -> resolved config, see
    ``helpers.config.resolved``); returns each case's record (``train_cases``)."""
    spawn(world, train_cases, str(out_dir), cases, more_hooks, faults, threads_left_because=threads_left_because)
    return {name: torch.load(Path(out_dir) / f"{name}.pt", weights_only=False) for name in cases}
