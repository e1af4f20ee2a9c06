"""The rehearsed ranks composed into the whole step: their measured per-stage action times
replayed by the planner's exact simulator (``runner.pipeline.simulate``) in the schedule's order, with
a message cost between stages from ``plan.comm_latency_s`` / ``plan.comm_bandwidth`` (the planner's
link; null: 10 us and 50 GB/s); the step's MFU where the device's peak is known (torch's datasheet
table, as ``plan.target`` reads it; the model's FLOPs counted as the planner counts them); and each
rank's peak memory against a capacity."""

from __future__ import annotations

import statistics
from collections import defaultdict
from typing import Any, Sequence

from runner.layout import ResolvedRun
from runner.pipeline.ops import Op
from runner.pipeline.schedule import csv_order, schedule_order
from runner.pipeline.simulate import SimAction, simulate

__all__ = ["compose_step", "step_mfu", "memory_verdicts", "DEFAULT_LATENCY_S", "DEFAULT_BANDWIDTH"]

DEFAULT_LATENCY_S = 10e-6
DEFAULT_BANDWIDTH = 50e9  # bytes/s: a 400 Gbit/s link per device
GiB = 2**30
MiB = 2**20


def _order(resolved: ResolvedRun) -> dict[int, list[Op]]:
    layout = resolved.layout
    if layout.pp == 1:  # the unsplit model: each microbatch's forward and backward in turn
        return {0: [Op(0, kind, mb) for mb in range(layout.microbatches) for kind in "FB"]}
    if layout.csv:
        return csv_order(layout.csv)
    return schedule_order(layout.schedule, layout.pp, layout.microbatches, layout.stages_per_rank)


def _stage_costs(ranks: Sequence[dict]) -> dict[tuple[int, str], float]:
    """The median time of each (stage, kind) over its microbatches, from whichever rank ran it."""
    times: dict[tuple[int, str], list[float]] = defaultdict(list)
    for r in ranks:
        for a in r["actions"]:
            times[(a["stage"], a["kind"])].append(a["seconds"])
    return {k: statistics.median(v) for k, v in times.items()}


def _collective_s(r: dict, latency: float, bandwidth: float) -> float:
    """What the rank's tp/dp/world collectives of one step would cost on the link, one after the
    other (the rehearsal answered them at once, so the measured actions hold none of it)."""
    return sum(k["count"] * latency + k["bytes"] / bandwidth
               for dim, kinds in r["collectives"].items() if dim != "pp" for k in kinds.values())


def compose_step(resolved: ResolvedRun, ranks: Sequence[dict], *, latency_s: float | None = None,
                 bandwidth: float | None = None) -> tuple[dict[str, Any], list[SimAction]]:
    """The predicted step of the whole job from its rehearsed ranks (one per pipeline rank), and
    its simulated pipeline (seconds, by pipeline rank)."""
    latency = DEFAULT_LATENCY_S if latency_s is None else latency_s
    bw = DEFAULT_BANDWIDTH if bandwidth is None else bandwidth
    costs = _stage_costs(ranks)
    missing = sorted({s for s in range(resolved.layout.num_stages)} - {s for s, _ in costs})
    if missing:
        raise ValueError(f"no rehearsed rank ran stage(s) {missing}: rehearse one rank of each pipeline rank")
    sends = [(k["bytes"] / k["count"]) for r in ranks for k in [r["collectives"].get("pp", {}).get("send")] if k]
    comm_s = latency + (max(sends) / bw if sends else 0.0)
    timeline = simulate(_order(resolved), costs, num_stages=resolved.layout.num_stages, comm_s=comm_s)
    pipeline_s = max(a.end for a in timeline)
    busy = sum(a.end - a.start for a in timeline)
    bubble = 1 - busy / (resolved.pp * pipeline_s)
    collectives_s = max(_collective_s(r, latency, bw) for r in ranks)
    optimizer_s = max(r["optimizer_s"] for r in ranks)
    step_s = pipeline_s + collectives_s + optimizer_s
    return {"step_s": step_s, "pipeline_s": pipeline_s, "collectives_s": collectives_s, "optimizer_s": optimizer_s,
            "bubble": bubble, "tokens_per_s": resolved.tokens_per_step / step_s, "message_s": comm_s,
            "stage_costs_s": {f"{s}{k}": v for (s, k), v in sorted(costs.items())},
            "link": {"latency_s": latency, "bandwidth": bw}}, timeline


def step_mfu(cfg, resolved: ResolvedRun, step_s: float, device_name: str | None) -> dict[str, Any]:
    """The composed step's model FLOPs utilisation on ``device_name`` (the local GPU's name; None on
    CPU): the model's F, I and W FLOPs for the step's batch (``runner.plan.target.count_units``, as
    the planner counts them: the whole model, not a shard) over ``step_s`` x world size x the
    device's dense peak in the run's precision. Unknown, and said why, where torch's table has no
    peak for the device."""
    import torch

    from runner.plan.roofline import lookup_peaks
    from runner.plan.target import count_units

    peaks = lookup_peaks(device_name) if device_name else None
    if peaks is None:
        why = (f"{device_name!r} is not in torch's datasheet table" if device_name
               else "the CPU's peak FLOP/s are not known (torch's datasheet table holds GPUs)")
        return {"mfu": None, "mfu_unknown": why}
    counts = count_units(cfg, resolved.microbatch_size, peaks,
                         cast_params=resolved.dp_mode == "fsdp" and resolved.train.precision == "bf16")
    flops = resolved.dp * resolved.layout.microbatches * sum(sum(u.flops.values()) for u in counts.values())
    dtype = torch.bfloat16 if resolved.train.precision == "bf16" else torch.float32
    return {"mfu": flops / (step_s * resolved.world_size * peaks.peak(dtype)), "model_flops": flops,
            "peak_flops": peaks.peak(dtype), "peak_of": peaks.name}


def _size(nbytes: float) -> str:
    return f"{nbytes / GiB:.2f} GiB" if nbytes >= GiB else f"{nbytes / MiB:.2f} MiB"


def memory_verdicts(ranks: Sequence[dict], capacity: int | None, dims) -> list[str]:
    """One line per rank over ``capacity`` (bytes), naming its peak, the capacity and what to try;
    ``["fits"]`` where none is over."""
    if capacity is None:
        return ["no capacity: rehearse.capacity=<bytes> (e.g. 80GiB) for a verdict"]
    lines = []
    for r in ranks:
        peak = r["peak_bytes"]["total"]
        if peak > capacity:
            tries = ["more parallel.pp", "more parallel.tp", "train.activation_checkpointing=full",
                     "fewer microbatches in flight (a smaller train.batch_size)"]
            if dims.dp > 1 and dims.dp_mode != "fsdp":
                tries.insert(0, "parallel.dp_mode=fsdp")
            lines.append(f"rank {r['rank']} needs {_size(peak - capacity)} more: its peak is {_size(peak)}, "
                         f"the capacity {_size(capacity)} (rehearse.capacity). Fix: try {', '.join(tries)}")
    return lines or ["fits"]
