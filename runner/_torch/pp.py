"""Every use of torch's private pipelining internals, in one place.

torch.distributed.pipelining keeps its schedule IR (``_Action``), its CSV runtime and its schedule
validator private; when a torch release moves them, this file is the one to change. Tested with
torch 2.13, and with 2.11 (the GPU image's) on CPU.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Callable, Mapping, Sequence, cast
from unittest import mock

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import schedules as _schedules
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight
from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping
from torch.distributed.pipelining.schedules import (
    _Action,
    _add_send_recv,
    _ComputationType,
    _PipelineScheduleRuntime,
    _simulate_comms_compute,
    _validate_schedule,
)

__all__ = [
    "Action",
    "stage_to_rank_mapping",
    "stand_in_stages",
    "to_actions",
    "check_actions",
    "csv_schedule",
    "replicate",
    "allow_eval",
    "check_outputs_as_213",
    "no_warmup_to_self",
    "backward_input",
    "backward_weight",
]

Action = _Action


def stage_to_rank_mapping(pp: int, num_stages: int, *, v_shape: bool) -> dict[int, int]:
    return generate_stage_to_rank_mapping(pp, num_stages, style="v" if v_shape else "loop")


def stand_in_stages(pp: int, num_stages: int, num_local: int, *, compiled: bool = False) -> list:
    """Stand-ins for ``PipelineStage`` that let a schedule class be constructed (and so run its
    own argument checks and compute its action order) without processes or a model, the way
    torch's own schedule visualizer does. ``compiled`` gives them a ``torch.compile``d module
    (never called, so nothing compiles), for the schedules' own compile check."""
    stage = mock.create_autospec(PipelineStage, instance=True)
    stage.group_rank = 0
    stage.group_size = pp
    stage.num_stages = num_stages
    # torch.compile(module) returns an OptimizedModule (a module), though typed as a callable.
    stage.submod = torch.nn.Sequential(cast(torch.nn.Module, torch.compile(torch.nn.Identity()))) if compiled else None
    return [stage] * num_local


def to_actions(order: Mapping[int, Sequence]) -> dict[int, list[_Action]]:
    """torch's actions for a compute-only order (``runner.pipeline.ops.Op``s per rank)."""
    return {rank: [_Action(op.stage, _ComputationType(op.kind), op.microbatch) for op in ops]
            for rank, ops in order.items()}


def check_actions(actions: dict[int, list[_Action]], num_stages: int, microbatches: int) -> dict[int, int]:
    """torch's validator (every F before its B/I, I before W, counts per stage) followed by a
    dry run with the communication it implies, which fails on a schedule that would deadlock.
    Returns the stage-to-rank placement the file implies."""
    pp = len(actions)
    # Typed as taking idle (None) slots too; a list of actions is one, but list is invariant.
    stage_to_rank = _validate_schedule(actions, pp, num_stages, microbatches)  # type: ignore[arg-type]
    with_comms = _add_send_recv(actions, stage_to_rank=lambda s: stage_to_rank[s], num_stages=num_stages)
    _simulate_comms_compute(with_comms, lambda s: stage_to_rank[s], num_stages)
    return stage_to_rank


class _LossesByMicrobatch(_PipelineScheduleRuntime):
    """torch's schedule runtime with each microbatch's loss kept under its own index. torch (2.11,
    2.13) appends a last stage's losses in the order its forwards run and hands the backward of
    microbatch ``i`` the ``i``-th loss appended: an order whose last stage runs its forwards out of
    microbatch order (``1F1,1F0,1B1,1B0``: valid, and torch's validator accepts it) backpropagated
    one microbatch's loss through another's activations and trained to other numbers without a word
    (or failed, where a backward came before the forward of a lower microbatch). Its own schedules
    run the last stage's forwards in order, where this changes nothing."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._loss_microbatches: list[int] = []  # the microbatch of each loss in _internal_losses

    def _maybe_compute_loss(self, stage, output, target_mbs, mb_index, *args, **kwargs):
        before = len(self._internal_losses)
        super()._maybe_compute_loss(stage, output, target_mbs, mb_index, *args, **kwargs)
        if len(self._internal_losses) > before:
            self._loss_microbatches.append(mb_index)

    def _maybe_get_loss(self, stage, mb_index):
        if not (stage.is_last and self._loss_fn is not None):
            return None
        if mb_index not in self._loss_microbatches:
            raise RuntimeError(f"the loss of microbatch {mb_index} is not computed yet: its last stage's forward "
                               f"has not run (forwards run: microbatches {self._loss_microbatches})")
        return self._internal_losses[self._loss_microbatches.index(mb_index)]

    def _update_losses(self, stages, losses):
        by_microbatch = sorted(zip(self._loss_microbatches, self._internal_losses), key=lambda pair: pair[0])
        self._internal_losses[:] = [loss for _, loss in by_microbatch]
        self._loss_microbatches.clear()
        return super()._update_losses(stages, losses)


def csv_schedule(stages: list, microbatches: int, loss_fn: Callable, order: Mapping[int, Sequence]):
    """The schedule runtime executing a compute-only order (read from a file by
    ``runner.pipeline.csv_file``): what ``_load_csv(format="compute_only")`` does after reading, so
    torch lowers it with the sends, receives, FSDP unshard/reshard and the gradient reduce. Each
    microbatch's backward gets its own loss in any order (``_LossesByMicrobatch``)."""
    schedule = _LossesByMicrobatch(stages, microbatches, loss_fn=loss_fn, scale_grads=False)
    for rank, actions in to_actions(order).items():
        schedule.pipeline_order[rank] = list(actions)  # as torch's type: a list that may hold idle (None) slots
    schedule._prepare_schedule_with_comms(schedule.pipeline_order)
    return schedule


def allow_eval(stage: PipelineStage) -> None:
    """Let ``schedule.eval()`` run V-shaped schedules (ZBV, DualPipeV). In torch 2.13 the runtime
    still performs the backward actions in eval (each a no-op without backward), but then hands
    the absent input gradient to the same-rank previous stage, which asserts. Without backward,
    that hand-off becomes a no-op too; with backward nothing changes."""
    get, put = stage.get_local_bwd_output, stage.set_local_bwd_input
    # Replaced on this one stage object (not its class): mypy refuses assigning to a method.
    stage.get_local_bwd_output = (  # type: ignore[method-assign]
        lambda mb_index: get(mb_index) if stage.has_backward else ())
    stage.set_local_bwd_input = (  # type: ignore[method-assign]
        lambda next_stage_bwd_outputs, mb_index: put(next_stage_bwd_outputs, mb_index) if stage.has_backward else None)


def check_outputs_as_213(stage: PipelineStage) -> None:
    """A stage checks its forward's outputs as torch 2.13 does: never the last stage's (they go to
    the loss, not to a peer), the others' only with ``TORCH_DISTRIBUTED_DEBUG=DETAIL``. Before 2.12
    (2.11 on the GPU image) every stage checked its outputs on every forward against its metadata,
    which need not describe them: inferred by a forward on meta tensors, contiguous, where the real
    output is a view (a vocabulary-parallel head's logits cut from its padded gather: "Stage 1 forward
    outputs: value 0 has a stride mismatch: expected (1008, 63, 1) actual (1024, 64, 1)"), or static
    with the meta pass's dtypes, not the autocast's (a rehearsal's bf16 logits: "dtype mismatch:
    expected torch.float32 actual torch.bfloat16"). A torch without that method keeps its own rule."""
    check = getattr(stage, "_validate_fwd_outputs", None)
    if check is None:
        return

    def as_213(outputs) -> None:
        if not stage.is_last and dist.get_debug_level() == dist.DebugLevel.DETAIL:
            check(outputs)

    stage._validate_fwd_outputs = as_213  # type: ignore[attr-defined]  # torch < 2.12's method, not in 2.13's stubs


def no_warmup_to_self(stage: PipelineStage) -> None:
    """Leave out the messages a stage's warm-up would send to its own rank. torch 2.11's schedules
    open their first step with a message to and from each neighbouring stage
    (``_get_init_p2p_neighbors_ops``), also where the neighbour is on the same rank (a V-shaped
    placement's middle stages: ZBV, DualPipeV), which gloo refuses ("Pair is not connected ...
    <--> [none]"): every V-shaped run on CPU failed at its first step. A rank needs no link to itself.
    torch 2.13 warms stages up by its static/dynamic vote instead (the method is left for other stage
    types, and so is this filter)."""
    ops_of = stage._get_init_p2p_neighbors_ops

    def to_others() -> list[dist.P2POp]:
        return [op for op in ops_of() if op.group_peer != stage.group_rank]

    stage._get_init_p2p_neighbors_ops = to_others  # type: ignore[method-assign]


def backward_input(output: torch.Tensor, output_grad: torch.Tensor | None, inputs: list[torch.Tensor],
                   module: torch.nn.Module) -> list[dict]:
    """What a zero-bubble stage's I runs: the input gradient only, keeping what its W needs.
    Returns the parameter groups to hand to ``backward_weight``."""
    _, param_groups = stage_backward_input([output], None if output_grad is None else [output_grad], inputs,
                                           module.parameters())
    return param_groups


def backward_weight(module: torch.nn.Module, param_groups: list[dict]) -> None:
    """What a zero-bubble stage's W runs after its I: the weight gradients, group by group."""
    stage_backward_weight(module.parameters(), param_groups)


def replicate(module, *, mesh):
    """torch's FSDP-based replicate (DDP semantics). Unlike ``DistributedDataParallel`` it also
    reduces the gradients that zero-bubble schedules' weight-backward sets directly."""
    from torch.distributed._composable.replicate_with_fsdp import replicate as _replicate

    return _replicate(module, mesh=mesh)


_wait_p2p = _schedules._wait_batch_p2p  # torch's own


def mark_p2p_waits(waiting: Callable[[str], AbstractContextManager[None]]) -> None:
    """Run every wait of torch's schedules for their sends and receives (``_wait_batch_p2p``,
    which every schedule and the CSV runtime call by its module's name) inside ``waiting(what)``
    (``runner.ranks.watchdog.waiting``): the launcher then tells a rank waiting for its pipeline
    neighbour's message from one that stalled. Process-wide: wraps torch's own function, once."""

    def marked(work: list) -> None:
        with waiting("a message of the pipeline schedule"):
            _wait_p2p(work)

    _schedules._wait_batch_p2p = marked
