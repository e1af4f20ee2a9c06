"""Stages → schedule: one callable per rank that runs a whole training step's forward and
backward over all microbatches, pipelined or (pp=1) on the unsplit model."""

from __future__ import annotations

import logging
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from omegaconf import DictConfig
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.pipelining import PipelineStage

from runner import _torch_pp
from runner.dist import DistEnv
from runner.mesh import Mesh
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
            if isinstance(model, FSDPModule):  # reduce across replicas once, after the last microbatch
                model.set_requires_gradient_sync(i == m - 1)
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
        try:
            if self.has_last:
                self.schedule.step(*args, target=targets, losses=losses, return_outputs=False)
                return torch.stack([loss.detach() for loss in losses]).mean()
            self.schedule.step(*args, return_outputs=False)
            return None
        except Exception as e:  # shape inference runs the stage outside the recorded actions
            if not any(note.startswith("runner:") for note in getattr(e, "__notes__", [])):
                e.add_note(f"runner: in pipeline stage(s) {[s.stage_index for s in self.stages]} on this rank")
            raise


def data_parallel(module: nn.Module, mode: str, mesh: Mesh) -> nn.Module:
    """Replicate a stage module over the dp mesh dimension. Parameter names do not change."""
    if mode == "none" or mesh.dp_mesh is None:
        return module
    if mode == "ddp":
        return _torch_pp.replicate(module, mesh=mesh.dp_mesh)
    # FSDP2: a unit per child that owns parameters, then the stage root. Parameters stay
    # gathered between microbatches (reshard_after_forward=False): pipelining runs many forwards
    # per step, and re-gathering for each would multiply the all-gathers by the microbatch count.
    for child in module.children():
        if any(True for _ in child.parameters()):
            fully_shard(child, mesh=mesh.dp_mesh, reshard_after_forward=False)
    return fully_shard(module, mesh=mesh.dp_mesh, reshard_after_forward=False)


def build_step(cfg: DictConfig, layout: Layout, env: DistEnv, mesh: Mesh) -> UnsplitStep | PipelinedStep:
    """Materialise only this rank's stage modules, replicate them over dp, wrap for the schedule."""
    model = build_meta_model(cfg.model)
    seed, mode = cfg.train.seed, cfg.parallel.dp_mode
    if layout.pp == 1:
        full = materialize(model, list(model._modules), seed=seed, device=env.device)
        return UnsplitStep(data_parallel(full, mode, mesh), layout.microbatches)
    stages = []
    for index in layout.stages_on(mesh.pp_rank):
        module = materialize(model, layout.stages[index], seed=seed, device=env.device)
        n_params = sum(p.numel() for p in module.parameters())
        log.info("stage %d: %s (%d parameters)", index, ", ".join(layout.stages[index]), n_params)
        module = data_parallel(module, mode, mesh)
        stages.append(PipelineStage(module, index, layout.num_stages, env.device, group=mesh.pp_group))
    schedule = build_schedule(layout.schedule, stages, layout.microbatches, lm_loss, layout.csv)
    return PipelinedStep(stages, schedule, layout)
