"""Stages → schedule: one callable per rank that runs a whole training step's forward and
backward over all microbatches, pipelined or (pp=1) on the unsplit model."""

from __future__ import annotations

import logging
from contextlib import nullcontext
from typing import Callable, Sequence

import torch
from omegaconf import DictConfig
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import PipelineStage

from runner._torch import pp as _torch_pp
from runner.layout import Layout, ResolvedRun
from runner.losses import TargetWeighted, build_loss, counted_targets
from runner.models.split import StageModule, build_meta_model, fill, stage_io, stage_skeleton
from runner.models.units import describe_names
from runner.parallel.dp import DP_MODES
from runner.parallel.mesh import Mesh
from runner.parallel.parallelize import parallelize
from runner.parallel.tied import TiedWeights, share_local_copies
from runner.parallel.tp import apply_tp, loss_context, sum_partial_grads, tp_plan
from runner.pipeline.recorder import Recorder
from runner.pipeline.schedule import build_schedule
from runner.ranks.dist import DistEnv
from runner.ranks.watchdog import waiting

__all__ = ["Batch", "UnsplitStep", "PipelinedStep", "build_step"]

log = logging.getLogger("runner.pipeline")  # named as before runner/ became packages (runner.log)

Batch = tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]  # inputs, targets, keyword inputs


class UnsplitStep:
    """The reference: the whole model in one process, gradients accumulated over the same
    microbatches as the pipeline, each scaled by 1/microbatches (and each loss weighted by its
    share of the batch's counted targets: ``TargetWeighted``). ``forward`` (default: the model)
    maps a microbatch's inputs and keyword inputs to logits. ``grad_sum``: the weights whose
    gradients ``mesh``'s tp group sums (what ``apply_tp`` returned)."""

    def __init__(self, model: nn.Module, microbatches: int, loss_fn: Callable, forward: Callable | None = None,
                 mesh: Mesh | None = None, loss_parallel: bool = False, grad_sum: tuple[str, ...] = ()):
        self.modules = [model]
        self.mesh = mesh  # its tp group sums the gradients each shard holds a part of
        self.grad_sums = [grad_sum]
        self.loss_context = loss_context(loss_parallel)  # around forward and backward (runner.parallel.tp)
        self.microbatches = microbatches
        self.replicas = mesh.dp if mesh is not None else 1  # whose microbatch means the step's loss averages
        self.loss_fn = TargetWeighted(loss_fn)
        self.forward = forward or model
        self.recorder: Recorder | None = None

    def attach(self, recorder: Recorder) -> None:
        self.recorder = recorder

    def _microbatches(self, inputs, targets, kwargs):
        # tensor_split along the batch, as torch's schedules split args, targets and kwargs.
        m = self.microbatches
        kwarg_mbs = [{k: v.tensor_split(m)[i] for k, v in kwargs.items()} for i in range(m)]
        return zip(inputs.tensor_split(m), targets.tensor_split(m), kwarg_mbs)

    def __call__(self, inputs: torch.Tensor, targets: torch.Tensor, *, counted: int | None = None,
                 **kwargs: torch.Tensor) -> torch.Tensor:
        """The step's forward and backward; ``counted``: the counted targets of the global batch
        whose replica's rows these are (``_weigh``)."""
        model = self.modules[0]
        timed = self.recorder.action if self.recorder else lambda *_: nullcontext()
        losses: list[torch.Tensor] = []
        _weigh(self.loss_fn, targets, counted, self.microbatches, self.replicas)
        with self.loss_context():
            self._accumulate(model, self._microbatches(inputs, targets, kwargs), losses, timed)
        if self.mesh is not None:
            sum_partial_grads(self.modules, self.grad_sums, self.mesh)
        return torch.stack(losses).mean()

    def _accumulate(self, model: nn.Module, microbatches, losses: list[torch.Tensor], timed) -> None:
        m = self.microbatches
        for i, (x, y, kw) in enumerate(microbatches):
            if isinstance(model, FSDPModule):  # reduce across replicas once, after the last microbatch
                model.set_requires_gradient_sync(i == m - 1)
            with timed(0, "F", i):
                loss = self.loss_fn(self.forward(x, **kw), y)
            with timed(0, "B", i):
                (loss / m).backward()
            losses.append(loss.detach())

    @torch.no_grad()
    def evaluate(self, inputs: torch.Tensor, targets: torch.Tensor, *, counted: int | None = None,
                 **kwargs: torch.Tensor) -> torch.Tensor:
        _weigh(self.loss_fn, targets, counted, self.microbatches, self.replicas)
        with self.loss_context():
            return torch.stack([self.loss_fn(self.forward(x, **kw), y)
                                for x, y, kw in self._microbatches(inputs, targets, kwargs)]).mean()


class PipelinedStep:
    """This rank's share of a pipelined step: inputs enter on the rank with the first stage,
    targets on the rank with the last, keyword inputs on every rank (each stage's children take
    the ones they name); only the last stage's rank returns the step's loss. ``grad_sums``: for
    each stage, the weights whose gradients the tp group sums (what ``apply_tp`` returned)."""

    def __init__(self, stages: list[PipelineStage], schedule, layout: Layout, mesh: Mesh,
                 loss_parallel: bool = False, grad_sums: Sequence[tuple[str, ...]] | None = None,
                 loss_fn: TargetWeighted | None = None):
        self.stages = stages
        self.loss_fn = loss_fn  # the schedule's: weighed before each step (None: a loss the schedule owns)
        self.mesh = mesh
        self.modules = [s.submod for s in stages]
        self.grad_sums = list(grad_sums) if grad_sums is not None else [() for _ in stages]
        self.schedule = schedule
        self.microbatches = layout.microbatches
        # Each parameter once: a tied weight shared by two stages of this rank (V placements)
        # collects both stages' gradients and is scaled once.
        self.params = list({id(p): p for m in self.modules for p in m.parameters()}.values())
        indices = {s.stage_index for s in stages}
        self.has_first = 0 in indices
        self.has_last = layout.num_stages - 1 in indices
        # The last stage's loss and its backward both run inside step() (and its forward inside
        # eval()): the whole call enters torch's loss_parallel, which is not re-entrant.
        self.loss_context = loss_context(loss_parallel and self.has_last)

    def attach(self, recorder: Recorder) -> None:
        """Time and note (heartbeats) each stage's actions; note the schedule's waits for messages."""
        for stage in self.stages:
            recorder.wrap_stage(stage)
        _torch_pp.mark_p2p_waits(waiting)

    def _run(self, run, inputs, targets, kwargs) -> torch.Tensor | None:
        losses: list[torch.Tensor] = []
        args = (inputs,) if self.has_first else ()
        try:
            with self.loss_context():
                if self.has_last:
                    run(*args, target=targets, losses=losses, return_outputs=False, **kwargs)
                    return torch.stack([loss.detach() for loss in losses]).mean()
                run(*args, return_outputs=False, **kwargs)
                return None
        except Exception as e:  # shape inference runs the stage outside the recorded actions
            if not any(note.startswith("runner:") for note in getattr(e, "__notes__", [])):
                e.add_note(f"runner: in pipeline stage(s) {[s.stage_index for s in self.stages]} on this rank")
            raise

    def __call__(self, inputs: torch.Tensor, targets: torch.Tensor, *, counted: int | None = None,
                 **kwargs: torch.Tensor) -> torch.Tensor | None:
        """This rank's share of the step; ``counted``: the counted targets of the global batch
        whose replica's rows these are (``_weigh``)."""
        if self.loss_fn is not None:
            _weigh(self.loss_fn, targets, counted, self.microbatches, self.mesh.dp)
        loss = self._run(self.schedule.step, inputs, targets, kwargs)
        sum_partial_grads(self.modules, self.grad_sums, self.mesh)
        # The schedules sum microbatch gradients (scale_grads=False: torch would scale per stage,
        # after that stage's last backward, which scales a shared weight twice and too early).
        with torch.no_grad():
            for p in self.params:
                if p.grad is not None:
                    p.grad.div_(self.microbatches)
        return loss

    @torch.no_grad()
    def evaluate(self, inputs: torch.Tensor, targets: torch.Tensor, *, counted: int | None = None,
                 **kwargs: torch.Tensor) -> torch.Tensor | None:
        """Forward only, every microbatch, through the same stages (torch's ``schedule.eval``),
        without autograd: torch's eval does not turn it off, and with grad enabled each stage's
        forward built a graph (FSDP and replicate registered their backward hooks on it) that
        outlived the run with its process groups."""
        if self.loss_fn is not None:
            _weigh(self.loss_fn, targets, counted, self.microbatches, self.mesh.dp)
        return self._run(self.schedule.eval, inputs, targets, kwargs)


def _weigh(loss_fn: TargetWeighted, targets: torch.Tensor, counted: int | None, microbatches: int,
           replicas: int) -> None:
    """The loss weighed for a step over ``targets``, a replica's rows of a global batch counting
    ``counted`` targets; without ``counted``, over ``targets`` alone (each replica's own mean)."""
    if counted is None:
        loss_fn.weigh(counted=counted_targets(targets), total=targets.numel(), parts=microbatches)
    else:
        loss_fn.weigh(counted=counted, total=targets.numel() * replicas, parts=microbatches * replicas)


def build_step(resolved: ResolvedRun, cfg: DictConfig, env: DistEnv, mesh: Mesh, *,
               example: Batch | None = None) -> tuple[UnsplitStep | PipelinedStep, TiedWeights]:
    """Lay out this rank's stage modules on the meta device (tp, checkpointing, compile, precision,
    dp), allocate and fill only their shards, and wrap them for the schedule. Also returns what
    keeps weights tied across stages equal.

    ``example`` (this replica's share of a batch) builds every stage with static metadata (its
    input and output shapes, from the meta model): torch's schedules then vote static and never
    infer shapes by messages. Without it (real runs today) the stages infer them on each step."""
    meta = build_meta_model(cfg.model, cfg.parallel.get("stage_modules"))
    seed, loss_fn = resolved.train.seed, build_loss(cfg.loss)
    layout, dp_mode = resolved.layout, resolved.dp_mode
    tp = tp_plan(meta.module, resolved.dims)
    loss_parallel = tp is not None and tp.loss_parallel
    seq_shards = tp.seq_shards if tp is not None else 1

    def laid_out(units: Sequence[str]) -> tuple[StageModule, tuple[str, ...]]:
        """This rank's part of ``units``, still on the meta device: sharded over its tp group,
        checkpointed, compiled, cast and replicated or sharded over its dp group; then filled
        (``fill``: only its shards are ever allocated). And the weights whose gradients the tp
        group sums."""
        module = stage_skeleton(meta, units, seq_shards=seq_shards)
        grad_sum = apply_tp(module, mesh, tp) if tp is not None and mesh.tp_mesh is not None else ()
        module = parallelize(module, resolved.train, dp_mode, mesh)
        return fill(meta, module, seed=seed, device=env.device), grad_sum

    if layout.pp == 1:
        whole, grad_sum = laid_out(meta.unit_names)
        unsplit = UnsplitStep(whole, layout.microbatches, loss_fn, mesh=mesh, loss_parallel=loss_parallel,
                              grad_sum=grad_sum)
        return unsplit, TiedWeights([], {}, unsplit.modules, mesh)
    io = _static_io(meta, resolved, example, seq_shards) if example is not None else None
    indices = layout.stages_on(mesh.pp_rank)
    modules, grad_sums = zip(*(laid_out(layout.stages[i]) for i in indices))
    # After tp, which wraps each module's weights in parameters of its own (a pretrained tied weight,
    # already a DTensor, would become two parameters over one storage, each stepped by the optimizer),
    # and after fill, which allocates each stage's on its own. A mode wrapping each stage on its own
    # cannot share a parameter: its copies are summed instead.
    if not DP_MODES[dp_mode].per_stage:
        share_local_copies(modules, meta.tied)
    stages = []
    for index, module in zip(indices, modules):
        n_params = sum(p.numel() for p in module.parameters())
        log.info("stage %d: %s (%d parameters)", index, describe_names(layout.stages[index]), n_params)
        stage = PipelineStage(module, index, layout.num_stages, env.device, group=mesh.pp_group,
                              input_args=io[index][0] if io else None, output_args=io[index][1] if io else None)
        _torch_pp.allow_eval(stage)
        _torch_pp.no_warmup_to_self(stage)
        _torch_pp.check_outputs_as_213(stage)
        stages.append(stage)
    weighted = TargetWeighted(loss_fn)
    schedule = build_schedule(layout.schedule, stages, layout.microbatches, weighted, layout.csv)
    step = PipelinedStep(stages, schedule, layout, mesh, loss_parallel, grad_sums, loss_fn=weighted)
    rank_of = {p: layout.stage_to_rank[s] for s, units in enumerate(layout.stages) for u in units
               for p in _params_of(meta, u)}
    embeddings = {n for names in meta.tied for n in names
                  if any(isinstance(meta.module.get_submodule(x.rpartition(".")[0]), nn.Embedding) for x in names)}
    return step, TiedWeights(meta.tied, rank_of, step.modules, mesh, embedding_names=embeddings)


def _static_io(meta, resolved: ResolvedRun, example: Batch, seq_shards: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each stage's input and output for one microbatch of ``example``, as meta tensors, the
    messages between stages sliced as each tp rank holds them (``seq_shards``)."""
    inputs, _, kwargs = example
    m = resolved.layout.microbatches
    first = {k: v.tensor_split(m)[0] for k, v in kwargs.items()}
    return stage_io(meta, resolved.layout.stages, microbatch=len(inputs.tensor_split(m)[0]), seq_len=inputs.shape[1],
                    kwargs=first, seq_shards=seq_shards)


def _params_of(meta, unit: str) -> list[str]:
    return [f"{m}.{n}" for m in meta.spec.unit(unit).modules
            for n, _ in meta.module.get_submodule(m).named_parameters(remove_duplicate=False)]
