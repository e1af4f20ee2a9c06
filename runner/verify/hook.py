"""``verify=true``: the unsplit model trains on rank 0 beside the run, from the run's initial
weights (a resumed run: the checkpoint's weights, as its stages hold them, and the run's AdamW
state), with the run's own optimizer, parameter groups, clipping and LR schedule
(``runner.optim``), on the same batches split into the same microbatches. The reference is the
model's own forward (for a Hugging Face model, transformers' forward of the unmodified model).
What it holds the run to, over the first ``verify_steps`` (K) optimizer steps:

* step 1: the loss and every parameter's gradient (``TOLERANCES``): gradients silently scaled,
  missing or applied to the wrong stage, units that do not compute what the model does;
* after each of steps 1..K: every weight, in units of that step's learning rate
  (``WEIGHT_TOLERANCES``): an update applied twice or skipped, a wrong decay group or clip;
* steps 2..K+1: the loss and the global gradient norm (``DRIFT``).

The rules and their tolerances are ``runner.verify.compare``'s."""

from __future__ import annotations

import functools
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
from runner.layout import ResolvedRun
from runner.losses import build_loss, counted_targets
from runner.models.split import build_meta_model, materialize
from runner.models.units import SequentialSpec, tied_groups
from runner.optim import build_optimizer, clip_grads
from runner.parallel.parallelize import PRECISIONS
from runner.pipeline.step import Batch, UnsplitStep
from runner.ranks.dist import DistEnv, gather_to_main
from runner.ranks.watchdog import busy
from runner.verify.compare import (
    DRIFT,
    TOLERANCES,
    WEIGHT_TOLERANCES,
    Exact,
    compare,
    compare_drift,
    compare_weights,
    rounding_line,
)
from runner.verify.exact import float64_step

__all__ = ["collect", "collect_grads", "gather", "gather_grads", "reference_model", "Reference", "Verify"]

log = logging.getLogger(__name__)


def _grad(p: nn.Parameter) -> torch.Tensor | None:
    return p.grad


def _weight(p: nn.Parameter) -> torch.Tensor:
    return p


def collect(modules: Sequence[nn.Module], value: Callable[[nn.Parameter], torch.Tensor | None] = _grad,
            skip: Collection[str] = ()) -> dict[str, torch.Tensor | None]:
    """Full parameter name → a CPU copy of the whole of ``value(parameter)`` (its gradient by
    default; None where there is none), but for the names in ``skip`` (copies of a tied weight,
    which the unsplit model names once). Sharded (DTensor) values are gathered: a collective over
    their mesh, so every rank calls this at the same point."""

    def whole(t: torch.Tensor) -> torch.Tensor:
        return (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu().clone()

    out, seen = {}, set()
    for module in modules:
        for name, p in module.named_parameters():
            if name not in skip and id(p) not in seen:  # a weight two stages share: under its first name
                seen.add(id(p))
                t = value(p)
                out[name] = None if t is None else whole(t)
    return out


def collect_grads(modules: Sequence[nn.Module], skip: Collection[str] = ()) -> dict[str, torch.Tensor | None]:
    """Every gradient, by full name (``collect``)."""
    return collect(modules, _grad, skip)


def gather(modules: Sequence[nn.Module], env: DistEnv, value: Callable[[nn.Parameter], torch.Tensor | None] = _grad,
           skip: Collection[str] = ()) -> dict[str, torch.Tensor | None]:
    """Every rank's ``collect``, by full name, on rank 0 (empty elsewhere): where ranks hold
    copies of one tensor (dp replicas, tp and FSDP peers), the last rank's. Collective."""
    return _merged(gather_to_main(collect(modules, value, skip), env) or [])


def _merged(parts: Sequence[dict[str, torch.Tensor | None]]) -> dict[str, torch.Tensor | None]:
    return {name: t for part in parts for name, t in part.items()}


def _other_copies(parts: Sequence[dict[str, torch.Tensor | None]],
                  merged: dict[str, torch.Tensor | None]) -> list[tuple[int, dict[str, torch.Tensor | None]]]:
    """Per rank, its copies of tensors ``merged`` holds another rank's copy of (a dp replica's,
    a tp or FSDP peer's): each must match the reference as the merged one does, or a defect on
    one replica would pass."""
    others = [(rank, {n: t for n, t in part.items() if merged.get(n) is not t}) for rank, part in enumerate(parts)]
    return [(rank, copies) for rank, copies in others if copies]


def gather_grads(modules: Sequence[nn.Module], env: DistEnv,
                 skip: Collection[str] = ()) -> dict[str, torch.Tensor | None]:
    """Every rank's gradients, by full name, on rank 0 (empty elsewhere). Collective."""
    return gather(modules, env, _grad, skip)


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


ADAM_STATE = ("step", "exp_avg", "exp_avg_sq")  # AdamW's state per parameter


class Reference:
    """The unsplit model on rank 0 (CPU, the run's precision), trained as the run trains: the
    same microbatches and loss scaling (``UnsplitStep``), the run's AdamW and parameter groups
    (a head tied to the embedding is the embedding's parameter here, so it skips decay as the
    run's tied-embedding exemption has it do), its clipping and LR schedule (``runner.optim``)."""

    def __init__(self, cfg: DictConfig, resolved: ResolvedRun):
        self.model, forward = reference_model(cfg, resolved.resume)
        self.unsplit = UnsplitStep(self.model, resolved.layout.microbatches, build_loss(cfg.loss), forward=forward)
        self.optimizer, self.scheduler = build_optimizer([self.model], resolved.train)
        self.grad_clip = resolved.train.grad_clip

    def backward(self, batch: Batch) -> tuple[float, float]:
        """The step's forward and backward on the global batch: its loss and global gradient norm."""
        self.optimizer.zero_grad(set_to_none=True)
        inputs, targets, kwargs = batch
        loss = self.unsplit(inputs, targets, counted=counted_targets(targets), **kwargs).item()  # the whole batch
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        return loss, torch.nn.utils.get_total_norm(grads).item()

    def update(self, grad_norm: float) -> float:
        """Clip and step as the run's trainer does; returns the learning rate of the update."""
        clip_grads(list(self.model.parameters()), self.grad_clip, grad_norm)
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()
        return lr

    def weights(self) -> dict[str, torch.Tensor]:
        """Every parameter by every name it has (a tied weight under each of its names)."""
        return {n: p.detach() for n, p in self.model.named_parameters(remove_duplicate=False)}

    def resume_state(self, moments: dict[str, dict[str, torch.Tensor | None]], scheduler: dict) -> None:
        """A resumed run's AdamW state (``state[key][name]``, gathered from its ranks) and LR
        schedule: the reference then updates from where the run's optimizer stands."""
        named = dict(self.model.named_parameters())
        for name, p in named.items():
            if moments["exp_avg"].get(name) is not None:
                self.optimizer.state[p] = {key: moments[key][name] for key in ADAM_STATE}
        self.scheduler.load_state_dict(scheduler)
        for group, lr in zip(self.optimizer.param_groups, self.scheduler.get_last_lr()):
            group["lr"] = lr


def _gather_adam_state(ctx: StepContext) -> dict[str, dict[str, torch.Tensor | None]]:
    """This run's AdamW state on rank 0, per state key, by full parameter name. Collective."""
    state = ctx.optimizer.state

    def of(key: str) -> Callable[[nn.Parameter], torch.Tensor | None]:
        return lambda p: state[p].get(key) if p in state else None

    return {key: gather(ctx.modules, ctx.env, of(key), ctx.not_counted) for key in ADAM_STATE}


def _conclude(report: dict | None, env: DistEnv, what: str) -> dict:
    """Rank 0's ``report`` on every rank; every rank raises ``VerifyError`` together when it
    failed (none is left waiting). ``what``: what differed, for the message."""
    if env.world_size > 1:
        box = [report]
        dist.broadcast_object_list(box, src=0)
        report = box[0]
    assert report is not None  # rank 0 made it; the other ranks received it
    if not report["passed"]:
        problems = "\n  ".join(report["problems"])
        raise VerifyError(f"verify=true: {what} from the unsplit model's:\n  {problems}")
    return report


def _with_dropout_hint(report: dict, cfg: DictConfig) -> dict:
    """A failed first step of a model that applies dropout: the reason, first."""
    dropout = active_dropout(cfg) if not report["passed"] else []
    if dropout:
        report["problems"].insert(0, (
            f"the model applies dropout in training ({', '.join(dropout[:6])}): the pipelined and the "
            "unsplit run draw different random masks, so they cannot match. Fix: verify with dropout "
            "off (model=hf: +model.config_overrides.<its config key>=0.0), then train with it."))
    return report


def _first_step(ctx: StepContext, reference: Reference, parts: Sequence[dict[str, torch.Tensor | None]],
                loss: float, ref_loss: float, batch: Batch) -> dict:
    """The first step's loss and every rank's gradients (``parts``) against the reference's, each
    rank's copies of a tensor on their own; the float64 rerun (``_float64``) run at most once,
    where some value fails the strict tolerances."""
    rtol, atol = TOLERANCES[ctx.resolved.train.precision]
    got, ref = _merged(parts), collect_grads([reference.model])
    exact = functools.cache(lambda: _float64(ctx, reference, batch))
    report = compare(got, ref, loss, ref_loss, rtol=rtol, atol=atol, exact=exact)
    others = _hold_other_copies(report, parts, got, lambda copies: compare(  # gradients only
        copies, {n: ref[n] for n in copies if n in ref}, ref_loss, ref_loss, rtol=rtol, atol=atol, exact=exact),
        "rank {rank}'s copy of ")
    for other in (o["rounding"] for o in others if o["rounding"]):  # the copies' admitted: any rank's largest
        report["rounding"] = report["rounding"] or {**other, "admitted": {}, "beyond": {}}
        admitted = report["rounding"]["admitted"]
        for name, numbers in other["admitted"].items():
            if numbers["run_off"] > admitted.get(name, {"run_off": -1.0})["run_off"]:
                admitted[name] = numbers
    if report["rounding"]:
        report["rounding"]["summary"] = rounding_line(report["rounding"])
        report["problems"] += [report["rounding"]["summary"]] if report["problems"] else []
    return report


def _float64(ctx: StepContext, reference: Reference, batch: Batch) -> Exact | str:
    """The reference's first step rerun in float64 (``runner.verify.exact``), or why not: in bf16
    the strict tolerances are already that precision's rounding scale (ten times a bf16 noise
    floor would admit a gradient several percent off: a missing microbatch of 8 is 12.5%), and
    under dropout a rerun draws other masks (its difference would be the masks', not rounding)."""
    precision = ctx.resolved.train.precision
    if precision != "fp32":
        return (f"not run: train.precision={precision}, whose tolerances are its rounding scale already "
                f"(a multiple of its noise floor would admit a real defect)")
    if active_dropout(ctx.cfg):
        return "not run: the model applies dropout in training (a rerun draws other masks)"
    busy("verify: the unsplit first step rerun in float64, to tell rounding from a defect")
    return float64_step(reference.model, ctx.cfg, batch, ctx.resolved.layout.microbatches)


def _hold_other_copies(report: dict, parts: Sequence[dict[str, torch.Tensor | None]],
                       merged: dict[str, torch.Tensor | None], check: Callable[[dict], dict],
                       prefix: str) -> list[dict]:
    """Every rank's other copies (``_other_copies``) held by ``check`` as the merged ones were: their
    problems added to ``report``'s, each after ``prefix`` (formatted with the rank), and
    ``passed`` set again. Returns their reports."""
    others = []
    for rank, copies in _other_copies(parts, merged):
        other = check(copies)
        report["problems"] += [prefix.format(rank=rank) + p for p in other["problems"]]
        others.append(other)
    report["passed"] = not report["problems"]
    return others


class Verify(Hook):
    """``verify=true`` (see the module's docstring): rank 0's reference steps beside the run from
    the first step this run trains; each check's report goes into the summary's ``verify``."""

    def __init__(self) -> None:
        self.report: dict | None = None
        self.first = 0  # the first step this run trains (after a resume: the one after the checkpoint)
        self.reference: Reference | None = None  # rank 0's, until the last step compared
        self.lr = 0.0  # the learning rate of the update being verified (rank 0's reference's)
        self.ref_grad_norm = 0.0  # the reference's global gradient norm at this step, before clipping

    def _nth(self, ctx: StepContext, state: StepState) -> int:
        """Which verified step this is (from 1), or 0 past the last one compared (K + 1)."""
        if state.first:
            self.first = state.step
        nth = state.step - self.first + 1
        return nth if self.first and nth <= ctx.resolved.verify_steps + 1 else 0

    def after_reduce(self, ctx: StepContext, state: StepState) -> None:
        nth = self._nth(ctx, state)
        if not nth:
            return
        busy(f"verifying step {state.step} against the unsplit model")
        if nth == 1:
            self._start(ctx, state)
        else:
            self._drift(ctx, state)
        if ctx.env.is_main and self.reference is not None:
            if nth <= ctx.resolved.verify_steps:
                self.lr = self.reference.update(self.ref_grad_norm)
            else:
                self.reference = None  # K + 1 compared: its memory back

    def _start(self, ctx: StepContext, state: StepState) -> None:
        """The first step: the reference built (a resumed run's AdamW state copied into it), its
        loss and every gradient against the run's, before clipping; where they differ, the float64
        rerun tells rounding from a defect (``_float64``)."""
        assert state.loss is not None  # reduced before after_reduce
        parts = gather_to_main(collect_grads(ctx.modules, ctx.not_counted), ctx.env)
        moments = _gather_adam_state(ctx) if ctx.resolved.resume is not None else None
        report = None
        if parts is not None:  # rank 0
            self.reference = reference = Reference(ctx.cfg, ctx.resolved)
            if moments is not None:
                reference.resume_state(moments, ctx.scheduler.state_dict())
            ref_loss, self.ref_grad_norm = reference.backward(state.batch)
            report = _first_step(ctx, reference, parts, state.loss, ref_loss, state.batch)
            report = _with_dropout_hint(report, ctx.cfg)
            report.update(grad_norm=state.grad_norm, ref_grad_norm=self.ref_grad_norm, steps=[])
            log.info("verify: step %d: max abs grad diff %.3g, max rel diff %.3g, loss diff %.3g -> %s%s", state.step,
                     report["max_abs_diff"], report["max_rel_diff"], report["loss_abs_diff"],
                     "passed" if report["passed"] else "FAILED",
                     f"; {report['rounding']['summary']}" if report["rounding"] else "")
        self.report = _conclude(report, ctx.env, f"the pipelined first step (step {state.step}) differs")

    def _drift(self, ctx: StepContext, state: StepState) -> None:
        """A later step's loss and gradient norm, computed from the updated weights."""
        assert state.loss is not None and state.grad_norm is not None
        report = None
        if ctx.env.is_main:
            assert self.reference is not None
            ref_loss, self.ref_grad_norm = self.reference.backward(state.batch)
            report = compare_drift(state.loss, ref_loss, state.grad_norm, self.ref_grad_norm,
                                   rtol=DRIFT[ctx.resolved.train.precision])
            log.info("verify: step %d: loss rel diff %.3g, grad norm rel diff %.3g -> %s", state.step,
                     report["loss_rel_diff"], report["grad_norm_rel_diff"], "passed" if report["passed"] else "FAILED")
        self._record(state.step, "loss_and_grad_norm",
                     _conclude(report, ctx.env, f"step {state.step}'s loss or gradient norm differs"))

    def after_step(self, ctx: StepContext, state: StepState) -> None:
        """After each of the first K updates: every weight (tied copies under each of their names)."""
        nth = self._nth(ctx, state)
        if not nth or nth > ctx.resolved.verify_steps:
            return
        busy(f"verifying the weights after step {state.step} against the unsplit model")
        parts = gather_to_main(collect(ctx.modules, _weight), ctx.env)
        report = None
        if parts is not None:  # rank 0
            assert self.reference is not None
            units, fraction = WEIGHT_TOLERANCES[ctx.resolved.train.precision]
            got, ref = _merged(parts), self.reference.weights()
            report = compare_weights(got, ref, self.lr, max_lr_units=units, max_fraction=fraction)
            _hold_other_copies(report, parts, got, lambda copies: compare_weights(
                copies, ref, self.lr, max_lr_units=units, max_fraction=fraction), "rank {rank}'s copies: ")
            log.info("verify: weights after step %d: at most %.3g lr apart, %.3g%% of them beyond %g lr -> %s",
                     state.step, report["max_lr_units"], 100 * report["fraction_off"], units,
                     "passed" if report["passed"] else "FAILED")
        what = f"the weights after step {state.step}'s update differ"
        self._record(state.step, "weights", _conclude(report, ctx.env, what))

    def _record(self, step: int, what: str, report: dict) -> None:
        assert self.report is not None  # the first step's, made before any later one
        steps = self.report["steps"]
        if not steps or steps[-1]["step"] != step:
            steps.append({"step": step})
        steps[-1][what] = {k: v for k, v in report.items() if k != "problems"}

    def summary(self) -> dict:
        return {} if self.report is None else {"verify": self.report}
