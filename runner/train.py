"""The training loop each rank runs: data → pipelined step → (verify) → global clip → AdamW →
metrics; rank 0 writes the outputs."""

from __future__ import annotations

import logging
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import DictConfig
from torch.distributed.tensor import DTensor
from tqdm import tqdm

from runner.checkpoint import Checkpointer
from runner.data import build_dataset
from runner.dist import DistEnv, all_reduce_sum, gather_to_main
from runner.errors import NonFiniteLossError
from runner.faults import train_fault
from runner.mesh import Mesh, build_mesh
from runner.outputs import MetricsWriter, make_summary, peak_memory_bytes, write_summary
from runner.pipeline import build_step
from runner.profile import RunProfiler
from runner.validate import Layout
from runner.verify import gather_grads, verify_first_step

__all__ = ["TrainResult", "train", "lr_factor", "clip_grad_norm_global"]

log = logging.getLogger(__name__)


@dataclass
class TrainResult:
    losses: list[float]
    summary: dict | None = None  # rank 0 only
    # Gradients after the first backward, before and after clipping (``keep_first_grads``);
    # rank 0 only, keyed by full parameter name.
    first_grads: dict[str, torch.Tensor | None] = field(default_factory=dict)
    first_clipped_grads: dict[str, torch.Tensor | None] = field(default_factory=dict)


def lr_factor(step: int, *, steps: int, warmup_steps: int, min_lr_ratio: float) -> float:
    """Linear warmup to 1, then cosine decay to ``min_lr_ratio`` at the last step."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, steps - warmup_steps - 1)
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


def clip_grad_norm_global(params: list[torch.nn.Parameter], max_norm: float, env: DistEnv, mesh: Mesh) -> float:
    """Clip by the norm over every stage's gradients (a per-rank clip would use a different
    scale on each stage). Returns the norm before clipping."""
    grads = [p.grad for p in params if p.grad is not None]
    local = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros((), device=env.device)
    if isinstance(local, DTensor):  # FSDP shards: the norm over the dp group, the same on each replica
        local = local.full_tensor()
    squared = local.pow(2)
    if mesh.pp_group is not None:  # replicas hold the same gradients: sum over the pipeline only
        dist.all_reduce(squared, group=mesh.pp_group)
    total = squared.sqrt()
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total.item()


def train(
    cfg: DictConfig,
    layout: Layout,
    env: DistEnv,
    run_dir: Path,
    *,
    launch_time: float,
    keep_first_grads: bool = False,
) -> TrainResult:
    t = cfg.train
    data = build_dataset(cfg.data, seed=t.seed)
    mesh = build_mesh(env, pp=layout.pp, dp=cfg.parallel.dp)
    step_fn = build_step(cfg, layout, env, mesh)
    replica_batch = t.batch_size // mesh.dp
    params = [p for m in step_fn.modules for p in m.parameters()]
    optimizer = torch.optim.AdamW(params, lr=t.lr, betas=tuple(t.betas), weight_decay=t.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: lr_factor(s, steps=t.steps, warmup_steps=t.warmup_steps, min_lr_ratio=t.min_lr_ratio),
    )
    checkpointer = Checkpointer(cfg.checkpoint, run_dir, env, step_fn.modules, optimizer, scheduler)
    first_step = checkpointer.load(Path(cfg.checkpoint.resume)) if cfg.checkpoint.resume else 0
    profiler = RunProfiler(cfg.profile, steps=t.steps - first_step, env=env, run_dir=run_dir)
    step_fn.attach(profiler.recorder)
    metrics = MetricsWriter(run_dir, tensorboard=cfg.logging.tensorboard) if env.is_main else None
    result = TrainResult(losses=[])
    step_times: list[float] = []
    verify_report = None
    startup_s = time.time() - launch_time
    show_progress = env.is_main and sys.stderr.isatty() and t.steps >= 50
    progress = tqdm(total=t.steps - first_step, desc="train", disable=not show_progress)
    for step in range(first_step, t.steps):
        # The global batch is the same whatever the layout; each dp replica takes its rows.
        inputs, targets = data.batch(step, t.batch_size, t.seq_len)
        rows = slice(mesh.dp_rank * replica_batch, (mesh.dp_rank + 1) * replica_batch)
        inputs, targets = inputs[rows].to(env.device), targets[rows].to(env.device)
        profiler.begin_step(step - first_step)
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        fault = train_fault(step - first_step, env.rank)
        with profiler.recorder.pipeline_step(step):
            local_loss = step_fn(inputs, targets)
        if fault == "nan" and local_loss is not None:
            local_loss = local_loss * float("nan")
        # One rank per replica holds the last stage: the sum over ranks / dp is the step's loss.
        loss_t = local_loss if local_loss is not None else torch.zeros((), device=env.device)
        loss = all_reduce_sum(loss_t.float(), env).item() / mesh.dp
        if not math.isfinite(loss):  # every rank sees the reduced loss: all stop at this step
            raise NonFiniteLossError(f"non-finite loss at step {step}: {loss}. Fix: a lower train.lr or a "
                                     "tighter train.grad_clip; checkpoints before this step are intact.")
        if step == first_step and keep_first_grads:
            result.first_grads = gather_grads(step_fn.modules, env)
        if step == first_step and cfg.verify:
            full_inputs, full_targets = data.batch(step, t.batch_size, t.seq_len)
            verify_report = verify_first_step(cfg, step_fn.modules, loss, full_inputs, full_targets, env)
        grad_norm = clip_grad_norm_global(params, t.grad_clip, env, mesh)
        if step == first_step and keep_first_grads:
            result.first_clipped_grads = gather_grads(step_fn.modules, env)
        lr = scheduler.get_last_lr()[0]
        optimizer.step()
        scheduler.step()
        step_time = time.perf_counter() - start
        profiler.end_step()
        step_times.append(step_time)
        result.losses.append(loss)
        progress.update()
        if metrics:
            tokens = t.batch_size * t.seq_len
            metrics.write({"step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm,
                           "step_time_s": step_time, "tokens_per_s": tokens / step_time})
            if step % max(1, t.steps // 10) == 0 or step == t.steps - 1:
                log.info("step %d/%d loss %.4f lr %.2e grad_norm %.3f %.1f ms",
                         step + 1, t.steps, loss, lr, grad_norm, step_time * 1e3)
        checkpointer.maybe_save(step + 1)
    progress.close()
    bubble = profiler.finish(layout)
    peak_mem = gather_to_main(peak_memory_bytes(env.device), env)
    if env.is_main:
        result.summary = make_summary(
            cfg=cfg, layout=layout, first_step=first_step, losses=result.losses, step_times=step_times,
            tokens_per_step=t.batch_size * t.seq_len, launch_time=launch_time, startup_s=startup_s, peak_mem=peak_mem,
        )
        result.summary["bubble"] = bubble
        if verify_report is not None:
            result.summary["verify"] = verify_report
        metrics.close(bubble)
        write_summary(run_dir, result.summary)
    return result
