"""A whole rank's memory: parameters, gradients and AdamW state (fp32, as the runner keeps them),
sharded over dp with ``parallel.dp_mode=fsdp``, plus the activations its schedule holds at its
peak. Used by every plan row: the target plans (``runner.plan.target``) and the probed ones.

What FSDP holds besides its shards follows ``runner.parallel.dp``: parameters stay gathered between
microbatches (``reshard_after_forward=False``), in the compute dtype, and torch's pipeline stages
accumulate unsharded gradients (fp32) until the last backward of the step, when they are
reduce-scattered. Not counted: the process itself (interpreter, libraries, CUDA context),
allocator slack, communication buffers and the transient buffers of a single op.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Sequence

__all__ = ["FP32", "rank_memory", "rank_params", "annotate_memory"]

FP32 = 4
_ADAMW = 2 * FP32  # exp_avg and exp_avg_sq per parameter


def rank_memory(params: int, activation_bytes: float, *, dp: int = 1, dp_mode: str = "none",
                compute_bytes: int = FP32) -> dict[str, int]:
    """Bytes one rank holds at its peak, by kind, and their ``total``. ``params``: the parameters
    of the rank's stages (a tied copy on two stages counts on both: each holds one); ``compute_bytes``:
    bytes per element of the dtype FSDP gathers parameters in (2 for bf16)."""
    shards = dp if dp_mode == "fsdp" else 1
    out = {"params": -(-params * FP32 // shards), "grads": -(-params * FP32 // shards),
           "optimizer": -(-params * _ADAMW // shards),
           "gathered": params * (compute_bytes + FP32) if dp_mode == "fsdp" and dp > 1 else 0,
           "activations": round(activation_bytes)}
    out["total"] = sum(out.values())
    return out


def rank_params(stages: Sequence[Iterable[str]], unit_params: Mapping[str, int],
                stage_to_rank: Mapping[int, int], pp: int) -> list[int]:
    """Parameters held by each pipeline rank: those of its stages' units."""
    out = [0] * pp
    for stage, names in enumerate(stages):
        out[stage_to_rank[stage]] += sum(unit_params[n] for n in names)
    return out


def annotate_memory(candidates: Iterable[Any], cfg: Any) -> None:
    """Set each predicted candidate's ``rank_memory_bytes`` (the whole-rank total per pipeline rank)
    from its ``rank_params`` and its peak in-flight activations (``peak_activation_bytes``), with
    the run's dp degree, dp mode and precision."""
    compute = 2 if cfg.train.precision == "bf16" else FP32
    for c in candidates:
        if c.rank_params and c.peak_activation_bytes:
            c.rank_memory_bytes = [rank_memory(n, act, dp=cfg.parallel.dp, dp_mode=cfg.parallel.dp_mode,
                                               compute_bytes=compute)["total"]
                                   for n, act in zip(c.rank_params, c.peak_activation_bytes)]
