"""The training each rank runs, as a ``Trainer`` with named phases:

* ``setup``: the data, the mesh, this rank's stages and schedule, the optimizer, the checkpoint to
  resume from, the profiler, the metrics and loggers (rank 0);
* ``step``: one optimizer step: data → pipelined forward and backward → the loss and global
  gradient norm over all ranks → clip → AdamW (``train.optimizer_sync=post_validate``: AdamW while
  that reduction runs, validated after it, undone and redone clipped where it had to be;
  ``deferred``: validated during the next step, after its forward and backward, which run again
  where the validation redid the update);
* ``evaluate``: held-out loss, forward only, every ``eval.every`` steps;
* ``checkpoint``: every ``checkpoint.every`` steps (in the background with ``checkpoint.async_save``:
  the loop's end waits for the last);
* ``finish``: the profile, and on rank 0 the summary.

What is not training runs in hooks (``runner.hooks``): ``verify``'s comparison with the unsplit
model, fault injection, the tests' gradient probes."""

from __future__ import annotations

import logging
import math
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import torch
from omegaconf import DictConfig
from torch.distributed.tensor import DTensor

from runner.callbacks import build_callbacks
from runner.checkpoint.checkpointer import Checkpointer
from runner.data.datasets import build_dataset, get_batch
from runner.errors import NonFiniteLossError
from runner.faults import commit_fault, fault_hooks
from runner.hooks import Hook, StepContext, StepState
from runner.layout import ResolvedRun
from runner.losses import counted_targets
from runner.models.split import StageModule, seed_for
from runner.optim import UpdateSnapshot, build_optimizer, clip_coefficient, clip_grads
from runner.options import OptimizerSync
from runner.outputs.metrics import (
    MetricsWriter,
    as_ran,
    make_summary,
    peak_memory_bytes,
    reset_peak_memory,
    write_resolved_config,
    write_summary,
)
from runner.outputs.profile import RunProfiler
from runner.outputs.provenance import device_name
from runner.outputs.step_timer import StepTimer
from runner.parallel.mesh import Mesh, build_mesh
from runner.pipeline.step import Batch, build_step
from runner.ranks.clock import StartupClock
from runner.ranks.console import step_record
from runner.ranks.dist import DistEnv, all_reduce_sum, gather_to_main, start_all_reduce_sum
from runner.ranks.processes import raise_if_stopped
from runner.ranks.watchdog import beat, busy, waiting
from runner.verify.hook import Verify

__all__ = ["TrainResult", "Trainer", "train", "reduce_loss_and_grad_norm", "start_reduce"]

log = logging.getLogger(__name__)


@dataclass
class TrainResult:
    losses: list[float]  # the steps this run trained
    summary: dict | None = None  # rank 0 only


def reduce_loss_and_grad_norm(local_loss: torch.Tensor | None, params: list[torch.nn.Parameter], env: DistEnv,
                              mesh: Mesh) -> tuple[float, float]:
    """The step's loss and the gradient norm over every stage, in one all-reduce (one sync per
    step). Each stage is held by ``stage_ranks`` ranks (its replicas and tp shards), and each of
    them adds its share: the last stage's loss (the same on a replica's shards), and its
    gradients' squares, a shard's counted once per shard of its tensor (``_squares``), so the
    world's sums divided by ``stage_ranks`` are the loss and the squared global norm. A per-rank
    clip would scale each stage differently; this norm is the same on every rank."""
    return start_reduce(local_loss, params, env, mesh)()


def start_reduce(local_loss: torch.Tensor | None, params: list[torch.nn.Parameter], env: DistEnv,
                 mesh: Mesh) -> Callable[[], tuple[float, float]]:
    """``reduce_loss_and_grad_norm``'s all-reduce, started without blocking: the same sums in the
    same order (so the same bits); the returned function waits for it and gives the loss and the
    norm (``train.optimizer_sync=post_validate`` steps AdamW in between)."""
    loss = local_loss.detach().float() if local_loss is not None else torch.zeros((), device=env.device)
    local = torch.stack([loss, _squares(params, env.device)])
    work = start_all_reduce_sum(local, env)

    def wait() -> tuple[float, float]:
        with waiting("the step's loss and gradient-norm all-reduce"):  # blocked here, a rank waits for its peers
            if work is not None:
                work.wait()
            loss_value, norm_sq = (local / mesh.dims.stage_ranks).tolist()  # the step's one host sync
        return loss_value, math.sqrt(norm_sq)

    return wait


def _squares(params: list[torch.nn.Parameter], device: torch.device) -> torch.Tensor:
    """This rank's share of the squared gradient norm. A DTensor sharded S ways holds its tensor
    once between its S shards, so a rank's local squares count S times: summed over the stage's
    ranks, every gradient then adds ``stage_ranks`` times its squares, sharded or not."""
    by_shards: dict[int, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is None:
            continue
        g = p.grad
        shards = _shards(g) if isinstance(g, DTensor) else 1
        by_shards.setdefault(shards, []).append(g.to_local() if isinstance(g, DTensor) else g)
    total = torch.zeros((), device=device)
    for shards, grads in by_shards.items():
        total += torch.nn.utils.get_total_norm(grads).float().pow(2) * shards
    return total


def _shards(g: DTensor) -> int:
    """Into how many distinct pieces ``g`` is cut: the product of its mesh dimensions that do not
    replicate it. Not ``is_shard()``: FSDP over tp shards a tp-sharded dimension again with a
    ``_StridedShard``, which torch does not count as a ``Shard`` (a gradient is never ``Partial``:
    its reductions have run)."""
    return math.prod(g.device_mesh.size(i) for i, pl in enumerate(g.placements) if not pl.is_replicate())


def _replica_share(batch: Batch, mesh: Mesh, device: torch.device) -> Batch:
    """This dp replica's rows of the global batch (the same global batch whatever the layout),
    contiguous: datasets hand out views (``window[:, :-1]``), and torch 2.11's first stage refused
    their strides against the contiguous ones it had inferred (seen on a GPU host)."""
    rows = len(batch[0]) // mesh.dp
    take = slice(mesh.dp_rank * rows, (mesh.dp_rank + 1) * rows)

    def share(t: torch.Tensor) -> torch.Tensor:
        return t[take].to(device).contiguous()

    inputs, targets, kwargs = batch
    return share(inputs), share(targets), {k: share(v) for k, v in kwargs.items()}


def _non_finite_message(step: int, loss: float, grad_norm: float, last_good) -> str:
    what = "gradient norm" if math.isfinite(loss) else "loss"
    last = (f"the last good checkpoint is {last_good} (checkpoint.resume={last_good})" if last_good
            else "no checkpoint was saved before it")
    return (f"non-finite {what} at step {step} (loss {loss}, grad_norm {grad_norm}): the optimizer did not apply "
            f"this step and no checkpoint holds it; {last}. Fix: a lower train.lr or a tighter train.grad_clip.")


def _stage_modules(modules: Sequence[torch.nn.Module]) -> list[StageModule]:
    """``build_step``'s modules, as the stage modules they are (dp wraps them in place: their class
    becomes a subclass)."""
    stages = [m for m in modules if isinstance(m, StageModule)]
    assert len(stages) == len(modules), [type(m).__name__ for m in modules]
    return stages


@contextmanager
def _evaluation_mode(modules: Sequence[torch.nn.Module]) -> Iterator[None]:
    """Every module in eval mode (dropout off) while held-out batches run, each put back as it was
    after. Evaluation ran in training mode: ``val_loss`` had dropout in it, and drew from the
    generator the next steps' masks come from, so evaluating changed the training after it."""
    modes = [(m, m.training) for root in modules for m in root.modules()]
    for root in modules:
        root.eval()
    try:
        yield
    finally:
        for m, training in modes:
            m.training = training


def _artifacts(run_dir) -> list:
    """What the loggers that keep files (MLflow) get: the summary, the resolved config, the pictures."""
    names = ["summary.json", "resolved_config.yaml", "schedule.png", "timeline.png"]
    return [run_dir / n for n in names if (run_dir / n).is_file()]


@dataclass
class PostValidation:
    """``train.optimizer_sync=post_validate`` on this rank: the snapshot each update is taken into,
    the steps rolled back, and the seconds spent on snapshots and on rollbacks (restore and redo)."""

    snapshot: UpdateSnapshot
    rollbacks: int = 0
    snapshot_s: float = 0.0
    rollback_s: float = 0.0
    reruns: int = 0  # deferred: steps whose forward and backward ran again after the previous one's rollback

    def report(self) -> dict:
        return {"snapshot_bytes": self.snapshot.nbytes(), "params": self.snapshot.numel(),
                "rollbacks": self.rollbacks, "snapshot_s": self.snapshot_s, "rollback_s": self.rollback_s,
                "reruns": self.reruns}


@dataclass
class Pending:
    """``train.optimizer_sync=deferred``: a step whose update is applied and not yet validated, with
    its reduction's wait and its gradients (the next step's backward makes new ones), which its
    hooks and a redo need; its learning rate, for its record."""

    state: StepState
    wait: Callable[[], tuple[float, float]]
    grads: list[torch.Tensor | None]
    lr: float = 0.0


def _set_grads(params: list[torch.nn.Parameter], grads: list[torch.Tensor | None]) -> None:
    for p, g in zip(params, grads):
        p.grad = g


def _rng_state(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The random state a forward and backward draws from (dropout): a rerun draws the same."""
    return torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None


def _set_rng_state(state: tuple[torch.Tensor, torch.Tensor | None] | None, device: torch.device) -> None:
    assert state is not None
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)


def _seed_dropout(seed: int, pp_rank: int, device: torch.device) -> None:
    """Seed the generators a forward and backward draws from (dropout) from ``train.seed`` and this
    rank's pipeline coordinate. As torchtitan seeds them: each pipeline rank its own (its stages
    are other layers: a shared seed drew the same masks in block 0 on rank 0 as in block 1 on rank
    1), the same across dp and tp (a tp shard's replicated activations must drop the same elements
    as its peers'). Before, nothing seeded them: a rank drew from whatever state its process held
    (a second ``runner.run`` in one process, a notebook's draws, pooled ranks)."""
    value = seed_for(seed, f"dropout/pp{pp_rank}")
    torch.default_generator.manual_seed(value)  # not torch.manual_seed: it queues every accelerator's too
    if device.type == "cuda":
        with torch.cuda.device(device):
            torch.cuda.manual_seed(value)


class Trainer:
    """One rank's training, following ``plan`` (``runner.validate``); ``cfg`` is the composed config
    (the factories' keys and the training options). ``clock``: the startup phases so far (a fresh
    one when this rank is the first thing timed). ``hooks`` run after the trainer's own (fault
    injection when ``RUNNER_FAULT`` asks for it, ``verify`` when the resolved run asks for it, then the config's
    ``callbacks``: ``runner.callbacks``)."""

    def __init__(self, resolved: ResolvedRun, cfg: DictConfig, env: DistEnv, *, clock: StartupClock | None = None,
                 hooks: Sequence[Hook] = (), static_stages: bool = False):
        if resolved.run_dir is None:
            raise ValueError("a run needs a run directory: validate(cfg, run_dir)")
        self.resolved, self.cfg, self.env = resolved, cfg, env
        self.run_dir = resolved.run_dir
        self.clock = clock or StartupClock()
        self.hooks: list[Hook] = [*fault_hooks(), *([Verify()] if resolved.verify else []),
                                  *build_callbacks(cfg.get("callbacks")), *hooks]
        self.static_stages = static_stages  # stages built with static metadata (runner.pipeline.step.build_step)
        self.losses: list[float] = []
        self.val_losses: list[tuple[int, float]] = []
        self.pending: Pending | None = None  # deferred: the step applied, validated in the next one
        self.metrics: MetricsWriter | None = None  # rank 0's, made by setup
        self.unwritten: list[dict] = []  # validated steps' records waiting for their device time
        # A rehearsal's wait for the device (``runner.rehearse.rank``), before the host's clock is read
        # for a time the step reports (its start and end, the snapshot's, a rollback's): on CUDA they
        # are then the device's work, not its launches. None (a real run): no wait is added.
        self.wait_for_device: Callable[[], None] | None = None

    # -- setup -----------------------------------------------------------------------------------
    def setup(self) -> None:
        resolved, cfg, env, t = self.resolved, self.cfg, self.env, self.resolved.train
        reset_peak_memory(env.device)  # the summary's peak is this run's, not its process's earlier jobs'
        self.data = build_dataset(cfg.data, seed=t.seed)
        self.mesh = build_mesh(env, resolved.dims)
        _seed_dropout(t.seed, self.mesh.pp_rank, env.device)  # a resumed run's checkpoint restores its own
        example = (_replica_share(get_batch(self.data, 1, resolved.batch_size, resolved.seq_len), self.mesh, env.device)
                   if self.static_stages else None)
        self.step_fn, self.tied = build_step(resolved, cfg, env, self.mesh, example=example)
        self.clock.mark("build")
        self.clock.say("model built")
        self.modules = _stage_modules(self.step_fn.modules)
        named = {n: p for m in self.modules for n, p in m.named_parameters(remove_duplicate=False)}
        self.params = list({id(p): p for p in named.values()}.values())  # a weight two local stages share: once
        # The global norm counts a tied weight once: not its copies on other stages.
        skip = {id(named[n]) for n in self.tied.not_counted()}
        self.norm_params = [p for p in self.params if id(p) not in skip]
        # A head tied to the embedding is an embedding wherever it sits (no weight decay).
        embeddings = {id(named[n]) for n in self.tied.embedding_names if n in named}
        self.optimizer, self.scheduler = build_optimizer(self.modules, t, embeddings=embeddings)
        self.post_validate = (PostValidation(UpdateSnapshot(self.optimizer))
                              if t.optimizer_sync != OptimizerSync.barrier else None)
        self.checkpointer = Checkpointer(resolved.checkpoint, self.run_dir, env, self.modules, self.optimizer,
                                         self.scheduler, tied=self.tied, run_config=cfg,
                                         train_windows=resolved.train_windows, before_commit=commit_fault())
        # Steps are numbered from 1 everywhere they are shown or written (logs, metrics.jsonl, the
        # summary, timelines, faults); a checkpoint step-N holds the state after step N.
        self.first_step = self.checkpointer.load(resolved.resume) if resolved.resume else 0
        self.profiler = RunProfiler(resolved.profile, steps=resolved.steps - self.first_step, env=env,
                                    run_dir=self.run_dir, first_step=self.first_step + 1, tp=resolved.dims.tp)
        self.step_fn.attach(self.profiler.recorder)
        self.config = as_ran(cfg, resolved)
        self.metrics = (MetricsWriter(self.run_dir, run_config=self.config,
                                      resumed_after=self.first_step) if env.is_main else None)
        # The reported step times: on CUDA the device's, read as the metrics are written (only rank 0 writes them).
        self.timer = StepTimer(env.device if env.is_main else torch.device("cpu"))
        self.context = StepContext(env=env, mesh=self.mesh, modules=self.modules, params=self.params,
                                   not_counted=frozenset(self.tied.not_counted()), optimizer=self.optimizer,
                                   scheduler=self.scheduler, resolved=resolved, cfg=cfg)
        self.clock.mark("setup")  # optimizer, checkpoint, profiler, loggers

    # -- step ------------------------------------------------------------------------------------
    def _call(self, point: str, state: StepState) -> None:
        for hook in self.hooks:
            getattr(hook, point)(self.context, state)

    def step(self, index: int) -> list[dict]:
        """Optimizer step ``index + 1`` (``index``, from 0, is the position in the LR schedule; the
        dataset is asked for step ``index + 1``'s batch). Returns the records (for metrics.jsonl) of
        the steps validated during the call: this step's, and under ``train.optimizer_sync=deferred``
        the previous step's, validated after this step's forward and backward, before its update
        (``_validate_pending``); this step's own then waits for the next call, unless its results
        are committed at its end (``_commits``)."""
        resolved, env = self.resolved, self.env
        beat(f"began step {index + 1}")
        state = StepState(step=index + 1, first=index == self.first_step,
                          batch=get_batch(self.data, index + 1, resolved.batch_size, resolved.seq_len))
        batch = _replica_share(state.batch, self.mesh, env.device)
        self.profiler.begin_step(index - self.first_step)
        start = self._clock()
        self.timer.begin(state.step)
        rng = _rng_state(env.device) if self.pending is not None else None
        self._forward_backward(state, batch)
        done = []
        if self.pending is not None:
            record, redone = self._validate_pending()
            done.append(record)
            if redone:  # this step's gradients were computed on the weights the redo replaced
                self.profiler.recorder.discard(state.step)
                _set_rng_state(rng, env.device)  # the same dropout masks as the barrier's one pass
                self._forward_backward(state, batch)
        lr = self.scheduler.get_last_lr()[0]
        validated = self._apply_update(state)
        if validated:
            self.scheduler.step()
            self._call("after_step", state)
        self.timer.end(state.step, self._clock() - start)
        self.profiler.end_step()
        if state.first:
            self.clock.mark("first_step")  # with shape inference (and compilation)
            self.clock.say("first step done")
        if validated:
            done.append(self._validated_record(state, lr))
        else:
            assert self.pending is not None
            self.pending.lr = lr
        return done

    def _clock(self) -> float:
        """``time.perf_counter()``, after the device's queued work where ``wait_for_device`` (a rehearsal)."""
        if self.wait_for_device is not None:
            self.wait_for_device()
        return time.perf_counter()

    def _forward_backward(self, state: StepState, batch: Batch) -> None:
        """The step's pipelined forward and backward, with its hooks, and the tied weights' gradient sum."""
        inputs, targets, kwargs = batch
        self.optimizer.zero_grad(set_to_none=True)
        self._call("begin_step", state)
        with self.profiler.recorder.pipeline_step(state.step):  # the loss: a mean over the global batch's targets
            state.local_loss = self.step_fn(inputs, targets, counted=counted_targets(state.batch[1]), **kwargs)
        self._call("after_backward", state)
        self.tied.sync_grads()  # between the ranks holding a tied weight's copies: blocks (docs/optimizer-sync.md)

    def _apply_update(self, state: StepState) -> bool:
        """The step's update, as ``train.optimizer_sync`` says; False where it stands unvalidated
        (``deferred``: in ``self.pending`` until the next step validates it)."""
        if self.post_validate is None:
            self._update(state)
            return True
        wait = self._speculate(state)
        if self.resolved.train.optimizer_sync == OptimizerSync.post_validate or self._commits(state.step):
            self._validate(state, wait)
            return True
        self.pending = Pending(state, wait, grads=[p.grad for p in self.params])
        return False

    def _commits(self, step: int) -> bool:
        """Whether step ``step``'s results are committed at its end (the run's last step, an
        evaluation, a checkpoint, a step ``verify`` compares): ``deferred`` validates it there."""
        verified = self.resolved.verify and step <= self.first_step + self.resolved.verify_steps + 1
        return step == self.resolved.steps or self.evaluation_due(step) or self.checkpointer.due(step) or verified

    def _validated_record(self, state: StepState, lr: float) -> dict:
        """The step's metrics line, but for its time (``_write_records`` adds it: ``self.timer``)."""
        assert state.loss is not None and state.grad_norm is not None  # reduced by the update
        self.losses.append(state.loss)
        return {"step": state.step, "loss": state.loss, "lr": lr, "grad_norm": state.grad_norm}

    def _validate_pending(self) -> tuple[dict, bool]:
        """``deferred``: the previous step's reduction waited for and its update validated, with its
        own gradients in place for its hooks and a redo; then its LR schedule step and its record.
        True where its update was redone (clipped): this step's forward and backward must run again."""
        pending, self.pending = self.pending, None
        assert pending is not None
        current = [p.grad for p in self.params]
        _set_grads(self.params, pending.grads)
        redone = self._validate(pending.state, pending.wait)
        self.scheduler.step()
        self._call("after_step", pending.state)
        if redone:
            assert self.post_validate is not None
            self.post_validate.reruns += 1
        else:
            _set_grads(self.params, current)
        return self._validated_record(pending.state, pending.lr), redone

    def _check_finite(self, state: StepState) -> None:
        # Every rank sees the same reduced values: all stop at this step, before the optimizer's
        # update stands (a finite loss can come with a non-finite gradient).
        assert state.loss is not None and state.grad_norm is not None
        if not (math.isfinite(state.loss) and math.isfinite(state.grad_norm)):
            raise NonFiniteLossError(_non_finite_message(state.step, state.loss, state.grad_norm,
                                                         self.checkpointer.last_good))

    def _update(self, state: StepState) -> None:
        """``train.optimizer_sync=barrier``: wait for the loss and the global norm, check, clip, step."""
        state.loss, state.grad_norm = reduce_loss_and_grad_norm(state.local_loss, self.norm_params, self.env,
                                                                self.mesh)
        self.profiler.recorder.anchor()  # the stream drained by the read: CUDA spans placed from here
        self._check_finite(state)
        self._call("after_reduce", state)
        clip_grads(self.params, self.resolved.train.grad_clip, state.grad_norm)
        self._call("after_clip", state)
        self.optimizer.step()

    def _speculate(self, state: StepState) -> Callable[[], tuple[float, float]]:
        """``post_validate`` and ``deferred``: the reduction started, a snapshot of what AdamW changes
        taken, and AdamW stepped unclipped while the reduction runs; returns the wait for it."""
        stats = self.post_validate
        assert stats is not None
        wait = start_reduce(state.local_loss, self.norm_params, self.env, self.mesh)  # started before the update
        began = self._clock()
        stats.snapshot.take()
        stats.snapshot_s += self._clock() - began
        self.optimizer.step()  # as if no clip were needed and every value finite
        return wait

    def _validate(self, state: StepState, wait: Callable[[], tuple[float, float]]) -> bool:
        """The speculative update checked against the reduction: a step whose norm needed clipping is
        undone and redone clipped (True), a non-finite one undone and refused (``_check_finite``).
        The hooks' ``after_reduce`` and (unclipped) ``after_clip`` come after the update."""
        stats = self.post_validate
        assert stats is not None
        state.loss, state.grad_norm = wait()
        self.profiler.recorder.anchor()  # the stream drained by the read: CUDA spans placed from here
        if not (math.isfinite(state.loss) and math.isfinite(state.grad_norm)):
            stats.snapshot.restore()  # the parameters as the barrier leaves them when it stops
        self._check_finite(state)
        self._call("after_reduce", state)
        if clip_coefficient(self.resolved.train.grad_clip, state.grad_norm) == 1.0:
            self._call("after_clip", state)
            return False
        began = self._clock()
        stats.snapshot.restore()
        clip_grads(self.params, self.resolved.train.grad_clip, state.grad_norm)
        self._call("after_clip", state)
        self.optimizer.step()
        stats.rollbacks += 1
        stats.rollback_s += self._clock() - began
        return True

    # -- evaluate --------------------------------------------------------------------------------
    def evaluation_due(self, step: int) -> bool:
        every = self.resolved.eval.every
        return bool(every) and (step % every == 0 or step == self.resolved.steps)

    def evaluate(self) -> float:
        """Mean loss over the first ``eval.steps`` held-out batches (the same ones at every
        evaluation, so values are comparable along the run), forward only."""
        resolved, env = self.resolved, self.env
        losses = []
        with self.profiler.recorder.paused(), _evaluation_mode(self.modules):  # not in the schedule's timeline
            for i in range(1, self.resolved.eval.steps + 1):
                batch = get_batch(self.data, i, resolved.batch_size, resolved.seq_len, "val")
                inputs, targets, kwargs = _replica_share(batch, self.mesh, env.device)
                losses.append(self.step_fn.evaluate(inputs, targets, counted=counted_targets(batch[1]), **kwargs))
        # One all-reduce for all batches; only the last stage's rank holds losses.
        held = [loss for loss in losses if loss is not None]  # all of them or none
        local = torch.stack(held).mean() if held else None
        loss_t = local if local is not None else torch.zeros((), device=env.device)
        with waiting("the evaluation's loss all-reduce"):
            return all_reduce_sum(loss_t.float(), env).item() / self.mesh.dims.stage_ranks

    # -- checkpoint ------------------------------------------------------------------------------
    def checkpoint(self, step: int) -> None:
        self.checkpointer.maybe_save(step)

    # -- the loop --------------------------------------------------------------------------------
    def _record(self, record: dict) -> None:
        if self.metrics is None:
            return
        self.unwritten.append(record)
        self._write_records()

    def _write_records(self, *, finished: bool = False, failed: bool = False) -> None:
        """The records waiting, in step order, with their reported step times (``self.timer``):
        those the device has finished (on CPU every one as it comes; on CUDA a step's once a later
        wait has passed its end: the next step's, under ``barrier`` and ``deferred`` alike), or every
        one where the run is ``finished`` (waiting for the device) or ``failed`` (the host's times:
        the device may not answer)."""
        while self.unwritten:
            record = self.unwritten[0]
            step = record["step"]
            if not (failed or finished or self.timer.ready(step)):
                return
            seconds = self.timer.host[step] if failed else self.timer.seconds(step, wait=finished)
            record.update(step_time_s=seconds, tokens_per_s=self.resolved.tokens_per_step / seconds)
            self._write(self.unwritten.pop(0))

    def _write(self, record: dict) -> None:
        assert self.metrics is not None
        self.metrics.write(record)
        step = record["step"]
        val = f" val_loss {record['val_loss']:.4f}" if "val_loss" in record else ""
        step_record(log, step, self.resolved.steps, record["loss"],
                    f"loss {record['loss']:.4f} lr {record['lr']:.2e} grad_norm {record['grad_norm']:.3f} "
                    f"{record['step_time_s'] * 1e3:.1f} ms{val}")

    def _commit(self, record: dict) -> None:
        """A validated step's evaluation (when due), metrics line and checkpoint (when due)."""
        if self.evaluation_due(record["step"]) or self.checkpointer.due(record["step"]):
            self.profiler.recorder.interrupt(record["step"])  # not a training step's gap: the steady bubble's
        if self.evaluation_due(record["step"]):
            beat(f"evaluating after step {record['step']}")
            record["val_loss"] = self.evaluate()
            self.val_losses.append((record["step"], record["val_loss"]))
        self._record(record)
        self.checkpoint(record["step"])
        self._write_records()  # a save waits for the device (its copies): its step's time is known

    @property
    def step_times(self) -> list[float]:
        """The host's seconds of each step's call, in order (the reported ones: ``self.timer``)."""
        return list(self.timer.host.values())

    def run(self) -> TrainResult:
        try:
            self.setup()
            for index in range(self.first_step, self.resolved.steps):
                raise_if_stopped()
                for record in self.step(index):  # deferred: the last step, and any evaluated or saved, at its end
                    self._commit(record)
            assert self.pending is None  # the last step is validated at its end
            self._write_records(finished=True)
            self.checkpointer.wait()  # the last asynchronous save, committed
        except BaseException:  # a crash, a stop signal, a non-finite loss
            self._abandon()
            raise
        self.checkpointer.close()
        return TrainResult(losses=self.losses, summary=self.finish())

    def _abandon(self) -> None:
        """A run that failed (in setup or a step): its loggers record a failed run; torch's
        profiler, which is the process's, stops without writing a trace (``RunProfiler.stop``), and
        the background saves' thread goes (``Checkpointer.abandon``): nothing of the run goes on in
        this process (a later run, the caller's own code)."""
        try:
            if self.metrics:
                self._write_records(failed=True)
                self.metrics.close(failed=True)
        finally:
            # None where setup failed before making them.
            profiler: RunProfiler | None = getattr(self, "profiler", None)
            checkpointer: Checkpointer | None = getattr(self, "checkpointer", None)
            if profiler is not None:
                profiler.stop(trace=False)
            if checkpointer is not None:
                checkpointer.abandon()

    # -- finish ----------------------------------------------------------------------------------
    def finish(self) -> dict | None:
        """The profile files and, on rank 0, the summary (written, and returned)."""
        busy("writing the profile and summary")
        bubble = self.profiler.finish(self.resolved.layout, self.mesh.dims.ranks_of("pp", 0))
        # Per rank: its peak memory, its device's name, (pretrained weights) the bytes it read, and
        # (post_validate) its snapshot's bytes, rollbacks and their time.
        per_rank = gather_to_main((peak_memory_bytes(self.env.device), device_name(self.env.device),
                                   getattr(self.modules[0].spec, "bytes_read", 0),
                                   self.post_validate.report() if self.post_validate else None), self.env)
        if per_rank is None:  # not rank 0
            return None
        assert self.metrics is not None  # rank 0 writes the metrics
        history = self.metrics.history  # resumed into its own run directory: the steps before the checkpoint
        val_losses = [(r["step"], r["val_loss"]) for r in history if "val_loss" in r] + self.val_losses
        summary = make_summary(
            resolved=self.resolved, clock=self.clock, first_step=self.first_step + 1,
            losses=[r["loss"] for r in history] + self.losses, step_times=self.timer.all_seconds(),
            peak_mem=[r[0] for r in per_rank], device_names=[r[1] for r in per_rank],
            config_path=write_resolved_config(self.run_dir, self.config),
        )
        summary["bubble"] = bubble
        if self.checkpointer.blocked_s:  # the seconds each save held up the loop
            summary["checkpoint_blocked_s"] = self.checkpointer.blocked_s
        summary["startup_phases_s"] = self.clock.phases()
        if any(r[2] for r in per_rank):
            summary["weights_read_bytes"] = [r[2] for r in per_rank]
        if self.post_validate is not None:  # per rank: each one's snapshot, rollbacks and their seconds
            summary["post_validate"] = {key: [r[3][key] for r in per_rank] for key in per_rank[0][3]}
        if val_losses:
            summary["val_loss"] = val_losses[-1][1]
            summary["val_losses"] = [{"step": st, "val_loss": v} for st, v in val_losses]
        for hook in self.hooks:
            summary.update(hook.summary())
        write_summary(self.run_dir, summary)
        self.metrics.close(bubble, artifacts=_artifacts(self.run_dir))
        return summary


def train(resolved: ResolvedRun, cfg: DictConfig, env: DistEnv, *, clock: StartupClock | None = None,
          hooks: Sequence[Hook] = ()) -> TrainResult:
    """Train on this rank (see ``Trainer``); rank 0's result holds the summary."""
    return Trainer(resolved, cfg, env, clock=clock, hooks=hooks).run()
