"""Whether ``verify``'s unsplit reference fits in memory, asked before any rank starts.

The reference trains the whole model on rank 0's host (on CPU, whatever the run's device) beside
the run, so it needs the whole model's AdamW training state at once, which no rank of a pipeline
holds. Estimated from the meta model: no memory is allocated. Here, not in ``verify.hook``, so
that validation imports no training code."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from runner.errors import ConfigError

if TYPE_CHECKING:
    from runner.models.split import MetaModel

__all__ = ["activation_bytes", "num_params", "reference_bytes", "float64_bytes", "available_bytes",
           "check_reference_fits"]

log = logging.getLogger(__name__)

FP32 = 4  # parameters, gradients and AdamW's moments stay fp32 whatever train.precision is
# Per parameter on rank 0: the reference's weights, gradients and AdamW's two moments, and the run's
# weights (or gradients) gathered from every rank to compare with them, which arrive pickled (a
# second copy while they are unpacked). Measured: rank 0's peak rose by 7.7 x the fp32 parameter
# bytes with verify on a 34M-parameter model, activations included (docs/verify.md).
REFERENCE_COPIES = 7
RANK_COPIES = 4  # per parameter in each replica's ranks: weights, gradients, two moments
# The loss's own tensors per logit (the logits, their log-softmax and its gradient), which a
# forward through the units leaves out.
LOSS_COPIES = 3


def activation_bytes(meta: MetaModel, *, microbatch: int, seq_len: int, kwargs: dict[str, torch.Tensor]) -> int:
    """What autograd keeps for the backward of one microbatch through the whole model: the
    tensors a forward on the meta device saves (the parameters it saves are counted as weights),
    and the loss's tensors over the logits. Call after ``split.check_shapes`` passed.

    The hook keeps a detached view of each saved tensor, never the tensor itself: a tensor its own
    node saves (an output, as attention's) then referenced that node from inside it, a cycle through
    autograd's C++ that no collection frees, and the whole graph (parameters, activations) outlived
    the call. The planner's timed units (``runner.plan.costs``, ``runner.plan.target``) count so too."""
    params = {id(p) for p in meta.module.parameters()}
    saved = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in params and id(t._base) not in params:
            saved[0] += t.numel() * t.element_size()
        return t.detach()  # not ``t``: see above

    x = torch.zeros(microbatch, seq_len, dtype=torch.long, device="meta")
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):  # shapes only: no memory
        logits = meta.spec.run(meta.module, meta.unit_names, x, {k: v.to("meta") for k, v in kwargs.items()})
    return saved[0] + LOSS_COPIES * logits.numel() * FP32


def num_params(meta: MetaModel) -> int:
    return sum(p.numel() for p in meta.module.parameters())  # a tied weight once


def reference_bytes(meta: MetaModel, *, microbatch: int, seq_len: int, kwargs: dict[str, torch.Tensor],
                    dp: int = 1) -> int:
    """The reference's peak on rank 0's host: its training state and the activations of one of
    its microbatches (it runs them one after another). ``microbatch`` and ``kwargs``: one replica's;
    the reference's microbatch is ``dp`` of them (the global batch split as the pipeline splits it)."""
    activations = activation_bytes(meta, microbatch=microbatch, seq_len=seq_len, kwargs=kwargs)
    return REFERENCE_COPIES * FP32 * num_params(meta) + dp * activations


def available_bytes() -> int | None:
    """Memory this process may still take: the host's ``MemAvailable``, bounded by its cgroup's
    limit (a container's) where one is set; None where neither can be read (not Linux)."""
    found = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append(int(line.split()[1]) * 1024)
        cgroup = Path("/sys/fs/cgroup")
        limit = (cgroup / "memory.max").read_text().strip() if (cgroup / "memory.max").is_file() else "max"
        if limit != "max":
            found.append(int(limit) - int((cgroup / "memory.current").read_text()))
    except (OSError, ValueError):
        pass
    return min(found) if found else None


def check_reference_fits(meta: MetaModel, *, microbatch: int, dp: int, seq_len: int, device: str,
                         kwargs: dict[str, torch.Tensor]) -> None:
    """Refuse ``verify`` where its reference (with, for a CPU run, the run's own ranks on the same
    host) would not fit in the memory available now; arguments as ``reference_bytes``'."""
    available = available_bytes()
    if available is None:
        log.info("verify: this host's free memory cannot be read; the reference's fit is not checked.")
        return
    reference = reference_bytes(meta, microbatch=microbatch, seq_len=seq_len, kwargs=kwargs, dp=dp)
    ranks = RANK_COPIES * FP32 * dp * num_params(meta) if device == "cpu" else 0
    if reference + ranks > available:
        gib = 2**30
        beside = f" beside the run's own ranks on this host ({ranks / gib:.1f} GiB)" if ranks else ""
        raise ConfigError(
            f"verify=true: the unsplit reference needs about {reference / gib:.1f} GiB on rank 0's host (the whole "
            f"model's weights, gradients and AdamW moments, and one microbatch's activations){beside}, and "
            f"{available / gib:.1f} GiB is available. Fix: verify=false, or verify this layout on a smaller model "
            f"of the same family (fewer layers: model.n_layers, or +model.config_overrides.num_hidden_layers for "
            f"model=hf), or a host with more memory.")


def float64_bytes(meta: MetaModel, *, microbatch: int, seq_len: int, kwargs: dict[str, torch.Tensor]) -> int:
    """What ``verify``'s float64 rerun (``runner.verify.exact``) adds on rank 0's host beside the
    reference: the model's weights and gradients in float64, and one microbatch's activations at
    twice their fp32 size (``microbatch``: the reference's rows per microbatch)."""
    activations = activation_bytes(meta, microbatch=microbatch, seq_len=seq_len, kwargs=kwargs)
    return 2 * 8 * num_params(meta) + 2 * activations
