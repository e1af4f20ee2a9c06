"""``verify=true``: the unsplit model, on rank 0, on the run's first batch; its loss and every
parameter's gradient against the pipeline's. Catches gradients silently scaled, missing or
applied to the wrong stage, and units that do not compute what the model does: the reference is
the model's own forward (for a Hugging Face model, transformers' forward of the unmodified
model), with the run's initial weights (a resumed run: the weights of the checkpoint it resumed
from, as its stages hold them)."""

from __future__ import annotations

import logging
from contextlib import nullcontext
from pathlib import Path
from typing import Callable, Collection, Sequence

import torch
import torch.distributed as dist
from omegaconf import DictConfig
from torch import nn
from torch.distributed.tensor import DTensor

from runner.errors import VerifyError
from runner.hooks import Hook, StepContext, StepState
from runner.losses import build_loss
from runner.models.split import build_meta_model, materialize
from runner.models.units import SequentialSpec, tied_groups
from runner.parallel.parallelize import PRECISIONS
from runner.pipeline.step import Batch, UnsplitStep
from runner.ranks.dist import DistEnv, gather_to_main
from runner.ranks.watchdog import busy

__all__ = ["TOLERANCES", "collect_grads", "gather_grads", "compare", "verify_first_step", "VerifyFirstStep"]

log = logging.getLogger(__name__)

# (rtol, atol) per train.precision. fp32: those of torch's own test_schedule_multiproc.py. bf16:
# an 8-bit mantissa (relative step 2**-8) and reductions in another order per layout.
TOLERANCES = {"fp32": (1e-5, 4e-5), "bf16": (5e-2, 2e-3)}


def collect_grads(modules: Sequence[nn.Module], skip: Collection[str] = ()) -> dict[str, torch.Tensor | None]:
    """Full parameter name → a CPU copy of its whole gradient (None where backward left none),
    but for the names in ``skip`` (copies of a tied weight, which the unsplit model names once).
    Sharded (FSDP) gradients are gathered: a collective over the dp group."""

    def whole(g: torch.Tensor) -> torch.Tensor:
        return (g.full_tensor() if isinstance(g, DTensor) else g).detach().cpu().clone()

    out, seen = {}, set()
    for module in modules:
        for name, p in module.named_parameters():
            if name not in skip and id(p) not in seen:  # a weight two stages share: under its first name
                seen.add(id(p))
                out[name] = None if p.grad is None else whole(p.grad)
    return out


def gather_grads(modules: Sequence[nn.Module], env: DistEnv,
                 skip: Collection[str] = ()) -> dict[str, torch.Tensor | None]:
    """Every rank's gradients, by full name, on rank 0 (empty elsewhere). Collective."""
    gathered = gather_to_main(collect_grads(modules, skip), env)
    if gathered is None:  # not rank 0
        return {}
    return {name: g for part in gathered for name, g in part.items()}


def _load_checkpoint_weights(units: nn.Module, tied: list[list[str]], checkpoint: Path) -> None:
    """The checkpoint's model tensors into the unsplit model's units: what the stages resumed
    with. A tied weight is stored once, under its first name."""
    from runner._torch.dcp import read_model_tensors

    tensors = read_model_tensors(checkpoint)  # the ranks checked its manifests when they loaded it
    for first, *others in tied:
        tensors.update({other: tensors[first] for other in others if first in tensors})
    with torch.no_grad():
        for name, t in [*units.named_parameters(remove_duplicate=False), *units.named_buffers()]:
            if name in tensors:
                t.copy_(tensors[name])


def reference_model(cfg: DictConfig, resume: Path | None = None) -> tuple[nn.Module, Callable[..., torch.Tensor]]:
    """The unsplit model with the run's initial weights (initialised or read as each stage does;
    ``resume``: the checkpoint's), on CPU, and its own forward (logits from a microbatch's inputs
    and keyword inputs), in the run's precision."""
    meta = build_meta_model(cfg.model, cfg.parallel.get("stage_modules"))
    units = materialize(meta, meta.unit_names, seed=cfg.train.seed, device=torch.device("cpu"))
    if resume is not None:
        _load_checkpoint_weights(units, meta.tied, resume)
    dtype = PRECISIONS[cfg.train.precision]
    if isinstance(meta.spec, SequentialSpec):  # its forward is the chain of its units
        units.autocast_dtype = dtype
        return units, units
    model = build_meta_model(cfg.model, cfg.parallel.get("stage_modules")).module
    tied = tied_groups(model)
    model.to_empty(device="cpu")
    for first, *others in tied:
        for other in others:
            owner, _, leaf = other.rpartition(".")
            setattr(model.get_submodule(owner), leaf, model.get_parameter(first))
    values = {**dict(units.named_parameters(remove_duplicate=False)), **dict(units.named_buffers())}
    with torch.no_grad():
        for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers()]:
            t.copy_(values[name])
    model.train()  # as the stages run (transformers builds models in eval mode when it loads them)
    forward = meta.spec.reference_forward(model)

    def cast(x: torch.Tensor, **kwargs: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=dtype) if dtype else nullcontext():
            return forward(x, **kwargs)

    return model, cast


def active_dropout(cfg: DictConfig) -> list[str]:
    """What applies dropout in training: ``nn.Dropout`` modules with p > 0, and modules holding an
    attention-dropout probability (transformers passes it to the attention kernel as a float)."""
    meta = build_meta_model(cfg.model, cfg.parallel.get("stage_modules"))
    found = []
    for name, m in meta.module.named_modules():
        if isinstance(m, nn.Dropout) and m.p > 0:
            found.append(f"{name} (p={m.p})")
        for attr in ("dropout", "attention_dropout"):
            p = getattr(m, attr, None)
            if isinstance(p, float) and p > 0:
                found.append(f"{name}.{attr}={p}")
    return found


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
    modules: Sequence[nn.Module],
    loss: float,
    batch: Batch,
    env: DistEnv,
    *,
    microbatches: int,
    skip: Collection[str] = (),
    resume: Path | None = None,
) -> dict:
    """Call after the first step's backward, before clipping and the optimizer, with the step's
    global batch and the layout's microbatch count. The reference runs in the run's precision
    (autocast for bf16) on CPU. Every rank gets the report; every rank raises ``VerifyError``
    together when it failed (none is left waiting). ``skip``: names of tied copies (see
    ``collect_grads``). ``resume``: the checkpoint the run resumed from (the reference's weights)."""
    got = gather_grads(modules, env, skip)
    report: dict | None = None
    if env.is_main:
        model, forward = reference_model(cfg, resume)
        inputs, targets, kwargs = batch
        step = UnsplitStep(model, microbatches, build_loss(cfg.loss), forward=forward)
        ref_loss = step(inputs, targets, **kwargs)
        rtol, atol = TOLERANCES[cfg.train.precision]
        report = compare(got, collect_grads([model]), loss, ref_loss.item(), rtol=rtol, atol=atol)
        if not report["passed"]:
            dropout = active_dropout(cfg)
            if dropout:
                report["problems"].insert(0, (
                    f"the model applies dropout in training ({', '.join(dropout[:6])}): the pipelined and the "
                    "unsplit run draw different random masks, so they cannot match. Fix: verify with dropout "
                    "off (model=hf: +model.config_overrides.<its config key>=0.0), then train with it."))
        log.info("verify: max abs diff %.3g, max rel diff %.3g, loss diff %.3g -> %s",
                 report["max_abs_diff"], report["max_rel_diff"], report["loss_abs_diff"],
                 "passed" if report["passed"] else "FAILED")
    if env.world_size > 1:
        box = [report]
        dist.broadcast_object_list(box, src=0)
        report = box[0]
    assert report is not None  # rank 0 made it; the other ranks received it
    if not report["passed"]:
        raise VerifyError(
            "verify=true: the pipelined first step differs from the unsplit model's:\n  "
            + "\n  ".join(report["problems"])
        )
    return report


class VerifyFirstStep(Hook):
    """``verify=true``: the first step this run trains, compared with the unsplit model's on the
    same batch, after the backward and before clipping; its report goes into the summary."""

    def __init__(self) -> None:
        self.report: dict | None = None

    def after_reduce(self, ctx: StepContext, state: StepState) -> None:
        if state.first:
            assert state.loss is not None  # reduced before after_reduce
            busy(f"verifying step {state.step} against the unsplit model")
            self.report = verify_first_step(ctx.cfg, ctx.modules, state.loss, state.batch, ctx.env,
                                            microbatches=ctx.plan.layout.microbatches,
                                            skip=ctx.not_counted, resume=ctx.plan.resume)

    def summary(self) -> dict:
        return {} if self.report is None else {"verify": self.report}
