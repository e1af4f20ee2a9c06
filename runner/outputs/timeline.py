"""Turning recorded actions into files: the executed ``schedule.csv``, the merged chrome trace
``timeline.json`` (one process per rank, flow arrows along every send → receive), the simulated
``schedule_sim.json``, the ``schedule.png`` picture, and the bubble."""

from __future__ import annotations

import csv
import dataclasses
import json
import socket
import statistics
import time
from collections import defaultdict
from pathlib import Path
from typing import AbstractSet, Any, Mapping, NamedTuple, Sequence, TypeVar

from runner.outputs.collectives import Collective
from runner.pipeline.ops import Op
from runner.pipeline.recorder import Action, StepSpan
from runner.pipeline.simulate import SimAction

__all__ = ["HostClock", "host_clock", "clock_offsets", "shift", "executed_order",
           "write_schedule_csv", "mean_costs", "pipeline_spans", "measured_bubble", "write_chrome_trace",
           "measured_slices", "simulated_slices", "plot_schedule"]

COLORS = {"F": "#4C78A8", "B": "#54A24B", "I": "#88D27A", "W": "#F58518"}
# What the tp collectives lane holds on CUDA, where the compute beside it is the device's (CUDA events):
# the host's calls, from the issue to the return of the wait, not the NCCL kernels (in the rank's trace).
HOST_CALLS = "host calls: issue to wait, not the device's"


class HostClock(NamedTuple):
    host: str
    wall_minus_monotonic_ns: int  # time.time_ns() - time.perf_counter_ns(), read together


def host_clock() -> HostClock:
    return HostClock(socket.gethostname(), time.time_ns() - time.perf_counter_ns())


def clock_offsets(clocks: Mapping[int, HostClock]) -> tuple[dict[int, int], str]:
    """Nanoseconds to add to each rank's ``perf_counter_ns`` readings to put them on rank 0's
    clock, and how they were found (written into the timeline). Ranks on rank 0's host read the
    same monotonic clock: offset 0, exactly. Another host's monotonic clock has its own origin;
    its readings are mapped through the two hosts' wall clocks, so they are as close as those
    clocks are synchronised (NTP: typically well under a millisecond in one data centre)."""
    ref = clocks[min(clocks)]
    offsets = {r: 0 if c.host == ref.host else c.wall_minus_monotonic_ns - ref.wall_minus_monotonic_ns
               for r, c in clocks.items()}
    hosts = sorted({c.host for c in clocks.values()})
    if len(hosts) == 1:
        return offsets, (f"one host ({hosts[0]}): every rank's times are its reading of the host's monotonic clock "
                         "(time.perf_counter: CLOCK_MONOTONIC on Linux), used as is")
    return offsets, (f"{len(hosts)} hosts: ranks on {ref.host} (rank 0's) use its monotonic clock as is; the "
                     "readings of the other hosts' ranks are mapped to it through each host's wall clock "
                     "(time.time - time.perf_counter, read at the start of profiling), so they are as exact "
                     "as the hosts' clock synchronisation (NTP or PTP)")


Timed = TypeVar("Timed", Action, StepSpan, Collective)


def shift(items: Sequence[Timed], offset_ns: int) -> list[Timed]:
    """``items`` (actions, step spans, collectives: each timed by ``start_ns`` and ``end_ns``, and
    the host's readings around a CUDA call, ``call_ns``) moved by ``offset_ns``, onto rank 0's clock."""
    def moved(i: Timed) -> Timed:
        call = getattr(i, "call_ns", None)
        more: dict[str, Any] = {"call_ns": (call[0] + offset_ns, call[1] + offset_ns)} if call is not None else {}
        return dataclasses.replace(i, start_ns=i.start_ns + offset_ns, end_ns=i.end_ns + offset_ns, **more)

    return [moved(i) for i in items]


def executed_order(actions: Mapping[int, Sequence[Action]]) -> dict[int, list[Op]]:
    """Each rank's actions in the order they ran, in the first recorded step."""
    first = min(a.step for acts in actions.values() for a in acts)
    return {rank: [a.op for a in sorted(acts, key=lambda a: a.start_ns) if a.step == first]
            for rank, acts in sorted(actions.items())}


def write_schedule_csv(path: Path, order: Mapping[int, Sequence[Op]]) -> None:
    """torch's compute-only CSV: one row per rank; ``schedule=csv`` runs it back."""
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        for rank in sorted(order):
            writer.writerow([op.name for op in order[rank]])


def mean_costs(actions: Mapping[int, Sequence[Action]]) -> dict[tuple[int, str], float]:
    """Mean seconds of each (stage, kind) over the recorded steps."""
    samples: dict[tuple[int, str], list[float]] = defaultdict(list)
    for acts in actions.values():
        for a in acts:
            samples[(a.op.stage, a.op.kind)].append((a.end_ns - a.start_ns) / 1e9)
    return {key: statistics.fmean(v) for key, v in samples.items()}


def pipeline_spans(steps: Mapping[int, Sequence[StepSpan]]) -> dict[int, tuple[int, int]]:
    """Per recorded step, the pipeline's span: the first rank's start to the last rank's end (ns)."""
    spans: dict[int, tuple[int, int]] = {}
    for per_rank in steps.values():
        for s in per_rank:
            lo, hi = spans.get(s.step, (s.start_ns, s.end_ns))
            spans[s.step] = (min(lo, s.start_ns), max(hi, s.end_ns))
    return spans


def measured_bubble(actions: Mapping[int, Sequence[Action]], steps: Mapping[int, Sequence[StepSpan]]) -> list[float]:
    """Per rank: 1 - (time in the stage's own compute calls) / (wall time of the pipeline steps),
    over the recorded steps. A step's wall time is the pipeline's, the same for every rank: from
    the first rank's start to the last rank's end (on one clock, see ``clock_offsets``), as in the
    closed forms. A rank that returns early (1F1B's last rank, before the drain) is idle until
    the pipeline ends; waiting for a neighbour's tensor counts as idle too."""
    spans = pipeline_spans(steps)
    out = []
    for rank in sorted(steps):
        wall = sum(spans[s.step][1] - spans[s.step][0] for s in steps[rank])
        busy = sum(a.end_ns - a.start_ns for a in actions.get(rank, []))
        out.append(1.0 - busy / wall if wall else 0.0)
    return out


def steady_bubble(actions: Mapping[int, Sequence[Action]], steps: Mapping[int, Sequence[StepSpan]],
                  interrupted: AbstractSet[int] = frozenset()) -> tuple[float, list[float], int] | None:
    """Over consecutive recorded steps, whether or not they overlap (``train.optimizer_sync=deferred``
    starts a rank's next step before the others end theirs): the steady-state step, the time between
    the pipeline's ends of consecutive steps averaged (ns; what runs between steps, the reduction and
    the optimizer, is in it), each rank's bubble in it (1 - the rank's compute in the steps that
    end those gaps / their time) and how many steps began on some rank before the previous one
    ended on another. ``interrupted``: steps after which the run did something else (an evaluation,
    a checkpoint's save): the gap to the next step is not a training step's and is left out (it
    counted the evaluation as the pipeline's idle time). None with fewer than 2 consecutive steps
    and no uninterrupted gap between them. ``measured_bubble`` counts each step's own span, which
    overlapping steps would count twice."""
    spans = pipeline_spans(steps)
    numbers = sorted(spans)
    if len(numbers) < 2 or numbers != list(range(numbers[0], numbers[-1] + 1)):
        return None
    gaps = [k for k in numbers[:-1] if k not in interrupted]  # the gap from step k's end to step k + 1's
    if not gaps:
        return None
    period = sum(spans[k + 1][1] - spans[k][1] for k in gaps) / len(gaps)
    later = {k + 1 for k in gaps}
    per_rank = []
    for rank in sorted(steps):
        busy = sum(a.end_ns - a.start_ns for a in actions.get(rank, []) if a.step in later)
        per_rank.append(1.0 - busy / (period * len(later)) if period > 0 else 0.0)
    overlapped = sum(spans[k + 1][0] < spans[k][1] for k in numbers[:-1])
    return period, per_rank, overlapped


def _flows(slices: Sequence[dict]) -> list[dict]:
    """Arrows from each producing action to the action on another rank that consumes it:
    activations F(s) → F(s+1), gradients B/I(s+1) → B/I(s), per microbatch and step."""

    def key(e: dict, stage: int) -> tuple:
        a = e["args"]
        return a["step"], stage, "F" if a["kind"] == "F" else "BI", a["microbatch"]

    producers = {key(e, e["args"]["stage"]): e for e in slices if e["args"]["kind"] != "W"}
    flows: list[dict] = []
    for dst in slices:
        kind, stage = dst["args"]["kind"], dst["args"]["stage"]
        if kind == "W":
            continue
        src = producers.get(key(dst, stage - 1 if kind == "F" else stage + 1))
        if src is None or src["pid"] == dst["pid"]:
            continue
        common = {"name": "activation" if kind == "F" else "gradient", "cat": "p2p", "id": len(flows) // 2, "tid": 0}
        flows.append({**common, "ph": "s", "pid": src["pid"], "ts": src["ts"] + src["dur"] * 0.999})
        flows.append({**common, "ph": "f", "bp": "e", "pid": dst["pid"], "ts": dst["ts"]})
    return flows


def _slice(pid: int, tid: int, name: str, start_us: float, dur_us: float, args: dict) -> dict:
    return {"name": name, "ph": "X", "pid": pid, "tid": tid, "ts": start_us, "dur": dur_us, "args": args}


def measured_slices(actions: Mapping[int, Sequence[Action]], steps: Mapping[int, Sequence[StepSpan]],
                    collectives: Mapping[int, Sequence[Collective]] | None = None) -> list[dict]:
    """Slices in microseconds from the first recorded pipeline step's start (one origin for all):
    compute, the pipeline steps and (tensor parallelism) each rank's tp collectives."""
    origin = min([s.start_ns for spans in steps.values() for s in spans]
                 + [a.start_ns for acts in actions.values() for a in acts], default=0)
    out = []
    for rank, acts in actions.items():
        for a in acts:
            out.append(_slice(rank, 0, f"compute:{a.op.name}", (a.start_ns - origin) / 1e3,
                              (a.end_ns - a.start_ns) / 1e3,
                              {"step": a.step, "stage": a.op.stage, "kind": a.op.kind, "microbatch": a.op.microbatch}))
    for rank, spans in steps.items():
        for s in spans:
            out.append(_slice(rank, 1, f"step {s.step}", (s.start_ns - origin) / 1e3, (s.end_ns - s.start_ns) / 1e3,
                              {"step": s.step}))
    for rank, done in (collectives or {}).items():
        # On CUDA the actions are the device's spans, the collectives their host calls (issue to the return
        # of the wait: ``runner.outputs.collectives``): each slice, and its lane, says so.
        host = {"clock": HOST_CALLS} if any(a.call_ns is not None for a in actions.get(rank, ())) else {}
        for c in done:
            out.append(_slice(rank, 2, f"tp:{c.name}", (c.start_ns - origin) / 1e3, (c.end_ns - c.start_ns) / 1e3,
                              {"waited_us": c.wait_ns / 1e3, **host}))
    return out


def simulated_slices(actions: Sequence[SimAction]) -> list[dict]:
    return [_slice(a.rank, 0, f"compute:{a.op.name}", a.start * 1e6, (a.end - a.start) * 1e6,
                   {"step": 0, "stage": a.op.stage, "kind": a.op.kind, "microbatch": a.op.microbatch})
            for a in actions]


def write_chrome_trace(path: Path, slices: list[dict], *, ranks: Sequence[int], clock: str | None = None) -> None:
    """A chrome trace (Perfetto, chrome://tracing): a process per rank, compute on thread 0,
    pipeline steps on thread 1, tensor-parallel collectives (if any) on thread 2, flow arrows for
    the messages between ranks; ``clock`` (how the ranks' times were put on one clock) goes into
    the trace's ``otherData``."""
    lanes = {0: "compute", 1: "pipeline step", 2: "tp collectives"}
    used = {(s["pid"], s["tid"]) for s in slices}
    on_host = {s["pid"] for s in slices if s["tid"] == 2 and "clock" in s["args"]}  # CUDA: beside device spans
    meta = []
    for rank in ranks:
        meta.append({"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank}"}})
        meta.append({"name": "process_sort_index", "ph": "M", "pid": rank, "args": {"sort_index": rank}})
        meta += [{"name": "thread_name", "ph": "M", "pid": rank, "tid": tid,
                  "args": {"name": f"{name} ({HOST_CALLS})" if tid == 2 and rank in on_host else name}}
                 for tid, name in lanes.items() if tid < 2 or (rank, tid) in used]
    compute = [s for s in slices if s["tid"] == 0]
    trace: dict[str, Any] = {"traceEvents": meta + slices + _flows(compute), "displayTimeUnit": "ms"}
    if clock:
        trace["otherData"] = {"clock": clock}
    path.write_text(json.dumps(trace))


def _fit_labels(fig, ax, boxes: list[tuple[float, float, int, Op]]) -> int:
    """Label each box (start, end, rank, op) with its stage, kind and microbatch (``3F12``), or
    only the microbatch where that does not fit, or nothing; returns how many got the full label."""
    renderer = fig.canvas.get_renderer()
    to_px = ax.transData.transform
    full = 0
    for start, end, rank, op in boxes:
        width = to_px((end, rank))[0] - to_px((start, rank))[0] - 2
        for text in (op.name, str(op.microbatch)):
            label = ax.text((start + end) / 2, rank, text, ha="center", va="center", fontsize=7, color="white")
            if label.get_window_extent(renderer).width <= width:
                full += text == op.name
                break
            label.remove()
    return full


def plot_schedule(
    path: Path,
    actions: Sequence[SimAction],
    *,
    title: str,
    xlabel: str = "time (units: F=1, B=2, I=1, W=1)",
    arrows: Sequence[tuple[float, int, float, int]] = (),
) -> int:
    """Ranks as rows, actions as boxes coloured by kind and labelled with stage, kind and
    microbatch (``3F12``; the microbatch alone, or nothing, where the box is too narrow for the
    text); ``arrows`` (x0, rank0, x1, rank1) draw messages between ranks. The width grows with
    the actions per rank, up to 40 inches: past that, draw a window of them (see
    ``runner-timeline``). Returns how many boxes carry the full label."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    ranks = sorted({a.rank for a in actions})
    start, end = min(a.start for a in actions), max(a.end for a in actions)
    per_rank = max(sum(a.rank == r for a in actions) for r in ranks)
    fig, ax = plt.subplots(figsize=(max(6.0, min(40.0, 0.45 * per_rank + 2)), 0.7 * len(ranks) + 1.4))
    for a in actions:
        ax.barh(a.rank, a.end - a.start, left=a.start, height=0.8, color=COLORS[a.op.kind], edgecolor="white")
    for x0, r0, x1, r1 in arrows:
        ax.annotate("", xy=(x1, r1), xytext=(x0, r0),
                    arrowprops={"arrowstyle": "->", "color": "0.35", "lw": 0.6, "shrinkA": 0, "shrinkB": 0})
    ax.set_yticks(ranks, [f"rank {r}" for r in ranks])
    ax.invert_yaxis()
    ax.set_xlim(start, end)
    ax.set_xlabel(xlabel)
    ax.set_title(title, fontsize=10)
    kinds = sorted({a.op.kind for a in actions}, key="FBIW".index)
    ax.legend(handles=[Patch(color=COLORS[k], label=k) for k in kinds], loc="upper left",
              bbox_to_anchor=(1.0, 1.0), fontsize=8, title="<stage><kind><mb>", title_fontsize=7)
    fig.tight_layout()
    labelled = _fit_labels(fig, ax, [(a.start, a.end, a.rank, a.op) for a in actions])
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return labelled
