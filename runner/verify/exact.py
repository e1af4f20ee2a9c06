"""``verify``'s float64 rerun: the unsplit reference's first step once more, in float64, to tell a
pipelined run's rounding from a defect (``runner.verify.compare``'s ``ROUNDING_FACTOR``). It runs
on rank 0 only where the strict check of that step failed, so a passing run pays nothing; the copy
is freed as soon as its gradients are taken.

The copy is the reference model itself (``copy.deepcopy``: the same weights, a checkpoint's after a
resume, ties kept) in float64, stepped as the reference steps (``UnsplitStep``: the same batch,
microbatches and counted-target weighting), with no autocast. Float64 throughout: models cast on
their own (transformers' RMSNorm computes its variance in float32, its rotary embeddings their
angles in float32, and the runner's cross-entropy casts logits to float32, whatever the model's
dtype), so ``_Float64`` turns every floating dtype a function asks for into float64 while it runs.

AdamW's state plays no part: the first step's loss and gradients are compared before any update.
Memory: the float64 weights and gradients (16 bytes per parameter) and one microbatch's activations
at twice their fp32 size, beside the reference; where that is more than rank 0's host has free,
or an allocation fails, there is no rerun and the strict verdict stands (the report says why). The
reference, and so the rerun, is on rank 0's CPU whatever the run's device (a CUDA run's too): the
check reads the host's memory, not a GPU's; ``_out_of_memory`` still knows a device's failed
allocation (``torch.OutOfMemoryError``, which ``torch.cuda.OutOfMemoryError`` is)."""

from __future__ import annotations

import copy
import gc
import logging
from typing import Callable

import torch
from omegaconf import DictConfig
from torch import nn
from torch.overrides import TorchFunctionMode

from runner.losses import build_loss, counted_targets
from runner.models.split import StageModule, build_meta_model
from runner.models.units import SequentialSpec
from runner.pipeline.step import Batch, UnsplitStep
from runner.verify.compare import Exact
from runner.verify.memory import available_bytes, float64_bytes

__all__ = ["float64_step"]

log = logging.getLogger(__name__)


def _float64(arg: object) -> object:
    return torch.float64 if isinstance(arg, torch.dtype) and arg.is_floating_point and arg != torch.float64 else arg


class _Float64(TorchFunctionMode):
    """Inside: every floating dtype a torch function or tensor method is asked for (``x.float()``,
    ``x.to(torch.float32)``, ``torch.zeros(..., dtype=torch.bfloat16)``) is float64."""

    _narrow = {torch.Tensor.float, torch.Tensor.half, torch.Tensor.bfloat16}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self._narrow:
            func = torch.Tensor.double
        args = tuple(_float64(a) for a in args)
        kwargs = {k: _float64(v) for k, v in (kwargs or {}).items()}
        return func(*args, **kwargs)


def _twin(model: nn.Module, cfg: DictConfig) -> tuple[nn.Module, Callable[..., torch.Tensor]]:
    """``model`` copied in float64 without its gradients, and its forward without autocast (as
    ``hook.reference_model``'s)."""
    params = list(model.parameters())
    grads = [p.grad for p in params]
    for p in params:
        p.grad = None
    try:
        twin = copy.deepcopy(model).to(torch.float64)
    finally:
        for p, g in zip(params, grads):
            p.grad = g
    spec = build_meta_model(cfg.model, cfg.parallel.get("stage_modules")).spec
    if isinstance(spec, SequentialSpec):  # its forward is the chain of its units
        assert isinstance(twin, StageModule)  # hook.reference_model's units
        twin.autocast_dtype = None
        return twin, twin
    return twin, spec.reference_forward(twin)


def _fits(cfg: DictConfig, batch: Batch, microbatches: int) -> str | None:
    """Why the float64 copy would not fit in the memory free now, or None where it does (or the
    free memory cannot be read)."""
    inputs, _, kwargs = batch
    available = available_bytes()
    if available is None:
        return None
    meta = build_meta_model(cfg.model, cfg.parallel.get("stage_modules"))
    rows = -(-inputs.shape[0] // microbatches)
    need = float64_bytes(meta, microbatch=rows, seq_len=inputs.shape[1],
                         kwargs={k: v[:rows] for k, v in kwargs.items()})
    if need <= available:
        return None
    return (f"not run: the float64 copy needs about {need / 2**30:.2f} GiB and rank 0's host has "
            f"{available / 2**30:.2f} GiB free")


def float64_step(model: nn.Module, cfg: DictConfig, batch: Batch, microbatches: int) -> Exact | str:
    """The reference ``model``'s step on ``batch`` over ``microbatches`` rerun in float64: its loss
    and every gradient by full name; or, where it cannot run, why (the strict verdict then stands)."""
    refused = _fits(cfg, batch, microbatches)
    if refused is None:
        try:
            return _rerun(model, cfg, batch, microbatches)
        except (MemoryError, RuntimeError) as e:
            if not _out_of_memory(e):
                raise
            refused = f"not run: out of memory ({str(e).splitlines()[0][:200]})"
        finally:
            gc.collect()  # the copy, at once
    log.warning("verify: the float64 rerun is %s: the strict verdict stands.", refused)
    return refused


def _out_of_memory(e: BaseException) -> bool:
    """An allocation that failed: Python's, a device's, or torch's CPU allocator's (a plain RuntimeError)."""
    return isinstance(e, (MemoryError, torch.OutOfMemoryError)) or "can't allocate memory" in str(e)


def _rerun(model: nn.Module, cfg: DictConfig, batch: Batch, microbatches: int) -> Exact:
    twin, forward = _twin(model, cfg)
    step = UnsplitStep(twin, microbatches, build_loss(cfg.loss), forward=forward)
    inputs, targets, kwargs = batch
    with _Float64():
        loss = step(inputs, targets, counted=counted_targets(targets), **kwargs).item()
    return Exact(loss=loss, grads={n: p.grad for n, p in twin.named_parameters() if p.grad is not None})
