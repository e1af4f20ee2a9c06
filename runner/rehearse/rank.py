"""One rehearsed rank, in a process of its own: the runner's own ``Trainer`` (stage build, tp,
FSDP/DDP, schedule, loss, clipping, AdamW) over a rehearsal process group at the run's full world
size, with its stages built with static metadata (no shape messages), for ``steps`` steps. What
it measures (``RankResult``, written as JSON for the launcher):

* memory: the bytes held in parameters, gradients and optimizer state (``memory.held_bytes``), and
  the peak over the steps before the last (all of them when ``steps`` is 1), split by torch's
  ``MemTracker`` (``torch.distributed._tools``; on CPU and CUDA alike, it tracks the tensors'
  storages, not RSS) into parameters, gradients, optimizer state and activations + the rest
  (buffers, temporaries, other);
* time: each compute action of the last step (F/B/I/W per stage and microbatch, from the runner's
  recorder), the optimizer step (after clipping to after AdamW and the LR schedule), the step;
* collectives of the last step: count and bytes by kind and mesh dimension (tp, dp, pp, world);
* a chrome trace, by the run's own profiler (``traces/rank<r>.json`` in the rank's directory), of
  one more step after the last: the profiler adds its own cost to every op (issue #35 reported a
  tiny model's profiled step at several times its real one), so the timed step runs without it."""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from pathlib import Path

import torch
from omegaconf import DictConfig

from runner._torch.rehearsal import peak_split, peak_tracker
from runner.hooks import Hook, StepContext, StepState
from runner.layout import ResolvedRun
from runner.options import OptimizerSync
from runner.pipeline.recorder import Recorder
from runner.ranks.dist import cleanup
from runner.rehearse.memory import held_bytes
from runner.rehearse.world import collectives_by_dim, init_rehearsal, reset_collectives

__all__ = ["rehearsal_run", "run_rank", "rank_main"]

log = logging.getLogger(__name__)


def rehearsal_run(resolved: ResolvedRun, steps: int, run_dir: Path) -> ResolvedRun:
    """The resolved run of a rehearsed rank: ``steps`` steps and one more for the torch profiler
    (step ``steps + 1``, its window) into ``run_dir``; no checkpoint, no evaluation, no verify; the
    barrier's optimizer step, which ``_Measure`` times between the clip and the step's end (the
    planner scores runs with the barrier)."""
    return dataclasses.replace(
        resolved, steps=steps + 1, run_dir=run_dir, resume=None, verify=False, rank_cpus=None,
        train=dataclasses.replace(resolved.train, optimizer_sync=OptimizerSync.barrier),
        checkpoint=dataclasses.replace(resolved.checkpoint, every=0),
        eval=dataclasses.replace(resolved.eval, every=0),
        profile=dataclasses.replace(resolved.profile, enabled=True, wait=steps, warmup=0, active=1))


class _Measure(Hook):
    """The timed step's (``steps``) actions, held bytes, optimizer time and collectives."""

    def __init__(self, steps: int):
        self.steps = steps
        self.held: dict[str, int] = {}
        self.optimizer_s = 0.0
        self._clipped = 0.0
        self.collectives: dict = {}
        self.recorder: Recorder | None = None

    def begin_step(self, ctx: StepContext, state: StepState) -> None:
        # The profiler's window (the step after) set the recorder for this step just before the
        # hooks: the recorder also records the timed step (whose actions are kept; the profiled
        # step's are recorded for the trace's ``compute:`` ranges).
        assert self.recorder is not None
        self.recorder.active = state.step in (self.steps, self.steps + 1)
        if state.step == self.steps:
            reset_collectives()

    def after_clip(self, ctx: StepContext, state: StepState) -> None:
        self._clipped = time.perf_counter()

    def after_step(self, ctx: StepContext, state: StepState) -> None:
        if state.step == self.steps:
            self.optimizer_s = time.perf_counter() - self._clipped
            self.held = held_bytes(ctx.params, ctx.optimizer)
            self.collectives = collectives_by_dim(ctx.mesh.dims)


def run_rank(resolved: ResolvedRun, cfg: DictConfig, rank: int, steps: int, run_dir: Path) -> dict:
    """Rehearse ``rank`` of ``plan`` in this process (which must hold no process group); returns
    its measurements."""
    from runner.train import Trainer

    run_dir.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda", 0) if resolved.device == "cuda" else torch.device("cpu")
    env = init_rehearsal(rank, resolved.world_size, device)
    try:
        measure = _Measure(steps)
        trainer = Trainer(rehearsal_run(resolved, steps, run_dir), cfg, env, hooks=[measure], static_stages=True)
        trainer.setup()
        measure.recorder = trainer.profiler.recorder
        tracker = peak_tracker(trainer.modules, trainer.optimizer)
        # The tracker's dispatch mode slows every op: memory is tracked over the steps before the
        # last (the first one creates the optimizer state), the last step is timed untracked, and one
        # more, neither tracked nor timed, is profiled.
        with tracker:
            for index in range(max(1, steps - 1)):
                trainer.step(index)
        for index in range(max(1, steps - 1), steps + 1):
            trainer.step(index)
        trainer.profiler.stop()
        trace = run_dir / "traces" / f"rank{rank}.json"
        recorder = trainer.profiler.recorder
        actions = [{"stage": a.op.stage, "kind": a.op.kind, "microbatch": a.op.microbatch,
                    "seconds": (a.end_ns - a.start_ns) / 1e9} for a in recorder.actions if a.step == steps]
        coords = trainer.mesh.coords
        return {"rank": rank, "coords": {"pp": coords.pp, "dp": coords.dp, "tp": coords.tp},
                "stages": resolved.layout.stages_on(coords.pp), "steps": steps, "losses": trainer.losses[:steps],
                "held_bytes": measure.held, "peak_bytes": peak_split(tracker),
                "step_s": trainer.step_times[steps - 1], "optimizer_s": measure.optimizer_s, "actions": actions,
                "profiled_step": trainer.profiler.window.first + 1,
                "collectives": measure.collectives, "memory_tracker": "torch.distributed._tools.MemTracker",
                "trace": str(trace) if trace.is_file() else None}
    finally:
        cleanup()  # the group and what holds it (the cached mesh, DTensor's caches): a process may rehearse again


def rank_main(resolved: ResolvedRun, cfg: DictConfig, rank: int, steps: int, run_dir: Path, out: Path) -> None:
    """A spawned process's target: rehearse ``rank`` and write its result to ``out`` (JSON)."""
    torch.set_num_threads(resolved.threads_per_rank)
    run_dir.mkdir(parents=True, exist_ok=True)
    result = run_rank(resolved, cfg, rank, steps, run_dir)
    out.write_text(json.dumps(result, indent=1))
