"""One rehearsed rank: the runner's own ``Trainer`` (stage build, tp, FSDP/DDP, schedule, loss,
clipping, AdamW) over a rehearsal process group at the run's full world size, with its stages built
with static metadata (no shape messages). A rank runs in one of two passes (``RankPass``), or both:

* memory: AdamW's state is made first, as its own first step makes it (one ``optimizer.step`` on
  zero gradients: no forward or backward), so the first training step is already a steady one (the
  moments held through its forward and backward, as in every later step); then ``tracked`` steps
  under torch's ``MemTracker`` (``torch.distributed._tools``; on CPU and CUDA alike, it tracks the
  tensors' storages, not RSS): the peak, split into parameters, gradients, optimizer state and
  activations + the rest (buffers, temporaries, other);
* time: after them (or after untimed warm-up steps where nothing is tracked), one timed step,
  untracked (the tracker's dispatch mode slows every op) and unprofiled: each compute action (F/B/I/W
  per stage and microbatch, from the runner's recorder), the optimizer step (after clipping to after
  AdamW and the LR schedule), the step; and, where ``profiled``, a chrome trace of one more step by
  the run's own profiler (``traces/rank<r>.json`` in the rank's directory).

Either way, of the timed step (the last tracked one where none is timed): the bytes held in
parameters, gradients and optimizer state (``memory.held_bytes``) and the collectives (count and
bytes by kind and mesh dimension: tp, dp, pp, world).

``rank_main`` rehearses several ranks in turn in one process (a spawned one: the imports and the
interpreter's start are paid once); ``run_rank`` leaves no process group behind."""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

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

__all__ = ["RankPass", "rehearsal_run", "run_rank", "rank_main", "prime_optimizer"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RankPass:
    """What one rehearsal of a rank runs, in this order: ``tracked`` steps under the memory tracker
    (after AdamW's state is made), ``warmup`` steps, then where ``timed`` one timed step, then where
    ``profiled`` one profiled step."""

    tracked: int
    timed: bool
    profiled: bool
    warmup: int = 0  # untracked, untimed steps before the timed one

    @property
    def timed_step(self) -> int | None:
        """The timed step's number (from 1), or None."""
        return self.tracked + self.warmup + 1 if self.timed else None

    @property
    def steps(self) -> int:
        return self.tracked + self.warmup + int(self.timed) + int(self.profiled)


def rehearsal_run(resolved: ResolvedRun, rank_pass: RankPass, run_dir: Path) -> ResolvedRun:
    """The resolved run of a rehearsed rank: its pass's steps, the last one profiled where it is,
    into ``run_dir``; no checkpoint, no evaluation, no verify; the barrier's optimizer step, which
    ``_Measure`` times between the clip and the step's end (the planner scores runs with the
    barrier)."""
    profile = (dataclasses.replace(resolved.profile, enabled=True, wait=rank_pass.steps - 1, warmup=0, active=1)
               if rank_pass.profiled else dataclasses.replace(resolved.profile, enabled=False))
    return dataclasses.replace(
        resolved, steps=rank_pass.steps, run_dir=run_dir, resume=None, verify=False, rank_cpus=None,
        train=dataclasses.replace(resolved.train, optimizer_sync=OptimizerSync.barrier),
        checkpoint=dataclasses.replace(resolved.checkpoint, every=0),
        eval=dataclasses.replace(resolved.eval, every=0), profile=profile)


class _Measure(Hook):
    """The tracked steps' peak: the largest of theirs, each step tracked by a tracker of its own,
    entered as it begins (after its batch is made and the gradients dropped) and left as it ends,
    as the tests' ``HeldBytes`` measures a real rank (one tracker over several steps counted, in a
    later step, tensors its hooks had kept from an earlier one: zero-bubble last stages read 35%
    high over two steps, and more over three); the measured step's (``step``: the timed one, else
    the last tracked one) held bytes, optimizer time and collectives; the recorder records it and
    the profiled step (``last``)."""

    def __init__(self, step: int, last: int, tracked: int):
        self.step, self.last, self.tracked = step, last, tracked
        self.held: dict[str, int] = {}
        self.optimizer_s = 0.0
        self._clipped = 0.0
        self.collectives: dict = {}
        self.recorder: Recorder | None = None
        self.tracker: Any = None  # torch's MemTracker (private: runner._torch.rehearsal)
        self.peak: dict[str, int] | None = None

    def begin_step(self, ctx: StepContext, state: StepState) -> None:
        # The profiler's window (the last step) set the recorder for this step just before the
        # hooks: the recorder also records the measured step (whose actions are kept; the profiled
        # step's are recorded for the trace's ``compute:`` ranges).
        assert self.recorder is not None
        self.recorder.active = state.step in (self.step, self.last)
        if state.step == self.step:
            reset_collectives()
        if state.step <= self.tracked:
            self.tracker = peak_tracker(ctx.modules, ctx.optimizer)
            self.tracker.__enter__()

    def after_clip(self, ctx: StepContext, state: StepState) -> None:
        self._clipped = time.perf_counter()

    def after_step(self, ctx: StepContext, state: StepState) -> None:
        if self.tracker is not None:
            self.tracker.__exit__(None, None, None)
            peak, self.tracker = peak_split(self.tracker), None  # it holds the modules: let them go
            if self.peak is None or peak["total"] > self.peak["total"]:
                self.peak = peak
        if state.step == self.step:
            self.optimizer_s = time.perf_counter() - self._clipped
            self.held = held_bytes(ctx.params, ctx.optimizer)
            self.collectives = collectives_by_dim(ctx.mesh.dims)


def prime_optimizer(params: Sequence[torch.nn.Parameter], optimizer: torch.optim.Optimizer) -> None:
    """AdamW's state made as its own first step makes it (its ``_init_group``: the step count and
    both moments), by one ``optimizer.step`` on zero gradients, then the gradients dropped: the
    next training step holds the state through its forward and backward, as every step after a
    run's first does (no forward, backward or collective here; the values move by the weight decay,
    which a rehearsal's values, not the real run's, may)."""
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _steps(trainer, rank_pass: RankPass) -> dict[str, float]:
    """Run the pass's steps (AdamW's state made first where memory is tracked); the wall seconds of
    each phase."""
    wall: dict[str, float] = {}
    if rank_pass.tracked:
        prime_optimizer(trainer.params, trainer.optimizer)
    phases = (["tracked"] * rank_pass.tracked + ["warmup"] * rank_pass.warmup + ["timed"] * rank_pass.timed
              + ["profiled"] * rank_pass.profiled)
    for index, phase in enumerate(phases):
        began = time.perf_counter()
        trainer.step(index)
        wall[phase] = wall.get(phase, 0.0) + time.perf_counter() - began
    began = time.perf_counter()
    trainer.profiler.stop()  # the trace is written as the profiled step ends
    wall["trace"] = time.perf_counter() - began
    return wall


def run_rank(resolved: ResolvedRun, cfg: DictConfig, rank: int, rank_pass: RankPass, run_dir: Path) -> dict:
    """Rehearse ``rank`` of ``resolved`` in this process (which must hold no process group) for
    ``rank_pass``; returns its measurements (the keys of a pass not run are None)."""
    from runner.train import Trainer

    run_dir.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda", 0) if resolved.device == "cuda" else torch.device("cpu")
    began = time.perf_counter()
    env = init_rehearsal(rank, resolved.world_size, device)
    timed = rank_pass.timed_step
    measure = _Measure(timed or rank_pass.tracked, rank_pass.steps if rank_pass.profiled else -1, rank_pass.tracked)
    try:
        trainer = Trainer(rehearsal_run(resolved, rank_pass, run_dir), cfg, env, hooks=[measure], static_stages=True)
        trainer.setup()
        measure.recorder = trainer.profiler.recorder
        setup_s = time.perf_counter() - began
        wall = _steps(trainer, rank_pass)
        trace = run_dir / "traces" / f"rank{rank}.json"
        actions = [{"stage": a.op.stage, "kind": a.op.kind, "microbatch": a.op.microbatch,
                    "seconds": (a.end_ns - a.start_ns) / 1e9} for a in trainer.profiler.recorder.actions
                   if a.step == timed]
        coords = trainer.mesh.coords
        return {"rank": rank, "coords": {"pp": coords.pp, "dp": coords.dp, "tp": coords.tp},
                "stages": resolved.layout.stages_on(coords.pp), "seq_len": resolved.seq_len,
                "steps": rank_pass.steps, "tracked_steps": rank_pass.tracked, "timed_step": timed,
                "losses": trainer.losses, "held_bytes": measure.held, "peak_bytes": measure.peak,
                "step_s": trainer.step_times[timed - 1] if timed else None,
                "optimizer_s": measure.optimizer_s if timed else None, "actions": actions if timed else None,
                "profiled_step": rank_pass.steps if rank_pass.profiled else None,
                "collectives": measure.collectives, "memory_tracker": "torch.distributed._tools.MemTracker",
                "trace": str(trace) if trace.is_file() else None, "wall_s": {"setup": setup_s, **wall}}
    finally:
        if measure.tracker is not None:  # a step failed while tracked: its dispatch mode leaves with it
            measure.tracker.__exit__(None, None, None)
        cleanup()  # the group and what holds it (the cached mesh, DTensor's caches): a process may rehearse again


def rank_main(jobs: Sequence[tuple[ResolvedRun, DictConfig, int, RankPass, Path, Path]]) -> None:
    """A spawned process's target: each job (the run, its config, the rank, its pass, the rank's
    directory, the JSON file its result is written to) in turn; the first that fails ends the
    process (its traceback on stderr; the launcher names the rank by its missing file)."""
    for resolved, cfg, rank, rank_pass, run_dir, out in jobs:
        torch.set_num_threads(resolved.threads_per_rank)
        result = run_rank(resolved, cfg, rank, rank_pass, run_dir)
        out.write_text(json.dumps(result, indent=1))
