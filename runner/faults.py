"""Fault points, for the reliability tests: real failures at chosen places, switched on by the
``RUNNER_FAULT`` environment variable and inert otherwise. Nothing else in the runner knows of
them: the training step meets them as a hook, a checkpoint's save as its ``before_commit`` callback.

``RUNNER_FAULT=<what>:<rank>:<step>`` with ``what`` one of ``raise`` (an exception), ``kill``
(SIGKILL), ``kill-after-backward`` (SIGKILL once the rank's forward and backward are done, before it
adds its share to the step's loss and norm: its peers wait in that reduction, under
``train.optimizer_sync=post_validate`` with their update applied; under ``deferred`` with the previous
step's update applied and not yet validated), ``stall`` (sleep far past the
collective timeout), ``sigstop`` (SIGSTOP in the middle of
the rank's first action of the step, inside its first stage's forward, where its tp peers then wait
in that action's collectives), ``nan`` (a non-finite loss), ``nangrad`` (a finite loss with a
non-finite gradient) or ``double-step`` (that rank's optimizer applies the step's update twice: a
silently wrong run, which only ``verify`` catches), on that rank at that step (numbered from 1, as
in the logs and metrics.jsonl): a hook (``fault_hooks``) the trainer holds only when such a fault is
set. ``RUNNER_FAULT=<what>:<rank>:<step>:<attempt>``: only in that attempt of a job that restarts
(``launch.max_restarts``, torchrun's ``--max-restarts``; the first is 0).
``RUNNER_FAULT=checkpoint-commit-step-<N>`` kills rank 0 between the shard writes and the commit
of step N's checkpoint (``commit_fault``, the callback the trainer hands its ``Checkpointer``).
"""

from __future__ import annotations

import os
import signal
import time
from typing import Callable

import torch

from runner.hooks import Hook, StepContext, StepState
from runner.ranks.restarts import restart_count

__all__ = ["commit_fault", "fault_hooks", "TrainFault"]

_COMMIT = "checkpoint-commit-step-"


def _kill() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _stop_in_forward(module: torch.nn.Module) -> None:
    """SIGSTOP this process as ``module``'s next forward begins (once), as a debugger or a job
    control stop would leave it: its heartbeat says it is inside the action."""

    def stop(*_) -> None:
        handle.remove()
        os.kill(os.getpid(), signal.SIGSTOP)

    handle = module.register_forward_pre_hook(stop)


class TrainFault(Hook):
    """``what`` on ``rank`` at ``step``: raise, kill and stall as the step begins, sigstop in its
    first forward; kill-after-backward, nan and nangrad once its backward has run; double-step once its gradients are
    clipped."""

    def __init__(self, what: str, rank: int, step: int):
        self.what, self.rank, self.step = what, rank, step

    def _due(self, ctx: StepContext, state: StepState) -> bool:
        return (ctx.env.rank, state.step) == (self.rank, self.step)

    def begin_step(self, ctx: StepContext, state: StepState) -> None:
        if not self._due(ctx, state):
            return
        if self.what == "raise":
            raise RuntimeError(f"injected fault on rank {self.rank} at step {self.step}")
        if self.what == "kill":
            _kill()
        if self.what == "stall":
            time.sleep(3600)
        if self.what == "sigstop":
            _stop_in_forward(ctx.modules[0])

    def after_backward(self, ctx: StepContext, state: StepState) -> None:
        if not self._due(ctx, state):
            return
        if self.what == "kill-after-backward":
            _kill()
        if self.what == "nan" and state.local_loss is not None:
            state.local_loss = state.local_loss * float("nan")
        if self.what == "nangrad":  # a finite loss with a non-finite gradient
            next(p.grad for p in ctx.params if p.grad is not None).mul_(float("nan"))

    def after_clip(self, ctx: StepContext, state: StepState) -> None:
        if self._due(ctx, state) and self.what == "double-step":  # the trainer's own step follows
            ctx.optimizer.step()


def fault_hooks() -> list[Hook]:
    """The ``<what>:<rank>:<step>[:<attempt>]`` fault ``RUNNER_FAULT`` sets, if any, and due in this
    attempt of the job (``runner.ranks.restarts.restart_count``; without ``<attempt>``: every one)."""
    spec = os.environ.get("RUNNER_FAULT", "").split(":")
    if len(spec) == 4 and int(spec[3]) != restart_count():
        return []
    return [TrainFault(spec[0], int(spec[1]), int(spec[2]))] if len(spec) in (3, 4) else []


def commit_fault() -> Callable[[int], None] | None:
    """The ``checkpoint-commit-step-<N>`` fault ``RUNNER_FAULT`` sets, if any: a ``before_commit``
    for the ``Checkpointer`` (which calls it on rank 0 only) that kills the process at step N."""
    name = os.environ.get("RUNNER_FAULT", "")
    if not (name.startswith(_COMMIT) and name.removeprefix(_COMMIT).isdigit()):
        return None
    step = int(name.removeprefix(_COMMIT))

    def kill_at(steps_done: int) -> None:
        if steps_done == step:
            _kill()

    return kill_at
