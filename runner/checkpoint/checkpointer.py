"""Checkpoints with torch.distributed.checkpoint (DCP), keyed by full-model parameter names, so a
checkpoint written under one layout (pp, dp, schedule) loads under any other.

A checkpoint counts only once complete. DCP writes shards and then ``.metadata`` into the target
directory, overwriting in place, so every save goes into a fresh ``.partial-*`` directory that rank 0
renames to ``step-N`` once all ranks have written: a crash mid-save leaves the previous checkpoints
untouched and the partial one ignored (and removed when a run next starts in that directory). A
save that fails (a full disk) removes its partial directory and ends the run with the reason.

Integrity: at the commit each rank writes ``manifest-rank<R>.json``, the size and sha256 of every
file it wrote (``runner.checkpoint.files``: finding, completeness, manifests, run locks); a resume
checks them and names the file that does not match. This detects damage,
not forgery: whoever can write the checkpoint can rewrite its manifests. Loading runs no code from
the checkpoint either way (``runner._torch.dcp``): ``.metadata`` and the non-tensor entries are
unpickled by allowlist. A checkpoint never holds a non-finite value: the save refuses them.

``checkpoint.async_save``: DCP's ``async_save`` copies the rank's state into CPU memory (the step
waits for that copy only) and writes it on a thread of its own; the save's end (the manifest, the
agreement, the commit) runs on another, after the writes, with its collectives (DCP's and ours) on
a gloo group made for them (``runner.ranks.dist.new_cpu_group``): never among the training's. The
rules above hold as they do for a save in the foreground: a crash before the commit leaves the
previous checkpoint the newest. The next save first waits for this one, and so does the run's end.
"""

from __future__ import annotations

import errno
import json
import logging
import shutil
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

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
from torch.distributed.tensor import DTensor

from runner._torch.dcp import (
    SafePlanner,
    SafeReader,
    UnsafeCheckpointError,
    read_rng_state,
    refusal,
    root_causes,
)
from runner.checkpoint.files import (
    CUDA_RNG_PREFIX,
    complete_steps,
    files_of,
    manifest_problems,
    read_train_state,
    write_manifest,
)
from runner.checkpoint.resume_check import copy_tokenizer, data_position, tokenizer_record
from runner.errors import CheckpointError, NonFiniteLossError
from runner.models.split import StageModule
from runner.parallel.tied import TiedWeights
from runner.ranks.dist import DistEnv, new_cpu_group
from runner.ranks.watchdog import busy

__all__ = ["verify_checkpoint", "Checkpointer", "save_rng_state", "load_rng_state"]

log = logging.getLogger("runner.checkpoint")  # named as before runner/ became packages (runner.log)

# Optimizer state keyed by parameter name ("state.block0.ffn.up.weight.exp_avg"), not by position.
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def _gather(obj, env: DistEnv, group=None) -> list:
    if env.world_size == 1:
        return [obj]
    out = [None] * env.world_size
    dist.all_gather_object(out, obj, group=group)
    return out


def verify_checkpoint(path: Path, saved_world_size: int, env: DistEnv) -> None:
    """Check every file of ``path`` against its manifest, the hashing shared among the ranks;
    every rank raises the same ``CheckpointError`` if one does not match."""
    mine = [r for r in range(saved_world_size) if r % env.world_size == env.rank]
    problems = [p for found in _gather([p for r in mine for p in manifest_problems(path, r)], env) for p in found]
    if problems:
        more = f" (and {len(problems) - 1} more problems)" if len(problems) > 1 else ""
        raise CheckpointError(f"checkpoint {path} is damaged: {problems[0]}{more}. Nothing was loaded. Fix: "
                              "resume from an older checkpoint of that run, or restore the file.")


# -- saving and loading ------------------------------------------------------------------------

def _named(modules: list[StageModule]) -> StageModule:
    """This rank's stage modules seen as one module holding their units under the full model's
    names, so state-dict keys are the unsplit model's (``block3.attn.qkv.weight``) on every rank."""
    spec = modules[0].spec
    units = [u for m in modules for u in m.units]
    return StageModule(spec, units, {n: m.get_submodule(n) for m in modules for u in m.units
                                     for n in spec.unit(u).modules})


def _shared_names(model: StageModule) -> dict[str, str]:
    """Each second name of a parameter the module holds under two (an embedding and head tied in
    one stage, or in the unsplit model at pp=1) -> its first: stored once, under the first name,
    as a tied weight is stored whatever the layout, so pp=1 and pp>1 checkpoints load into each
    other."""
    first: dict[int, str] = {}
    return {name: f for name, p in model.named_parameters(remove_duplicate=False)
            if (f := first.setdefault(id(p), name)) != name}


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


def _non_finite(state: dict) -> list[str]:
    names = []
    for group, entries in state.items():
        for key, value in entries.items():
            if isinstance(value, DTensor):
                value = value.to_local()
            if isinstance(value, torch.Tensor) and value.is_floating_point() and not torch.isfinite(value).all():
                names.append(f"{group}.{key}")
    return names


def _save_failure(error: BaseException, rank: int) -> str:
    """One line for a failed write: ENOSPC said plainly, with the file it hit."""
    for failed_rank, exc in root_causes(error):
        if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
            return f"no space left on device (rank {rank if failed_rank is None else failed_rank}: {exc})"
    failed_rank, exc = root_causes(error)[0]
    return f"rank {rank if failed_rank is None else failed_rank}: {type(exc).__name__}: {exc}"


def _load_failure(path: Path, error: BaseException) -> str:
    rank, exc = root_causes(error)[0]
    where = "" if rank is None else f" (rank {rank})"
    if isinstance(exc, UnsafeCheckpointError):
        return refusal(path, exc, where)
    first_line = (str(exc).strip().splitlines() or [""])[0]
    return f"checkpoint {path} could not be loaded{where}: {type(exc).__name__}: {first_line}"


@contextmanager
def _empty_param_groups_set_aside(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """torch 2.13's ``set_optimizer_state_dict`` indexes the first parameter of every group and
    fails (IndexError) on an empty one, e.g. the no-decay group with ``train.no_decay=[]`` or on a
    stage without biases or norms. Such groups hold no state: hide them during the load and put
    them back in place."""
    groups = optimizer.param_groups
    empty = {i for i, g in enumerate(groups) if not g["params"]}
    if not empty:
        yield
        return
    optimizer.param_groups = [g for g in groups if g["params"]]
    try:
        yield
    finally:
        loaded = iter(optimizer.param_groups)
        optimizer.param_groups = [groups[i] if i in empty else next(loaded) for i in range(len(groups))]


# What the config sets in each AdamW group, by the key that sets it (train.lr is the schedule's
# base); a checkpoint's state dict carries its own run's values of them.
_CONFIGURED = {"initial_lr": "train.lr", "weight_decay": "train.weight_decay", "betas": "train.betas"}


def _value(v: object) -> object:
    return list(v) if isinstance(v, (list, tuple)) else v  # betas: a tuple here, a list once loaded


def _load_schedule(optimizer: torch.optim.Optimizer, scheduler, saved: dict, configured: list[dict],
                   path: Path, *, main: bool) -> None:
    """The LR schedule's position from the checkpoint, with this run's ``train.*`` values: a loaded
    optimizer and schedule carry the saving run's ``lr``, ``weight_decay`` and ``betas``, and a
    resume with another ``train.lr`` trained on at the old one while its config said the new. The
    position (``last_epoch``) is the checkpoint's; each group's learning rate is recomputed from
    this run's base and schedule (the same bits as the saved one where nothing changed)."""
    changed = sorted({f"{name}: {_value(group[key])} there, {_value(mine[key])} here"
                      for group, mine in zip(optimizer.param_groups, configured)
                      for key, name in _CONFIGURED.items() if _value(group[key]) != _value(mine[key])})
    if changed and main:  # the same on every rank: said once
        log.warning("checkpoint.resume: %s was saved with other optimizer settings; training goes on with this "
                    "run's (%s)", path, "; ".join(changed))
    for group, mine in zip(optimizer.param_groups, configured):
        group.update(mine)
    bases = [mine["initial_lr"] for mine in configured]
    lrs = [base * factor(saved["last_epoch"]) for base, factor in zip(bases, scheduler.lr_lambdas)]  # as LambdaLR
    for group, lr in zip(optimizer.param_groups, lrs):
        group["lr"] = lr
    scheduler.load_state_dict({**saved, "base_lrs": bases, "_last_lr": lrs})  # _last_lr: get_last_lr()'s


def save_rng_state(directory: Path, rank: int, device: torch.device) -> None:
    """The rank's generators' states: the CPU's (``rng-rank<R>.pt``) and, on a GPU, its device's
    (``cuda-rng-rank<R>.pt``), which dropout draws from there: a checkpoint held the CPU's alone, so
    a GPU run resumed with the masks of its first steps, not the uninterrupted run's."""
    torch.save(torch.get_rng_state(), directory / f"rng-rank{rank}.pt")
    if device.type == "cuda":
        torch.save(torch.cuda.get_rng_state(device), directory / f"{CUDA_RNG_PREFIX}{rank}.pt")


def load_rng_state(directory: Path, rank: int, device: torch.device) -> None:
    """What ``save_rng_state`` wrote, through the safe reader (a device's state where this rank has
    that device and the checkpoint holds one)."""
    cpu, cuda = directory / f"rng-rank{rank}.pt", directory / f"{CUDA_RNG_PREFIX}{rank}.pt"
    if cpu.is_file():
        torch.set_rng_state(read_rng_state(cpu))
    if device.type == "cuda" and cuda.is_file():
        torch.cuda.set_rng_state(read_rng_state(cuda), device)


class Checkpointer:
    def __init__(self, cfg, run_dir: Path, env: DistEnv, modules: list[StageModule], optimizer, scheduler,
                 *, tied: TiedWeights | None = None, run_config=None, train_windows: int | None = None,
                 before_commit: Callable[[int], None] | None = None):
        """``run_config``: the run's whole config, for what a checkpoint records of it: the
        tokenizer it trains with (files and digest: export ships it, a resume checks it) and
        ``model.path`` (export never writes over it); ``train_windows``: the windows of its data's
        training split, recorded with the data position (a resume compares). ``before_commit(step)``:
        called on rank 0 once every rank's files of that step are written, just before the rename
        that commits them (the reliability tests kill the run there: ``runner.faults``)."""
        self.before_commit = before_commit
        self.every, self.keep = cfg.every, cfg.keep
        self.tokenizer = tokenizer_record(run_config.data.get("tokenizer")) if run_config is not None else None
        model_path = run_config.model.get("path") if run_config is not None else None
        self.model_path = str(Path(model_path).expanduser().resolve()) if model_path else None
        self.data_position = data_position(run_config, train_windows) if run_config is not None else None
        self.dir = run_dir / "checkpoints"
        self.env = env
        self.model = _named(modules)
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.stored, self.equal = tied.renames() if tied else ({}, {})
        self.equal.update({n: f for n, f in _shared_names(self.model).items() if n not in self.stored})
        self.last_good: Path | None = None  # the newest checkpoint this run saved or resumed from
        # checkpoint.async_save: DCP's background save, whose end (manifest, commit) runs on a thread
        # of ours and whose collectives on a gloo group of their own, made here on every rank.
        self.async_save = bool(cfg.async_save and cfg.every)
        self.group = new_cpu_group(env) if self.async_save else None
        self.executor = (ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-commit")
                         if self.async_save else None)
        self.pending: tuple[int, Future] | None = None  # (step, its commit) of the save in flight
        self.blocked_s: list[float] = []  # per save: how long its caller waited (in save, or in wait after it)
        if env.is_main:
            self._remove_partials()

    def _remove_partials(self) -> None:
        """Partial directories of saves that crashed hold space and are never loaded. Only this
        run writes here (``runner.rundir.hold_run_lock``)."""
        for partial in self.dir.glob(".partial-step-*"):
            shutil.rmtree(partial, ignore_errors=True)
            log.warning("removed %s, left by a checkpoint save that did not finish", partial)

    def _local_state(self) -> dict:
        return {
            "model": get_model_state_dict(self.model, options=_OPTIONS),
            "optim": get_optimizer_state_dict(self.model, self.optimizer, options=_OPTIONS),
        }

    def _state(self) -> dict:
        return {k: _renamed(v, self.stored, self.equal) for k, v in self._local_state().items()}

    def due(self, steps_done: int) -> bool:
        """Whether ``maybe_save`` saves after step ``steps_done``."""
        return bool(self.every) and steps_done % self.every == 0

    def maybe_save(self, steps_done: int) -> None:
        if self.due(steps_done):
            self.save(steps_done)

    def _agree(self, problem: tuple[str, str] | None, partial: Path, steps_done: int, group=None) -> None:
        """Every rank learns whether any rank failed, and all raise the same error."""
        failed = next((p for p in _gather(problem, self.env, group) if p is not None), None)
        if failed is None:
            return
        if self.env.is_main:
            shutil.rmtree(partial, ignore_errors=True)
        kind, text = failed
        last = f"the last good checkpoint is {self.last_good}" if self.last_good else "no checkpoint was saved before"
        if kind == "non-finite":
            raise NonFiniteLossError(f"checkpoint step-{steps_done} was not written: non-finite values in {text}; "
                                     f"{last}. Fix: a lower train.lr or a tighter train.grad_clip.")
        fix = ("free space there, a smaller checkpoint.keep or a larger checkpoint.every, or hydra.run.dir=<a "
               "larger filesystem>" if text.startswith("no space left") else "make that directory writable")
        raise CheckpointError(f"checkpoint step-{steps_done} was not saved in {self.dir}: {text}. The partial "
                              f"checkpoint was removed; {last}. Fix: {fix}.")

    def _begin(self, steps_done: int) -> tuple[Path, dict]:
        """A fresh partial directory (its name from rank 0) and this rank's state, checked finite
        on every rank before anything is written."""
        name = [f".partial-step-{steps_done}-{uuid.uuid4().hex[:8]}"]
        if self.env.world_size > 1:
            dist.broadcast_object_list(name, src=0)
        partial = self.dir / name[0]
        state = self._state()
        problem = None
        bad = _non_finite(state)
        if bad:
            more = " and more" if len(bad) > 3 else ""
            problem = ("non-finite", f"{', '.join(bad[:3])}{more} (rank {self.env.rank})")
        else:
            try:
                partial.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                problem = ("save", _save_failure(e, self.env.rank))
        self._agree(problem, partial, steps_done)
        return partial, state

    def _write_small_files(self, partial: Path, steps_done: int) -> None:
        """What a checkpoint holds beside DCP's files, as of now: this rank's RNG state and, on
        rank 0, the train state (step, LR schedule), a Hugging Face model's metadata, the tokenizer."""
        if self.env.is_main and hasattr(self.model.spec, "save_metadata"):  # what runner.export needs
            self.model.spec.save_metadata(partial / "hf")
        save_rng_state(partial, self.env.rank, self.env.device)
        if self.env.is_main:
            copy_tokenizer(self.tokenizer, partial)
            (partial / "train_state.json").write_text(json.dumps(
                {"step": steps_done, "world_size": self.env.world_size, "lr_scheduler": self.scheduler.state_dict(),
                 "tokenizer": self.tokenizer, "model_path": self.model_path, "data_position": self.data_position}))

    def _commit(self, partial: Path, steps_done: int, group=None) -> None:
        """Once every rank's files are on disk: rank 0 renames the partial directory to ``step-N``
        (atomic on one filesystem) and drops the checkpoints past ``keep``; then every rank knows it."""
        final = self.dir / f"step-{steps_done}"
        if self.env.is_main:
            if self.before_commit is not None:
                self.before_commit(steps_done)
            if final.exists():
                shutil.rmtree(final)
            partial.rename(final)  # the commit
            for old in complete_steps(self.dir, log_skipped=False)[:-self.keep]:
                shutil.rmtree(old)
            log.info("checkpoint saved: %s", final)
        if self.env.world_size > 1:
            dist.barrier(group=group)
        self.last_good = final

    def save(self, steps_done: int) -> None:
        """Checkpoint ``step-N``: written and committed before this returns or, with
        ``checkpoint.async_save``, in the background (``wait`` for it) once the previous save is done."""
        start = time.perf_counter()
        try:
            self._save(steps_done)
        finally:
            self.blocked_s.append(time.perf_counter() - start)

    def _save(self, steps_done: int) -> None:
        self._wait()
        busy(f"saving checkpoint step-{steps_done}")
        partial, state = self._begin(steps_done)
        problem = None
        upload = None
        try:  # DCP gathers a failure on any rank and raises it on every rank
            self._write_small_files(partial, steps_done)
            if self.async_save:
                upload = dcp.async_save(state, checkpoint_id=str(partial), process_group=self.group)
            else:
                dcp.save(state, checkpoint_id=str(partial))
                write_manifest(partial, self.env.rank, files_of(partial, self.env.rank, self.env.is_main))
        except (Exception, CheckpointException) as e:  # the latter is a BaseException
            problem = ("save", _save_failure(e, self.env.rank))
        self._agree(problem, partial, steps_done)  # also: every rank's files are on disk (a sync save)
        if upload is None:
            self._commit(partial, steps_done)
            return
        assert self.executor is not None
        self.pending = (steps_done, self.executor.submit(self._finish_in_background, upload, partial, steps_done))

    def _finish_in_background(self, upload, partial: Path, steps_done: int) -> None:
        """An asynchronous save's end, on its own thread and its own group (``new_cpu_group``): wait
        for DCP's writes, write the manifest, agree, commit. Its errors reach ``wait``."""
        problem = None
        try:
            upload.result()
            write_manifest(partial, self.env.rank, files_of(partial, self.env.rank, self.env.is_main))
        except (Exception, CheckpointException) as e:
            problem = ("save", _save_failure(e, self.env.rank))
        self._agree(problem, partial, steps_done, self.group)
        self._commit(partial, steps_done, self.group)

    def wait(self) -> None:
        """Until the asynchronous save in flight, if any, is committed; its error, if it failed
        (the same on every rank)."""
        if self.pending is None:
            return
        start = time.perf_counter()
        try:
            self._wait()
        finally:
            self.blocked_s[-1] += time.perf_counter() - start  # the last save's, which it waited for

    def _wait(self) -> None:
        if self.pending is None:
            return
        steps_done, future = self.pending
        self.pending = None
        busy(f"waiting for checkpoint step-{steps_done} to be written")
        future.result()

    def abandon(self) -> None:
        """A failed run's end: the background thread goes (left idle, a later launch from this
        process spawned its ranks instead of forking them; a save in flight went on writing after
        the run had raised). One rank lets the save in flight end first (it has no peer to agree
        with); with several, a peer may be gone: that save ends with the process."""
        if self.executor is not None:
            self.executor.shutdown(wait=self.env.world_size == 1, cancel_futures=True)

    def close(self) -> None:
        """After the last ``wait``: the background thread and group go."""
        if self.executor is not None:
            self.executor.shutdown(wait=True)
        if self.group is not None:
            dist.destroy_process_group(self.group)
            self.group = None

    def load(self, path: Path) -> int:
        """Restore model, optimizer, LR schedule and (same world size) RNG; returns steps done.
        The data position is the step: every batch is a function of (seed, step)."""
        busy(f"loading checkpoint {path}")
        train_state = read_train_state(path)
        verify_checkpoint(path, train_state["world_size"], self.env)
        local = self._local_state()
        stored = {k: _renamed(v, self.stored, self.equal) for k, v in local.items()}  # the same tensors
        reader = SafeReader(path)
        try:
            reader.read_metadata()  # here first: inside dcp.load, its error would be reworded
            dcp.load(stored, checkpoint_id=str(path), storage_reader=reader, planner=SafePlanner())
        except (Exception, CheckpointException) as e:  # the latter is a BaseException
            raise CheckpointError(_load_failure(path, e)) from e
        for key in local:  # values DCP placed in new objects (non-tensor entries), and the tied copies
            renamed = _renamed({k: k for k in local[key]}, self.stored, self.equal)
            local[key].update({orig: stored[key][new] for new, orig in renamed.items()})
            _fill_copies(local[key], self.equal)
        set_model_state_dict(self.model, local["model"], options=_OPTIONS)
        configured = [{key: group[key] for key in _CONFIGURED} for group in self.optimizer.param_groups]
        with _empty_param_groups_set_aside(self.optimizer):
            set_optimizer_state_dict(self.model, self.optimizer, local["optim"], options=_OPTIONS)
        steps_done = train_state["step"]
        _load_schedule(self.optimizer, self.scheduler, train_state["lr_scheduler"], configured, path,
                       main=self.env.is_main)
        if train_state["world_size"] == self.env.world_size:
            try:
                load_rng_state(path, self.env.rank, self.env.device)
            except UnsafeCheckpointError as e:
                raise CheckpointError(_load_failure(path, e)) from None
        self.last_good = path
        log.info("resumed from %s at step %d", path, steps_done)
        return steps_done
