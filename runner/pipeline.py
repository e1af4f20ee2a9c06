"""Stages → schedule: one callable per rank that runs a whole training step's forward and
backward over all microbatches, pipelined or (pp=1) on the unsplit model."""

from __future__ import annotations

import logging
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from omegaconf import DictConfig
from torch import nn
from torch.distributed.pipelining import PipelineStage

from runner.dist import DistEnv
from runner.record import Recorder
from runner.schedule import build_schedule
from runner.split import build_meta_model, materialize
from runner.validate import Layout

__all__ = ["lm_loss", "UnsplitStep", "PipelinedStep", "build_step"]

log = logging.getLogger(__name__)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of one microbatch."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


class UnsplitStep:
    """The reference: the whole model in one process, gradients accumulated over the same
    microbatches as the pipeline, each scaled by 1/microbatches."""

    def __init__(self, model: nn.Module, microbatches: int):
        self.modules = [model]
        self.microbatches = microbatches
        self.recorder: Recorder | None = None

    def attach(self, recorder: Recorder) -> None:
        self.recorder = recorder

    def __call__(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        model, m = self.modules[0], self.microbatches
        timed = self.recorder.action if self.recorder else lambda *_: nullcontext()
        losses = []
        for i, (x, y) in enumerate(zip(inputs.tensor_split(m), targets.tensor_split(m))):
            with timed(0, "F", i):
                loss = lm_loss(model(x), y)
            with timed(0, "B", i):
                (loss / m).backward()
            losses.append(loss.detach())
        return torch.stack(losses).mean()


class PipelinedStep:
    """This rank's share of a pipelined step: inputs enter on the rank with the first stage,
    targets on the rank with the last; only that rank returns the step's loss."""

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

    def __call__(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
        losses: list[torch.Tensor] = []
        args = (inputs,) if self.has_first else ()
        if self.has_last:
            self.schedule.step(*args, target=targets, losses=losses, return_outputs=False)
            return torch.stack([loss.detach() for loss in losses]).mean()
        self.schedule.step(*args, return_outputs=False)
        return None


def build_step(cfg: DictConfig, layout: Layout, env: DistEnv) -> UnsplitStep | PipelinedStep:
    """Materialise only this rank's stage modules and wrap them for the schedule."""
    model = build_meta_model(cfg.model)
    seed = cfg.train.seed
    if layout.pp == 1:
        full = materialize(model, list(model._modules), seed=seed, device=env.device)
        return UnsplitStep(full, layout.microbatches)
    stages = []
    for index in layout.stages_on(env.rank):
        module = materialize(model, layout.stages[index], seed=seed, device=env.device)
        n_params = sum(p.numel() for p in module.parameters())
        log.info("stage %d: %s (%d parameters)", index, ", ".join(layout.stages[index]), n_params)
        stages.append(PipelineStage(module, index, layout.num_stages, env.device))
    schedule = build_schedule(layout.schedule, stages, layout.microbatches, lm_loss, layout.csv)
    return PipelinedStep(stages, schedule, layout)
