"""Stages → schedule: one callable per rank that runs a whole training step's forward and
backward over all microbatches, pipelined or (pp=1) on the unsplit model."""

from __future__ import annotations

import logging
from contextlib import nullcontext
from typing import Callable

import torch
from omegaconf import DictConfig
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import PipelineStage

from runner import _torch_pp
from runner.dist import DistEnv
from runner.losses import build_loss
from runner.mesh import Mesh
from runner.parallelize import parallelize
from runner.record import Recorder
from runner.schedule import build_schedule
from runner.split import build_meta_model, materialize
from runner.validate import Layout

__all__ = ["Batch", "UnsplitStep", "PipelinedStep", "build_step"]

log = logging.getLogger(__name__)

Batch = tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]  # inputs, targets, keyword inputs


class UnsplitStep:
    """The reference: the whole model in one process, gradients accumulated over the same
    microbatches as the pipeline, each scaled by 1/microbatches."""

    def __init__(self, model: nn.Module, microbatches: int, loss_fn: Callable):
        self.modules = [model]
        self.microbatches = microbatches
        self.loss_fn = loss_fn
        self.recorder: Recorder | None = None

    def attach(self, recorder: Recorder) -> None:
        self.recorder = recorder

    def _microbatches(self, inputs, targets, kwargs):
        # tensor_split along the batch, as torch's schedules split args, targets and kwargs.
        m = self.microbatches
        kwarg_mbs = [{k: v.tensor_split(m)[i] for k, v in kwargs.items()} for i in range(m)]
        return zip(inputs.tensor_split(m), targets.tensor_split(m), kwarg_mbs)

    def __call__(self, inputs: torch.Tensor, targets: torch.Tensor, **kwargs: torch.Tensor) -> torch.Tensor:
        model, m = self.modules[0], self.microbatches
        timed = self.recorder.action if self.recorder else lambda *_: nullcontext()
        losses = []
        for i, (x, y, kw) in enumerate(self._microbatches(inputs, targets, kwargs)):
            if isinstance(model, FSDPModule):  # reduce across replicas once, after the last microbatch
                model.set_requires_gradient_sync(i == m - 1)
            with timed(0, "F", i):
                loss = self.loss_fn(model(x, **kw), y)
            with timed(0, "B", i):
                (loss / m).backward()
            losses.append(loss.detach())
        return torch.stack(losses).mean()

    @torch.no_grad()
    def evaluate(self, inputs: torch.Tensor, targets: torch.Tensor, **kwargs: torch.Tensor) -> torch.Tensor:
        model = self.modules[0]
        return torch.stack([self.loss_fn(model(x, **kw), y)
                            for x, y, kw in self._microbatches(inputs, targets, kwargs)]).mean()


class PipelinedStep:
    """This rank's share of a pipelined step: inputs enter on the rank with the first stage,
    targets on the rank with the last, keyword inputs on every rank (each stage's children take
    the ones they name); only the last stage's rank returns the step's loss."""

    def __init__(self, stages: list[PipelineStage], schedule, layout: Layout):
        self.stages = stages
        self.modules = [s.submod for s in stages]
        self.schedule = schedule
        indices = {s.stage_index for s in stages}
        self.has_first = 0 in indices
        self.has_last = layout.num_stages - 1 in indices

    def attach(self, recorder: Recorder) -> None:
        for stage in self.stages:
            recorder.wrap_stage(stage)

    def _run(self, run, inputs, targets, kwargs) -> torch.Tensor | None:
        losses: list[torch.Tensor] = []
        args = (inputs,) if self.has_first else ()
        try:
            if self.has_last:
                run(*args, target=targets, losses=losses, return_outputs=False, **kwargs)
                return torch.stack([loss.detach() for loss in losses]).mean()
            run(*args, return_outputs=False, **kwargs)
            return None
        except Exception as e:  # shape inference runs the stage outside the recorded actions
            if not any(note.startswith("runner:") for note in getattr(e, "__notes__", [])):
                e.add_note(f"runner: in pipeline stage(s) {[s.stage_index for s in self.stages]} on this rank")
            raise

    def __call__(self, inputs: torch.Tensor, targets: torch.Tensor, **kwargs: torch.Tensor) -> torch.Tensor | None:
        return self._run(self.schedule.step, inputs, targets, kwargs)

    def evaluate(self, inputs: torch.Tensor, targets: torch.Tensor, **kwargs: torch.Tensor) -> torch.Tensor | None:
        """Forward only, every microbatch, through the same stages (torch's ``schedule.eval``)."""
        return self._run(self.schedule.eval, inputs, targets, kwargs)


def build_step(cfg: DictConfig, layout: Layout, env: DistEnv, mesh: Mesh) -> UnsplitStep | PipelinedStep:
    """Materialise only this rank's stage modules, checkpoint/compile/cast/replicate them, and wrap
    them for the schedule."""
    model = build_meta_model(cfg.model)
    children = list(model._modules)
    seed, loss_fn = cfg.train.seed, build_loss(cfg.loss)

    def stage_module(names) -> nn.Module:
        module = materialize(model, names, seed=seed, device=env.device)
        return parallelize(module, children, cfg.train, cfg.parallel.dp_mode, mesh)

    if layout.pp == 1:
        return UnsplitStep(stage_module(children), layout.microbatches, loss_fn)
    stages = []
    for index in layout.stages_on(mesh.pp_rank):
        module = stage_module(layout.stages[index])
        n_params = sum(p.numel() for p in module.parameters())
        log.info("stage %d: %s (%d parameters)", index, ", ".join(layout.stages[index]), n_params)
        stage = PipelineStage(module, index, layout.num_stages, env.device, group=mesh.pp_group)
        _torch_pp.allow_eval(stage)
        stages.append(stage)
    schedule = build_schedule(layout.schedule, stages, layout.microbatches, loss_fn, layout.csv)
    return PipelinedStep(stages, schedule, layout)
