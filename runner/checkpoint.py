"""Checkpoints with torch.distributed.checkpoint (DCP), keyed by full-model parameter names, so a
checkpoint written under one layout (pp, dp, schedule) loads under any other.

A checkpoint counts only once complete. DCP writes shards and then ``.metadata`` into the target
directory, overwriting in place, so every save goes into a fresh ``.partial-*`` directory that rank 0
renames to ``step-N`` once all ranks have written: a crash mid-save leaves the previous checkpoints
untouched and the partial one ignored. DCP reads ``.metadata`` with pickle: load only checkpoints
from a trusted source.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import uuid
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from runner.dist import DistEnv
from runner.errors import ConfigError, RunnerError
from runner.faults import fault_point
from runner.split import StageModule
from runner.tied import TiedWeights

__all__ = ["CheckpointError", "find_checkpoint", "checkpoint_step", "Checkpointer"]

log = logging.getLogger(__name__)

_STEP_DIR = re.compile(r"^step-(\d+)$")
# Optimizer state keyed by parameter name ("state.block0.ffn.up.weight.exp_avg"), not by position.
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


class CheckpointError(RunnerError):
    pass


def _complete(path: Path) -> bool:
    return (path / ".metadata").is_file() and (path / "train_state.json").is_file()


def _steps_in(directory: Path) -> list[Path]:
    found = [p for p in directory.glob("step-*") if _STEP_DIR.match(p.name) and _complete(p)]
    return sorted(found, key=lambda p: int(p.name.split("-")[1]))


def find_checkpoint(resume: str, run_dir: Path) -> Path:
    """The checkpoint directory ``checkpoint.resume`` names (checked before any rank starts)."""
    if resume == "latest":
        outputs = run_dir.parent.parent  # outputs/<date>/<time>: every run under outputs/
        candidates = [c for d in outputs.glob("*/*/checkpoints") for c in _steps_in(d)]
        if not candidates:
            raise ConfigError(f"checkpoint.resume=latest: no complete checkpoint under {outputs}. "
                              "Fix: give a checkpoint or run directory.")
        return max(candidates, key=lambda p: (p / ".metadata").stat().st_mtime)
    path = Path(resume).expanduser().resolve()
    if not path.exists():
        raise ConfigError(f"checkpoint.resume={resume!r}: no such directory. Fix: a checkpoint directory "
                          "(…/checkpoints/step-N), a run directory, or latest.")
    if (path / "checkpoints").is_dir():
        steps = _steps_in(path / "checkpoints")
        if not steps:
            raise ConfigError(f"checkpoint.resume={resume!r}: the run has no complete checkpoint.")
        return steps[-1]
    if not _complete(path):
        raise ConfigError(f"checkpoint.resume={resume!r} is not a complete checkpoint (no .metadata or "
                          "train_state.json: truncated or never committed).")
    try:
        checkpoint_step(path)
    except (ValueError, KeyError) as e:
        raise ConfigError(f"checkpoint.resume={resume!r}: train_state.json is corrupt ({e}).") from e
    return path


def checkpoint_step(path: Path) -> int:
    """Optimizer steps done when the checkpoint was saved."""
    return json.loads((path / "train_state.json").read_text())["step"]


def _named(modules: list[StageModule]) -> StageModule:
    """This rank's stage modules seen as one module holding their units under the full model's
    names, so state-dict keys are the unsplit model's (``block3.attn.qkv.weight``) on every rank."""
    spec = modules[0].spec
    units = [u for m in modules for u in m.units]
    return StageModule(spec, units, {n: m.get_submodule(n) for m in modules for u in m.units
                                     for n in spec.unit(u).modules})


def _renamed(state: dict, stored: dict[str, str], equal: dict[str, str]) -> dict:
    """Model or (flattened) optimizer state with each tied copy stored once, under the unsplit
    model's name: ``stored`` renames a rank's copy, the keys of ``equal``'s copies are dropped."""
    def new_key(key: str) -> str | None:
        for prefix in ("", "state.", "param_groups."):
            for local, canonical in stored.items():
                if key == f"{prefix}{local}" or key.startswith(f"{prefix}{local}."):
                    return f"{prefix}{canonical}{key[len(prefix) + len(local):]}"
            if any(key == f"{prefix}{n}" or key.startswith(f"{prefix}{n}.") for n in equal):
                return None
        return key

    return {k2: v for k, v in state.items() if (k2 := new_key(k)) is not None}


def _fill_copies(state: dict, equal: dict[str, str]) -> None:
    """Give the dropped copies' entries the loaded values of the copy stored in their place."""
    for key in state:
        for prefix in ("", "state.", "param_groups."):
            for copy, rep in equal.items():
                if key == f"{prefix}{copy}" or key.startswith(f"{prefix}{copy}."):
                    source = f"{prefix}{rep}{key[len(prefix) + len(copy):]}"
                    if isinstance(state[key], torch.Tensor):
                        state[key].copy_(state[source])
                    else:
                        state[key] = state[source]


class Checkpointer:
    def __init__(self, cfg, run_dir: Path, env: DistEnv, modules: list[StageModule], optimizer, scheduler,
                 *, tied: TiedWeights | None = None):
        self.every, self.keep = cfg.every, cfg.keep
        self.dir = run_dir / "checkpoints"
        self.env = env
        self.model = _named(modules)
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.stored, self.equal = tied.renames() if tied else ({}, {})

    def _local_state(self) -> dict:
        return {
            "model": get_model_state_dict(self.model, options=_OPTIONS),
            "optim": get_optimizer_state_dict(self.model, self.optimizer, options=_OPTIONS),
        }

    def _state(self) -> dict:
        return {k: _renamed(v, self.stored, self.equal) for k, v in self._local_state().items()}

    def maybe_save(self, steps_done: int) -> None:
        if self.every and steps_done % self.every == 0:
            self.save(steps_done)

    def save(self, steps_done: int) -> None:
        name = [f".partial-step-{steps_done}-{uuid.uuid4().hex[:8]}"]
        if self.env.world_size > 1:
            dist.broadcast_object_list(name, src=0)
        partial = self.dir / name[0]
        partial.mkdir(parents=True, exist_ok=True)
        dcp.save(self._state(), checkpoint_id=str(partial))
        if self.env.is_main and hasattr(self.model.spec, "save_metadata"):  # what runner.export needs
            self.model.spec.save_metadata(partial / "hf")
        torch.save(torch.get_rng_state(), partial / f"rng-rank{self.env.rank}.pt")
        if self.env.world_size > 1:
            dist.barrier()  # every rank's shards are on disk
        if self.env.is_main:
            (partial / "train_state.json").write_text(json.dumps(
                {"step": steps_done, "world_size": self.env.world_size, "lr_scheduler": self.scheduler.state_dict()}))
            fault_point(f"checkpoint-commit-step-{steps_done}", self.env.rank)
            final = self.dir / f"step-{steps_done}"
            if final.exists():
                shutil.rmtree(final)
            partial.rename(final)  # the commit: atomic on one filesystem
            for old in _steps_in(self.dir)[:-self.keep]:
                shutil.rmtree(old)
            log.info("checkpoint saved: %s", final)
        if self.env.world_size > 1:
            dist.barrier()

    def load(self, path: Path) -> int:
        """Restore model, optimizer, LR schedule and (same world size) RNG; returns steps done.
        The data position is the step: every batch is a function of (seed, step)."""
        train_state = json.loads((path / "train_state.json").read_text())
        local = self._local_state()
        stored = {k: _renamed(v, self.stored, self.equal) for k, v in local.items()}  # the same tensors
        try:
            dcp.load(stored, checkpoint_id=str(path))
        except (Exception, CheckpointException) as e:  # the latter is a BaseException
            raise CheckpointError(f"checkpoint {path} could not be loaded: {e}") from e
        for key in local:  # values DCP placed in new objects (non-tensor entries), and the tied copies
            renamed = _renamed({k: k for k in local[key]}, self.stored, self.equal)
            local[key].update({orig: stored[key][new] for new, orig in renamed.items()})
            _fill_copies(local[key], self.equal)
        set_model_state_dict(self.model, local["model"], options=_OPTIONS)
        set_optimizer_state_dict(self.model, self.optimizer, local["optim"], options=_OPTIONS)
        steps_done = train_state["step"]
        self.scheduler.load_state_dict(train_state["lr_scheduler"])
        rng = path / f"rng-rank{self.env.rank}.pt"
        if train_state["world_size"] == self.env.world_size and rng.is_file():
            torch.set_rng_state(torch.load(rng, weights_only=True))
        log.info("resumed from %s at step %d", path, steps_done)
        return steps_done
