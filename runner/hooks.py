"""Hooks: what runs inside a training step but is not training. The ``Trainer`` (``runner.train``)
calls every hook it holds at five points of each step, in order, on every rank, and merges what
they report into the summary. ``verify`` (``runner.verify.hook``), fault injection (``runner.faults``)
and the tests' gradient probes are hooks; the loop itself has no test seams.

A hook sees the run through a ``StepContext`` (built once, after the trainer's setup) and the step
through a ``StepState``; never the trainer itself, so what a hook may read and touch is written
here, and this module imports nothing of the runner at run time.

A hook that runs a collective (gathering gradients) must run it on every rank at the same point:
the Trainer calls the hooks in the same order everywhere."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

if TYPE_CHECKING:
    import torch
    from omegaconf import DictConfig

    from runner.layout import ResolvedRun
    from runner.models.split import StageModule
    from runner.parallel.mesh import Mesh
    from runner.ranks.dist import DistEnv

__all__ = ["StepContext", "StepState", "Hook"]


@dataclass(frozen=True)
class StepContext:
    """The run as the hooks see it, the same at every step."""

    env: DistEnv  # this rank
    mesh: Mesh  # its place in the layout, and its groups
    modules: Sequence[StageModule]  # this rank's stages, by full-model parameter names
    params: Sequence[torch.nn.Parameter]  # their parameters (a weight two local stages share: once)
    not_counted: frozenset[str]  # tied copies the global gradient norm skips (``TiedWeights.not_counted``)
    optimizer: torch.optim.Optimizer  # this rank's AdamW (verify copies a resumed run's state; rehearsals measure it)
    scheduler: torch.optim.lr_scheduler.LRScheduler  # its LR schedule
    resolved: ResolvedRun  # the resolved run: layout, resume, verify
    cfg: DictConfig  # the composed config: what verify builds its unsplit reference from


@dataclass
class StepState:
    """One optimizer step as the hooks see it."""

    step: int  # numbered from 1, as in the logs and metrics.jsonl
    first: bool  # the first step this run trains (after a resume: the one after the checkpoint)
    batch: tuple  # the global batch: inputs, targets, keyword inputs (every replica's rows)
    local_loss: torch.Tensor | None = None  # this rank's loss (the last stage's ranks), before the reduction
    loss: float | None = None  # the step's loss, the same on every rank
    grad_norm: float | None = None  # the global gradient norm, before clipping


class Hook:
    """Override what you need; each point gets the run's context and the step."""

    def begin_step(self, ctx: StepContext, state: StepState) -> None:
        """Before the step's forward and backward."""

    def after_backward(self, ctx: StepContext, state: StepState) -> None:
        """After the pipelined forward and backward, before the loss and the gradient norm are
        reduced over the ranks (``state.local_loss`` may be replaced)."""

    def after_reduce(self, ctx: StepContext, state: StepState) -> None:
        """The step's loss and norm known and finite; gradients not yet clipped. Not yet applied
        under ``train.optimizer_sync=barrier``; under ``post_validate`` the unclipped update
        already is (docs/optimizer-sync.md). Under ``deferred``, step k's ``after_reduce``,
        ``after_clip`` and ``after_step`` run during step k+1, after its ``begin_step`` and
        ``after_backward``, with step k's gradients in place."""

    def after_clip(self, ctx: StepContext, state: StepState) -> None:
        """Gradients clipped to ``train.grad_clip``; the optimizer has not stepped (under
        ``post_validate``: on a step the clip left alone, it has, unclipped; on one it clipped, the
        speculative update is undone and the clipped one follows)."""

    def after_step(self, ctx: StepContext, state: StepState) -> None:
        """The optimizer and the LR schedule have stepped: the parameters hold the step's update."""

    def summary(self) -> dict[str, Any]:
        """Entries for rank 0's ``summary.json`` (e.g. ``verify``'s report)."""
        return {}
