"""What hooks see of a run (a ``StepContext``, never the trainer) and the fault points behind
``runner.faults`` (the training step's hook, a checkpoint's ``before_commit``). In-process, one
rank, the tiny model: each case trains a step or three."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

import runner.faults
from runner.errors import NonFiniteLossError
from runner.faults import commit_fault, fault_hooks
from runner.hooks import Hook, StepContext, StepState
from runner.ranks.dist import DistEnv
from runner.train import Trainer
from runner.validate import validate

from helpers.config import TINY, compose

ONE = [*TINY, "parallel.pp=1", "parallel.microbatches=2", "train.batch_size=4"]
ENV = DistEnv(0, 1, torch.device("cpu"))
POINTS = ("begin_step", "after_backward", "after_reduce", "after_clip")


class Seen(Hook):
    """Every (point, step, context) the trainer called it with."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int, StepContext]] = []

    def begin_step(self, ctx: StepContext, state: StepState) -> None:
        self.calls.append(("begin_step", state.step, ctx))

    def after_backward(self, ctx: StepContext, state: StepState) -> None:
        self.calls.append(("after_backward", state.step, ctx))

    def after_reduce(self, ctx: StepContext, state: StepState) -> None:
        self.calls.append(("after_reduce", state.step, ctx))

    def after_clip(self, ctx: StepContext, state: StepState) -> None:
        self.calls.append(("after_clip", state.step, ctx))


def _trainer(run_dir: Path, *overrides: str, hooks=()) -> Trainer:
    cfg = compose(*ONE, *overrides)
    run_dir.mkdir(parents=True, exist_ok=True)
    return Trainer(validate(cfg, run_dir), cfg, ENV, hooks=hooks)


def test_hooks_get_one_step_context_at_every_point_not_the_trainer(tmp_path):
    seen = Seen()
    trainer = _trainer(tmp_path, "train.steps=2", hooks=[seen])
    trainer.run()
    assert [(point, step) for point, step, _ in seen.calls] == [(p, s) for s in (1, 2) for p in POINTS]
    contexts = {id(ctx) for _, _, ctx in seen.calls}
    assert contexts == {id(trainer.context)}  # built once, in setup
    ctx = trainer.context
    assert isinstance(ctx, StepContext) and not isinstance(ctx, Trainer)
    assert ctx.env is ENV and ctx.mesh is trainer.mesh and ctx.resolved is trainer.resolved and ctx.cfg is trainer.cfg
    assert list(ctx.modules) == trainer.modules and list(ctx.params) == trainer.params
    assert ctx.not_counted == frozenset(trainer.tied.not_counted())
    with pytest.raises(dataclasses.FrozenInstanceError):
        ctx.params = []  # type: ignore[misc]


def test_a_nan_gradient_fault_reaches_the_params_through_the_context(tmp_path, monkeypatch):
    monkeypatch.setenv("RUNNER_FAULT", "nangrad:0:2")
    assert [type(h).__name__ for h in fault_hooks()] == ["TrainFault"] and commit_fault() is None
    with pytest.raises(NonFiniteLossError, match=r"non-finite gradient norm at step 2 \(loss \d"):
        _trainer(tmp_path, "train.steps=3").run()


class Killed(BaseException):
    """Stands in for SIGKILL: ends the run where the fault fires."""


# checkpoint.async_save: the fault fires on the save's background thread, and the run ends at the
# next save's wait for it (here the run's end), the previous checkpoint still the newest.
@pytest.mark.parametrize("mode", [[], ["checkpoint.async_save=true"]], ids=["sync", "async"])
def test_the_commit_fault_fires_on_rank_0_after_every_file_is_written_and_before_the_commit(tmp_path, monkeypatch,
                                                                                             mode):
    monkeypatch.setenv("RUNNER_FAULT", "checkpoint-commit-step-2")
    assert fault_hooks() == []  # not a step fault
    on_disk: list[list[str]] = []

    def kill() -> None:
        checkpoints = tmp_path / "checkpoints"
        on_disk.append(sorted(p.name if p.is_dir() else "?" for p in checkpoints.iterdir()))
        partial = next(checkpoints.glob(".partial-step-2-*"))
        on_disk.append(sorted(p.name for p in partial.iterdir()))
        raise Killed

    monkeypatch.setattr(runner.faults, "_kill", kill)
    with pytest.raises(Killed):
        _trainer(tmp_path, "train.steps=3", "checkpoint.every=1", *mode).run()
    names, partial = on_disk  # step 1 committed, step 2 written in full and not committed
    assert names[1:] == ["step-1"] and names[0].startswith(".partial-step-2-")
    assert {".metadata", "manifest-rank0.json", "train_state.json", "rng-rank0.pt"} <= set(partial)
    assert not (tmp_path / "checkpoints" / "step-2").exists()


@pytest.mark.parametrize("value", [None, "checkpoint-commit-step-x", "raise:0:2", "checkpoint-commit-step-"])
def test_no_commit_fault_unless_runner_fault_names_one(monkeypatch, value):
    if value is None:
        monkeypatch.delenv("RUNNER_FAULT", raising=False)
    else:
        monkeypatch.setenv("RUNNER_FAULT", value)
    assert commit_fault() is None


def test_the_commit_fault_kills_at_its_step_only(monkeypatch):
    monkeypatch.setenv("RUNNER_FAULT", "checkpoint-commit-step-12")
    kills: list[int] = []
    monkeypatch.setattr(runner.faults, "_kill", lambda: kills.append(1))
    before_commit = commit_fault()
    assert before_commit is not None
    for step in (1, 2, 11, 13, 12):
        before_commit(step)
    assert kills == [1]
