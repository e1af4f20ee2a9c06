"""The rehearsed ranks composed into the whole step: their measured per-stage action times
replayed by the planner's exact simulator (``runner.pipeline.simulate``) in the schedule's order, with
a message cost between stages from ``plan.comm_latency_s`` / ``plan.comm_bandwidth`` (the planner's
link; null: 10 us and 50 GB/s); the step's MFU where the device's peak is known (torch's datasheet
table, as ``plan.target`` reads it; the model's FLOPs counted as the planner counts them); and each
rank's peak memory against a capacity.

Two steps are composed: the barrier's (the pipeline, then the tied weights' gradient sums where the
ranks holding a copy meet, then the tp/dp collectives, then the slowest rank's optimizer step), and
where the run has ``train.optimizer_sync=deferred`` its steady step
(``runner.pipeline.simulate.deferred_step``: steps back to back, each pipeline rank's own update
between its own steps, the tied weights' gradient sums where the ranks holding a copy meet, the
loss/norm all-reduce waited for a step later); ``step_s`` is the one
the run's mode takes (``post_validate``: the barrier's, each rank's update with its snapshot)."""

from __future__ import annotations

import statistics
from collections import defaultdict
from typing import Any, Sequence

from runner.layout import ResolvedRun
from runner.options import OptimizerSync
from runner.pipeline.ops import Op
from runner.pipeline.schedule import csv_order, schedule_order
from runner.pipeline.simulate import SimAction, deferred_step, expected_makespan, simulate
from runner.plan.link import Link, configured_link, tied_meetings

__all__ = ["compose_step", "step_mfu", "memory_verdicts", "VALIDATION_BYTES"]

VALIDATION_BYTES = 8  # the step's loss/norm all-reduce over the world: two float32 (runner.train.start_reduce)
# The schedule's messages, whatever dimension their group is named by (at pp = world size: "world").
P2P = ("send", "recv", "vote_send", "vote_recv")
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
    return sum(k["count"] * latency + k["bytes"] / bandwidth for dim, kinds in r["collectives"].items() if dim != "pp"
               for kind, k in kinds.items() if kind not in P2P)


def _meetings(resolved: ResolvedRun, latency: float, bandwidth: float) -> list[tuple[tuple[int, ...], float]]:
    """The tied weights' gradient sums, where the pipeline ranks holding a copy meet after every
    backward (``Layout.tied``), each a ring all-reduce of its gradient between them on the link
    (``runner.plan.link.tied_meetings``, as the planner prices them): not a rank's own collectives,
    in either step."""
    return tied_meetings(resolved.layout.tied, Link(latency, bandwidth))


def _listed(meetings: Sequence[tuple[tuple[int, ...], float]]) -> list[dict[str, Any]]:
    """``meetings`` as ``rehearsal.json`` lists them."""
    return [{"ranks": list(ranks), "seconds": seconds} for ranks, seconds in meetings]


def _filed_under_world(resolved: ResolvedRun, latency: float, bandwidth: float) -> float:
    """What ``_collective_s`` counted for the sums the rehearsal files among a rank's "world"
    collectives (at pp = world size the ranks holding a copy are the world): taken out of them,
    since they are meetings."""
    return sum(latency + span.grad_bytes / bandwidth for span in resolved.layout.tied
               if len(span.ranks) == resolved.world_size)


def _deferred(resolved: ResolvedRun, ranks: Sequence[dict], costs: dict[tuple[int, str], float], comm_s: float,
              latency: float, bandwidth: float) -> dict[str, Any]:
    """``train.optimizer_sync=deferred``'s steady step: each pipeline rank's update between its own
    steps (its slowest rehearsed rank's ``update_s``, measured on the deferred path, and its tp/dp
    collectives on the link, less the loss/norm all-reduce and the tied sums), the tied weights'
    gradient sums where their ranks meet, and that all-reduce (one message of ``VALIDATION_BYTES``)
    waited for a step later; the pipeline as ``deferred_step`` replays it without them (mean times:
    what the updates, the sums and the all-reduce add is ``step_s`` less it)."""
    validation_s = latency + VALIDATION_BYTES / bandwidth
    meetings = _meetings(resolved, latency, bandwidth)
    met = _filed_under_world(resolved, latency, bandwidth)
    update: dict[int, float] = {}
    collectives: dict[int, float] = {}
    for r in ranks:
        if r.get("update_s") is None:
            raise ValueError(f"rank {r['rank']} was not rehearsed with train.optimizer_sync=deferred (no update_s)")
        p = r["coords"]["pp"]
        update[p] = max(update.get(p, 0.0), r["update_s"])
        validated = "all_reduce" in r["collectives"].get("world", {})
        collectives[p] = max(collectives.get(p, 0.0),
                             _collective_s(r, latency, bandwidth) - validated * validation_s - met)
    order, stages = _order(resolved), resolved.layout.num_stages
    between = {p: update[p] + collectives[p] for p in update}
    step_s = deferred_step(order, costs, num_stages=stages, comm_s=comm_s, update_s=between, reduce_s=validation_s,
                           meetings=meetings)
    pipeline_s = deferred_step(order, costs, num_stages=stages, comm_s=comm_s)
    busy = sum(costs[(op.stage, op.kind)] for ops in order.values() for op in ops)
    return {"step_s": step_s, "pipeline_s": pipeline_s, "bubble": 1 - busy / (resolved.pp * pipeline_s),
            "update_s": {str(p): v for p, v in sorted(update.items())},
            "update_collectives_s": {str(p): v for p, v in sorted(collectives.items())}, "reduce_s": validation_s,
            "tied_meetings": _listed(meetings),
            "step_without_meetings_s": deferred_step(order, costs, num_stages=stages, comm_s=comm_s, update_s=between,
                                                     reduce_s=validation_s) if meetings else step_s}


def compose_step(resolved: ResolvedRun, ranks: Sequence[dict], *, latency_s: float | None = None,
                 bandwidth: float | None = None) -> tuple[dict[str, Any], list[SimAction]]:
    """The predicted step of the whole job from its rehearsed ranks (one per pipeline rank), and
    its simulated pipeline with the barrier (seconds, by pipeline rank): ``step_s`` the step the
    run's ``train.optimizer_sync`` takes, ``barrier_step_s`` the barrier's, and under ``deferred``
    its steady step's parts (``deferred``; see the module's docstring)."""
    latency, bw = configured_link(latency_s, bandwidth)  # null: the planner's and plan.target's default link
    costs = _stage_costs(ranks)
    missing = sorted({s for s in range(resolved.layout.num_stages)} - {s for s, _ in costs})
    if missing:
        raise ValueError(f"no rehearsed rank ran stage(s) {missing}: rehearse one rank of each pipeline rank")
    sends = [k["bytes"] / k["count"] for r in ranks for kinds in r["collectives"].values()
             for kind, k in kinds.items() if kind == "send"]
    comm_s = latency + (max(sends) / bw if sends else 0.0)
    order, num_stages = _order(resolved), resolved.layout.num_stages
    timeline = simulate(order, costs, num_stages=num_stages, comm_s=comm_s)
    pipeline_s = max(a.end for a in timeline)
    busy = sum(a.end - a.start for a in timeline)
    bubble = 1 - busy / (resolved.pp * pipeline_s)
    meetings = _meetings(resolved, latency, bw)
    # What the tied sums add after the pipeline: each starts when the last of its ranks ends its backward.
    tied_s = expected_makespan(order, costs, num_stages=num_stages, comm_s=comm_s,
                               meetings=meetings) - pipeline_s if meetings else 0.0
    collectives_s = max(_collective_s(r, latency, bw) for r in ranks) - _filed_under_world(resolved, latency, bw)
    optimizer_s = max(r["optimizer_s"] for r in ranks)
    barrier_s = pipeline_s + tied_s + collectives_s + optimizer_s
    sync = OptimizerSync(resolved.train.optimizer_sync)
    step = {"optimizer_sync": sync.value, "barrier_step_s": barrier_s, "pipeline_s": pipeline_s, "tied_s": tied_s,
            "tied_meetings": _listed(meetings), "collectives_s": collectives_s, "optimizer_s": optimizer_s,
            "bubble": bubble, "message_s": comm_s,
            "stage_costs_s": {f"{s}{k}": v for (s, k), v in sorted(costs.items())},
            "link": {"latency_s": latency, "bandwidth": bw}}
    if sync == OptimizerSync.deferred:
        step["deferred"] = _deferred(resolved, ranks, costs, comm_s, latency, bw)
        step["step_s"] = step["deferred"]["step_s"]
    elif sync == OptimizerSync.post_validate:  # the barrier's step, each rank's update with its snapshot
        step["step_s"] = pipeline_s + tied_s + collectives_s + max(r["update_s"] for r in ranks)
    else:
        step["step_s"] = barrier_s
    step["tokens_per_s"] = resolved.tokens_per_step / step["step_s"]
    return step, timeline


def step_mfu(cfg, resolved: ResolvedRun, step_s: float, device_name: str | None) -> dict[str, Any]:
    """The composed step's model FLOPs utilisation on ``device_name`` (the local GPU's name; None on
    CPU): the model's FLOPs for the step's batch (``runner.plan.target.model_flops``: three times the
    forward's, counted as the planner counts them, the whole model, not a shard) over ``step_s`` x
    world size x the device's dense peak in the run's precision. Unknown, and said why, where
    torch's table has no peak for the device."""
    import torch

    from runner.plan.roofline import lookup_peaks
    from runner.plan.target import count_units, model_flops

    peaks = lookup_peaks(device_name) if device_name else None
    if peaks is None:
        why = (f"{device_name!r} is not in torch's datasheet table" if device_name
               else "the CPU's peak FLOP/s are not known (torch's datasheet table holds GPUs)")
        return {"mfu": None, "mfu_unknown": why}
    counts = count_units(cfg, resolved.microbatch_size, peaks,
                         cast_params=resolved.dp_mode == "fsdp" and resolved.train.precision == "bf16")
    flops = resolved.dp * resolved.layout.microbatches * model_flops(counts)
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
