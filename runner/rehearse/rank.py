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
  per stage and microbatch, from the runner's recorder, which waits for the device at each action's
  start and end: on a GPU an action's kernels, not their launch), the optimizer step (after clipping to after
  AdamW and the LR schedule), the step; and, where ``profiled``, a chrome trace of one more step by
  the run's own profiler (``traces/rank<r>.json`` in the rank's directory).

A rank runs its run's own ``train.optimizer_sync``. Under ``post_validate`` and ``deferred`` the timed
step's update is what the rank does between its pipeline's end and its step's end
(``update_s``: the norm's squares that start the all-reduce, the snapshot, AdamW, the LR schedule;
``deferred``: also the previous step's validation, its wait answered at once), the snapshot's part
of it (``snapshot_s``) and the rest (``optimizer_s``), each read after a wait for the device (the
``Trainer``'s ``wait_for_device``: on a GPU the kernels', not their launches); the snapshot's
copies, and under ``deferred`` the previous step's gradients a rank keeps through its forward and
backward, are in the tracked peak (made before the first tracked step, as a run's earlier steps made them).

Either way, of the timed step (the last tracked one where none is timed): the bytes held in
parameters, gradients and optimizer state (``memory.held_bytes``) and the collectives (count and
bytes by kind and mesh dimension: tp, dp, pp, world).

``rank_main`` rehearses several ranks in turn in one process (a spawned one: the imports and the
interpreter's start are paid once); ``run_rank`` leaves no process group behind, and begins by
letting go of what a rank before it held (``free_previous_rank``: on CUDA the caching allocator's
blocks emptied and its peak reset, so that ``device_peak_bytes``, the allocator's high-water mark, is
this rank's alone, and a rank near the device's capacity is not short of the blocks another cached)."""

from __future__ import annotations

import dataclasses
import gc
import json
import logging
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Sequence

import torch
from omegaconf import DictConfig
from torch.distributed.tensor import DTensor

from runner._torch.rehearsal import peak_split, peak_tracker
from runner.hooks import Hook, StepContext, StepState
from runner.layout import ResolvedRun
from runner.options import OptimizerSync
from runner.pipeline.recorder import Recorder
from runner.ranks.dist import cleanup, synchronize
from runner.rehearse.memory import held_bytes
from runner.rehearse.world import collectives_by_dim, init_rehearsal, reset_collectives

__all__ = ["RankPass", "rehearsal_run", "run_rank", "rank_main", "prime_optimizer", "free_previous_rank"]

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
    into ``run_dir``; no checkpoint, no evaluation, no verify; the run's own ``train.optimizer_sync``
    (``_Measure`` times its update)."""
    profile = (dataclasses.replace(resolved.profile, enabled=True, wait=rank_pass.steps - 1, warmup=0, active=1)
               if rank_pass.profiled else dataclasses.replace(resolved.profile, enabled=False))
    return dataclasses.replace(
        resolved, steps=rank_pass.steps, run_dir=run_dir, resume=None, verify=False, rank_cpus=None,
        checkpoint=dataclasses.replace(resolved.checkpoint, every=0),
        eval=dataclasses.replace(resolved.eval, every=0), profile=profile)


class _Measure(Hook):
    """The tracked steps' peak: the largest of theirs, each step tracked by a tracker of its own,
    entered as it begins (after its batch is made and the gradients dropped) and left as its call
    ends (``end_step``: under ``deferred`` the step's ``after_step`` comes in the next call), as the
    tests' ``HeldBytes`` measures a real rank (one tracker over several steps counted, in a later
    step, tensors its hooks had kept from an earlier one: zero-bubble last stages read 35% high over
    two steps, and more over three); the measured step's (``step``: the timed one, else the last
    tracked one) held bytes, update times and collectives; the recorder records it and the profiled
    step (``last``). ``trainer``: the rank's ``Trainer`` (its post-validation state and the step it
    keeps for validation)."""

    def __init__(self, step: int, last: int, tracked: int):
        self.step, self.last, self.tracked = step, last, tracked
        self.held: dict[str, int] = {}
        self.optimizer_s = 0.0
        self.update_s: float | None = None  # post_validate/deferred: pipeline's end to the step's end
        self.snapshot_s: float | None = None
        self._clipped = 0.0
        self._began: float | None = None  # the measured step's first begin_step (a rerun begins it again)
        self._backward = (0.0, 0.0, 0.0)  # its pipeline's end, and the snapshot and rollback seconds then
        self.collectives: dict = {}
        self.recorder: Recorder | None = None
        self.trainer: Any = None
        self.kept: list[torch.Tensor] | None = None  # deferred: stand-ins for the gradients of a step before the first
        self.tracker: Any = None  # torch's MemTracker (private: runner._torch.rehearsal)
        self.peak: dict[str, int] | None = None

    def _held_outside(self) -> list[torch.Tensor]:
        """What a post-validating rank holds through its step that the tracker would not see (made
        before it): the snapshot's copies and, under ``deferred``, the previous step's gradients,
        kept for its validation (or, before the first step, their stand-ins)."""
        stats = self.trainer.post_validate
        if stats is None:
            return []
        pending = self.trainer.pending
        kept = [g for g in pending.grads if g is not None] if pending is not None else self.kept or []
        return [*stats.snapshot.tensors(), *(g.to_local() if isinstance(g, DTensor) else g for g in kept)]

    def begin_step(self, ctx: StepContext, state: StepState) -> None:
        # The profiler's window (the last step) set the recorder for this step just before the
        # hooks: the recorder also records the measured step (whose actions are kept; the profiled
        # step's are recorded for the trace's ``compute:`` ranges).
        assert self.recorder is not None
        self.recorder.active = state.step in (self.step, self.last)
        if state.step == self.step:
            reset_collectives()
            self._began = self._began or time.perf_counter()
        if state.step <= self.tracked and self.tracker is None:  # a rerun step keeps its tracker
            self.tracker = peak_tracker(ctx.modules, ctx.optimizer, *self._held_outside())
            self.tracker.__enter__()

    def after_backward(self, ctx: StepContext, state: StepState) -> None:
        stats = self.trainer.post_validate
        if state.step == self.step and stats is not None:
            synchronize(ctx.env.device)
            self._backward = (time.perf_counter(), stats.snapshot_s, stats.rollback_s)

    # The barrier's AdamW and LR step, timed on the device (as the recorder times the actions): a
    # CUDA call returns before its kernels run.
    def after_clip(self, ctx: StepContext, state: StepState) -> None:
        if state.step == self.step and self.trainer.post_validate is None:
            synchronize(ctx.env.device)
            self._clipped = time.perf_counter()

    def after_step(self, ctx: StepContext, state: StepState) -> None:
        if state.step == self.step and self.trainer.post_validate is None:
            synchronize(ctx.env.device)
            self.optimizer_s = time.perf_counter() - self._clipped

    def end_step(self, step: int) -> None:
        """Step ``step``'s call returned: its tracker left; where it is the measured step, its update
        (post_validate/deferred: from its pipeline's end to its end, less a rollback in it, the
        profiler's step not counted), held bytes and collectives."""
        if self.tracker is not None:
            self.tracker.__exit__(None, None, None)
            # (the tracker holds the modules: let them go)
            peak, self.tracker = peak_split(self.tracker, self.trainer.env.device), None
            if self.peak is None or peak["total"] > self.peak["total"]:
                self.peak = peak
        self.kept = None  # a step ran: from here on its gradients are kept, not stand-ins
        if step != self.step:
            return
        trainer, stats = self.trainer, self.trainer.post_validate
        if stats is not None:
            assert self._began is not None
            ended = self._began + trainer.step_times[-1]
            at, snapshot_s, rollback_s = self._backward
            self.snapshot_s = stats.snapshot_s - snapshot_s
            self.update_s = ended - at - (stats.rollback_s - rollback_s)
            self.optimizer_s = self.update_s - self.snapshot_s
        self.held = held_bytes(trainer.params, trainer.optimizer)
        self.collectives = collectives_by_dim(trainer.mesh.dims)


def prime_optimizer(params: Sequence[torch.nn.Parameter], optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """AdamW's state made as its own first step makes it (its ``_init_group``: the step count and
    both moments), by one ``optimizer.step`` on zero gradients, then the gradients dropped: the
    next training step holds the state through its forward and backward, as every step after a
    run's first does (no forward, backward or collective here; the values move by the weight decay,
    which a rehearsal's values, not the real run's, may). Returns the dropped gradients."""
    grads = []
    for p in params:
        p.grad = torch.zeros_like(p)
        grads.append(p.grad)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return grads


def _steps(trainer, rank_pass: RankPass, measure: _Measure) -> dict[str, float]:
    """Run the pass's steps (AdamW's state made first where memory is tracked, and a
    post-validating rank's snapshot copies, and under ``deferred`` the gradients a previous step
    keeps: what a steady step holds); the wall seconds of each phase."""
    wall: dict[str, float] = {}
    if rank_pass.tracked:
        grads = prime_optimizer(trainer.params, trainer.optimizer)
        if trainer.post_validate is not None:
            trainer.post_validate.snapshot.take()
        if trainer.resolved.train.optimizer_sync == OptimizerSync.deferred:
            measure.kept = grads
    phases = (["tracked"] * rank_pass.tracked + ["warmup"] * rank_pass.warmup + ["timed"] * rank_pass.timed
              + ["profiled"] * rank_pass.profiled)
    for index, phase in enumerate(phases):
        began = time.perf_counter()
        trainer.step(index)
        measure.end_step(index + 1)
        wall[phase] = wall.get(phase, 0.0) + time.perf_counter() - began
    began = time.perf_counter()
    trainer.profiler.stop()  # the trace is written as the profiled step ends
    wall["trace"] = time.perf_counter() - began
    return wall


def free_previous_rank(device: torch.device, cuda: Any = torch.cuda) -> None:
    """What an earlier rank rehearsed in this process held, let go before the next: its tensors
    (those in reference cycles collected; its ``Trainer`` is gone once ``run_rank`` returns) and on
    CUDA, once the device has finished with them, the blocks the caching allocator kept (the next
    rank, alone on its GPU in the real run, gets the whole device) and the allocator's peak
    statistics (``device_peak_bytes`` then counts this rank alone). The memory tracker's peaks need
    nothing: a tracker follows the tensors made while it is entered, one step at a time. ``cuda``:
    ``torch.cuda`` (the tests' stand-in)."""
    gc.collect()
    if device.type == "cuda":
        cuda.synchronize(device)
        cuda.empty_cache()
        cuda.reset_peak_memory_stats(device)


def _device_peak(device: torch.device) -> int | None:
    """CUDA's allocator high-water mark since ``free_previous_rank`` (None on CPU: the tracker's is the one)."""
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def run_rank(resolved: ResolvedRun, cfg: DictConfig, rank: int, rank_pass: RankPass, run_dir: Path) -> dict:
    """Rehearse ``rank`` of ``resolved`` in this process (which must hold no process group) for
    ``rank_pass``; returns its measurements (the keys of a pass not run are None)."""
    from runner.train import Trainer

    run_dir.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda", 0) if resolved.device == "cuda" else torch.device("cpu")
    free_previous_rank(device)
    began = time.perf_counter()
    env = init_rehearsal(rank, resolved.world_size, device)
    timed = rank_pass.timed_step
    measure = _Measure(timed or rank_pass.tracked, rank_pass.steps if rank_pass.profiled else -1, rank_pass.tracked)
    try:
        trainer = Trainer(rehearsal_run(resolved, rank_pass, run_dir), cfg, env, hooks=[measure], static_stages=True)
        trainer.setup()
        measure.recorder, measure.trainer = trainer.profiler.recorder, trainer
        # Each action, and the step's own times (its end, the snapshot, a rollback), timed on the
        # device: a CUDA call returns before its kernels run (a real run adds no such wait).
        trainer.profiler.recorder.wait_for_device(partial(synchronize, device))
        trainer.wait_for_device = partial(synchronize, device)
        setup_s = time.perf_counter() - began
        wall = _steps(trainer, rank_pass, measure)
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
                "optimizer_sync": OptimizerSync(resolved.train.optimizer_sync).value, "update_s": measure.update_s,
                "snapshot_s": measure.snapshot_s,
                "snapshot_bytes": trainer.post_validate.snapshot.nbytes() if trainer.post_validate else None,
                "profiled_step": rank_pass.steps if rank_pass.profiled else None,
                "collectives": measure.collectives, "memory_tracker": "torch.distributed._tools.MemTracker",
                "device_peak_bytes": _device_peak(device),
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
