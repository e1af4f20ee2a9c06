"""``verify=true``: the unsplit model, on rank 0, on the run's first batch; its loss and every
parameter's gradient against the pipeline's. Catches gradients silently scaled, missing or
applied to the wrong stage."""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from omegaconf import DictConfig
from torch import nn
from torch.distributed.tensor import DTensor

from runner.dist import DistEnv, gather_to_main
from runner.errors import VerifyError
from runner.losses import build_loss
from runner.parallelize import PRECISIONS
from runner.pipeline import Batch, UnsplitStep
from runner.split import build_meta_model, materialize

__all__ = ["TOLERANCES", "collect_grads", "gather_grads", "compare", "verify_first_step"]

log = logging.getLogger(__name__)

# (rtol, atol) per train.precision. fp32: those of torch's own test_schedule_multiproc.py. bf16:
# an 8-bit mantissa (relative step 2**-8) and reductions in another order per layout.
TOLERANCES = {"fp32": (1e-5, 4e-5), "bf16": (5e-2, 2e-3)}


def collect_grads(modules: list[nn.Module]) -> dict[str, torch.Tensor | None]:
    """Full parameter name → a CPU copy of its whole gradient (None where backward left none).
    Sharded (FSDP) gradients are gathered: a collective over the dp group."""

    def whole(g: torch.Tensor) -> torch.Tensor:
        return (g.full_tensor() if isinstance(g, DTensor) else g).detach().cpu().clone()

    return {
        name: None if p.grad is None else whole(p.grad)
        for module in modules
        for name, p in module.named_parameters()
    }


def gather_grads(modules: list[nn.Module], env: DistEnv) -> dict[str, torch.Tensor | None]:
    """Every rank's gradients, by full name, on rank 0 (empty elsewhere). Collective."""
    gathered = gather_to_main(collect_grads(modules), env)
    return {name: g for part in gathered for name, g in part.items()} if env.is_main else {}


def compare(
    got: dict[str, torch.Tensor | None], ref: dict[str, torch.Tensor | None], loss: float, ref_loss: float,
    *, rtol: float = TOLERANCES["fp32"][0], atol: float = TOLERANCES["fp32"][1],
) -> dict:
    """Largest absolute and relative gradient differences; ``passed`` as ``torch.allclose``
    with ``rtol``/``atol`` on the loss and on every gradient, and no gradient missing."""
    problems = [f"{n}: no gradient in the pipeline" for n in ref if got.get(n) is None and ref[n] is not None]
    problems += [f"{n}: not in the unsplit model" for n in got if n not in ref]
    max_abs = max_rel = 0.0
    worst = None
    for name, r in ref.items():
        g = got.get(name)
        if g is None or r is None:
            continue
        diff = (g - r).abs()
        rel = (diff / r.abs().clamp_min(1e-12)).max().item()
        if diff.max().item() > max_abs:
            max_abs, worst = diff.max().item(), name
        max_rel = max(max_rel, rel)
        if not torch.allclose(g, r, rtol=rtol, atol=atol):
            problems.append(f"{name}: max abs diff {diff.max().item():.3g}")
    loss_diff = abs(loss - ref_loss)
    if loss_diff > atol + rtol * abs(ref_loss):
        problems.append(f"loss {loss:.6f} vs unsplit {ref_loss:.6f}")
    return {
        "passed": not problems,
        "loss": loss,
        "ref_loss": ref_loss,
        "loss_abs_diff": loss_diff,
        "max_abs_diff": max_abs,
        "max_rel_diff": max_rel,
        "worst_param": worst,
        "rtol": rtol,
        "atol": atol,
        "problems": problems[:20],
    }


def verify_first_step(
    cfg: DictConfig,
    modules: list[nn.Module],
    loss: float,
    batch: Batch,
    env: DistEnv,
) -> dict:
    """Call after the first step's backward, before clipping and the optimizer, with the step's
    global batch. The reference runs in the run's precision (autocast for bf16) on CPU. Every
    rank gets the report; every rank raises ``VerifyError`` together when it failed (none is left
    waiting)."""
    got = gather_grads(modules, env)
    report = None
    if env.is_main:
        meta = build_meta_model(cfg.model)
        model = materialize(meta, list(meta._modules), seed=cfg.train.seed, device=torch.device("cpu"))
        model.autocast_dtype = PRECISIONS[cfg.train.precision]
        inputs, targets, kwargs = batch
        ref_loss = UnsplitStep(model, cfg.parallel.microbatches, build_loss(cfg.loss))(inputs, targets, **kwargs)
        rtol, atol = TOLERANCES[cfg.train.precision]
        report = compare(got, collect_grads([model]), loss, ref_loss.item(), rtol=rtol, atol=atol)
        log.info("verify: max abs diff %.3g, max rel diff %.3g, loss diff %.3g -> %s",
                 report["max_abs_diff"], report["max_rel_diff"], report["loss_abs_diff"],
                 "passed" if report["passed"] else "FAILED")
    if env.world_size > 1:
        box = [report]
        dist.broadcast_object_list(box, src=0)
        report = box[0]
    if not report["passed"]:
        raise VerifyError(
            "verify=true: the pipelined first step differs from the unsplit model's:\n  "
            + "\n  ".join(report["problems"])
        )
    return report
