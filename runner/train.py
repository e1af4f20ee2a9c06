"""The training loop each rank runs: data → pipelined step → (verify) → global clip → AdamW →
(evaluation) → metrics; rank 0 writes the outputs."""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from omegaconf import DictConfig
from torch.distributed.tensor import DTensor

from runner.checkpoint import Checkpointer
from runner.console import step_record
from runner.data import build_dataset, get_batch
from runner.dist import DistEnv, all_reduce_sum, gather_to_main
from runner.errors import NonFiniteLossError
from runner.faults import train_fault
from runner.mesh import Mesh, build_mesh
from runner.optim import build_optimizer
from runner.outputs import MetricsWriter, make_summary, peak_memory_bytes, write_resolved_config, write_summary
from runner.pipeline import Batch, PipelinedStep, UnsplitStep, build_step
from runner.profile import RunProfiler
from runner.provenance import device_name
from runner.validate import Layout
from runner.verify import gather_grads, verify_first_step
from runner.watchdog import beat, busy

__all__ = ["TrainResult", "train", "reduce_loss_and_grad_norm", "evaluate"]

log = logging.getLogger(__name__)


@dataclass
class TrainResult:
    losses: list[float]
    summary: dict | None = None  # rank 0 only
    # Gradients after the first backward, before and after clipping (``keep_first_grads``);
    # rank 0 only, keyed by full parameter name.
    first_grads: dict[str, torch.Tensor | None] = field(default_factory=dict)
    first_clipped_grads: dict[str, torch.Tensor | None] = field(default_factory=dict)


def reduce_loss_and_grad_norm(local_loss: torch.Tensor | None, params: list[torch.nn.Parameter], env: DistEnv,
                              mesh: Mesh) -> tuple[float, float]:
    """The step's loss and the gradient norm over every stage, in one all-reduce (one sync per
    step). One rank per replica holds the last stage's loss, and every replica holds the same
    gradients: the world's sums divided by dp are the loss and the squared global norm. A
    per-rank clip would scale each stage differently; this norm is the same on every rank."""
    grads = [p.grad for p in params if p.grad is not None]
    norm = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros((), device=env.device)
    if isinstance(norm, DTensor):  # FSDP shards: the norm over the dp group, the same on each replica
        norm = norm.full_tensor()
    loss = local_loss.detach().float() if local_loss is not None else torch.zeros((), device=env.device)
    sums = all_reduce_sum(torch.stack([loss, norm.float().pow(2)]), env) / mesh.dp
    loss_value, norm_sq = sums.tolist()  # the step's one host sync
    return loss_value, math.sqrt(norm_sq)


def _replica_share(batch: Batch, mesh: Mesh, device: torch.device) -> Batch:
    """This dp replica's rows of the global batch (the same global batch whatever the layout)."""
    rows = len(batch[0]) // mesh.dp
    take = slice(mesh.dp_rank * rows, (mesh.dp_rank + 1) * rows)
    inputs, targets, kwargs = batch
    return inputs[take].to(device), targets[take].to(device), {k: v[take].to(device) for k, v in kwargs.items()}


def _step_loss(local_loss: torch.Tensor | None, env: DistEnv, mesh: Mesh) -> float:
    """One rank per replica holds the last stage: the sum over ranks / dp is the step's loss."""
    loss_t = local_loss if local_loss is not None else torch.zeros((), device=env.device)
    return all_reduce_sum(loss_t.float(), env).item() / mesh.dp


def evaluate(step_fn: UnsplitStep | PipelinedStep, data, cfg: DictConfig, env: DistEnv, mesh: Mesh) -> float:
    """Mean loss over the first ``eval.steps`` held-out batches (the same ones at every
    evaluation, so values are comparable along the run), forward only."""
    t = cfg.train
    losses = []
    for i in range(cfg.eval.steps):
        inputs, targets, kwargs = _replica_share(get_batch(data, i, t.batch_size, t.seq_len, "val"), mesh, env.device)
        losses.append(step_fn.evaluate(inputs, targets, **kwargs))
    # One all-reduce for all batches; only the last stage's rank holds losses.
    return _step_loss(None if losses[0] is None else torch.stack(losses).mean(), env, mesh)


def _non_finite_message(step: int, loss: float, grad_norm: float, last_good: Path | None) -> str:
    what = "gradient norm" if math.isfinite(loss) else "loss"
    last = (f"the last good checkpoint is {last_good} (checkpoint.resume={last_good})" if last_good
            else "no checkpoint was saved before it")
    return (f"non-finite {what} at step {step} (loss {loss}, grad_norm {grad_norm}): the optimizer did not apply "
            f"this step and no checkpoint holds it; {last}. Fix: a lower train.lr or a tighter train.grad_clip.")


def _phases(launch_time: float, marks: dict[str, float]) -> dict[str, float]:
    """Each phase's duration: from the end of the one before (the first from the launch)."""
    ends = list(marks.values())
    return {name: end - start for name, start, end in zip(marks, [launch_time, *ends], ends)}


def _artifacts(run_dir: Path) -> list[Path]:
    """What the loggers that keep files (MLflow) get: the summary, the resolved config, the pictures."""
    names = ["summary.json", "resolved_config.yaml", "schedule.png", "timeline.png"]
    return [run_dir / n for n in names if (run_dir / n).is_file()]


def train(
    cfg: DictConfig,
    layout: Layout,
    env: DistEnv,
    run_dir: Path,
    *,
    launch_time: float,
    startup_marks: dict[str, float] | None = None,
    keep_first_grads: bool = False,
) -> TrainResult:
    """Train on this rank. ``startup_marks``: phase name -> epoch time it ended, for the phases
    before this call (compose, validate, spawn, process group); the summary gets every startup
    phase's duration, up to the end of the first step."""
    t = cfg.train
    data = build_dataset(cfg.data, seed=t.seed)
    mesh = build_mesh(env, pp=layout.pp, dp=cfg.parallel.dp)
    step_fn, tied = build_step(cfg, layout, env, mesh)
    marks = {**(startup_marks or {}), "build": time.time()}
    named = {n: p for m in step_fn.modules for n, p in m.named_parameters(remove_duplicate=False)}
    params = list({id(p): p for p in named.values()}.values())  # a weight two local stages share: once
    # The global norm counts a tied weight once: not its copies on other stages.
    skip = {id(named[n]) for n in tied.not_counted()}
    norm_params = [p for p in params if id(p) not in skip]
    # A head tied to the embedding is an embedding wherever it sits (no weight decay).
    embeddings = {id(named[n]) for n in tied.embedding_names if n in named}
    optimizer, scheduler = build_optimizer(step_fn.modules, t, embeddings=embeddings)
    checkpointer = Checkpointer(cfg.checkpoint, run_dir, env, step_fn.modules, optimizer, scheduler, tied=tied)
    first_step = checkpointer.load(Path(cfg.checkpoint.resume)) if cfg.checkpoint.resume else 0
    profiler = RunProfiler(cfg.profile, steps=t.steps - first_step, env=env, run_dir=run_dir,
                           first_step=first_step + 1)
    step_fn.attach(profiler.recorder)
    metrics = MetricsWriter(run_dir, cfg.logging, run_config=cfg, resumed_after=first_step) if env.is_main else None
    result = TrainResult(losses=[])
    step_times: list[float] = []
    val_losses: list[tuple[int, float]] = []
    verify_report = None
    marks["setup"] = time.time()  # optimizer, checkpoint, profiler, loggers
    startup_s = marks["setup"] - launch_time
    try:
        # Steps are numbered from 1 everywhere they are shown or written (logs, metrics.jsonl,
        # the summary, timelines, faults); a checkpoint step-N holds the state after step N.
        # ``index`` (from 0) is the position in the data and in the LR schedule.
        for index in range(first_step, t.steps):
            step = index + 1
            beat(f"began step {step}")
            batch = get_batch(data, index, t.batch_size, t.seq_len)
            inputs, targets, kwargs = _replica_share(batch, mesh, env.device)
            profiler.begin_step(index - first_step)
            start = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            fault = train_fault(step, env.rank)
            with profiler.recorder.pipeline_step(step):
                local_loss = step_fn(inputs, targets, **kwargs)
            if fault == "nan" and local_loss is not None:
                local_loss = local_loss * float("nan")
            if fault == "nangrad":  # a finite loss with a non-finite gradient
                next(p.grad for p in params if p.grad is not None).mul_(float("nan"))
            tied.sync_grads()
            loss, grad_norm = reduce_loss_and_grad_norm(local_loss, norm_params, env, mesh)
            # Every rank sees the same reduced values: all stop at this step, before the optimizer
            # writes NaN into the parameters (a finite loss can come with a non-finite gradient).
            if not (math.isfinite(loss) and math.isfinite(grad_norm)):
                raise NonFiniteLossError(_non_finite_message(step, loss, grad_norm, checkpointer.last_good))
            if index == first_step and keep_first_grads:
                result.first_grads = gather_grads(step_fn.modules, env, skip=tied.not_counted())
            if index == first_step and cfg.verify:
                busy(f"verifying step {step} against the unsplit model")
                verify_report = verify_first_step(cfg, step_fn.modules, loss, batch, env, skip=tied.not_counted())
            if t.grad_clip > 0:
                torch.nn.utils.clip_grads_with_norm_(params, t.grad_clip, torch.tensor(grad_norm))
            if index == first_step and keep_first_grads:
                result.first_clipped_grads = gather_grads(step_fn.modules, env, skip=tied.not_counted())
            lr = scheduler.get_last_lr()[0]
            optimizer.step()
            scheduler.step()
            step_time = time.perf_counter() - start
            profiler.end_step()
            step_times.append(step_time)
            if index == first_step:
                marks["first_step"] = time.time()  # with shape inference (and compilation)
            result.losses.append(loss)
            record = {"step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm, "step_time_s": step_time,
                      "tokens_per_s": t.batch_size * t.seq_len / step_time}
            if cfg.eval.every and (step % cfg.eval.every == 0 or step == t.steps):
                beat(f"evaluating after step {step}")
                with profiler.recorder.paused():  # not part of the training schedule's timeline
                    record["val_loss"] = evaluate(step_fn, data, cfg, env, mesh)
                val_losses.append((step, record["val_loss"]))
            if metrics:
                metrics.write(record)
                step_record(log, step, t.steps, loss,
                            f"loss {loss:.4f} lr {lr:.2e} grad_norm {grad_norm:.3f} {step_time * 1e3:.1f} ms"
                            + (f" val_loss {record['val_loss']:.4f}" if "val_loss" in record else ""))
            checkpointer.maybe_save(step)
    except BaseException:  # a crash, a stop signal, a non-finite loss: loggers record a failed run
        if metrics:
            metrics.close(failed=True)
        raise
    busy("writing the profile and summary")
    bubble = profiler.finish(layout)
    # Per rank: its peak memory, its device's name, and (pretrained weights) the bytes it read.
    per_rank = gather_to_main((peak_memory_bytes(env.device), device_name(env.device),
                               getattr(step_fn.modules[0].spec, "bytes_read", 0)), env)
    if env.is_main:
        history = metrics.history  # resumed into its own run directory: the steps before the checkpoint
        val_losses = [(r["step"], r["val_loss"]) for r in history if "val_loss" in r] + val_losses
        result.summary = make_summary(
            cfg=cfg, layout=layout, first_step=first_step + 1, losses=[r["loss"] for r in history] + result.losses,
            step_times=step_times, tokens_per_step=t.batch_size * t.seq_len, launch_time=launch_time,
            startup_s=startup_s, peak_mem=[r[0] for r in per_rank], device_names=[r[1] for r in per_rank],
            config_path=write_resolved_config(run_dir, cfg),
        )
        result.summary["bubble"] = bubble
        result.summary["startup_phases_s"] = _phases(launch_time, marks)
        if any(r[2] for r in per_rank):
            result.summary["weights_read_bytes"] = [r[2] for r in per_rank]
        if val_losses:
            result.summary["val_loss"] = val_losses[-1][1]
            result.summary["val_losses"] = [{"step": st, "val_loss": v} for st, v in val_losses]
        if verify_report is not None:
            result.summary["verify"] = verify_report
        write_summary(run_dir, result.summary)
        metrics.close(bubble, artifacts=_artifacts(run_dir))
    return result
