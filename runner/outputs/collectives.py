"""The tensor-parallel collectives of a rank's profiled steps, on the recorder's clock, for the
merged timeline's ``tp collectives`` lane.

DTensor issues its collectives as functional ones (``_c10d_functional::all_reduce`` and kin, then
``_c10d_functional::wait_tensor`` where the result is used); the pipeline's messages, FSDP's and
DDP's collectives and the step's loss all-reduce are plain c10d calls, so the functional ones
inside the pipeline's steps are the tensor-parallel layers' (and loss parallelism's). Only the torch
profiler sees them: they are read from the rank's chrome trace, whose clock (kineto's) is put on
the recorder's by the ``compute:`` ranges both recorded around the same actions.
"""

from __future__ import annotations

import statistics
from collections import defaultdict, deque
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from runner.pipeline.recorder import Action, StepSpan

__all__ = ["Collective", "tp_collectives"]

_FUNCTIONAL = "_c10d_functional::"
_WAIT = _FUNCTIONAL + "wait_tensor"
_NOT_COLLECTIVES = (_WAIT, _FUNCTIONAL + "_wrap_tensor_autograd")
_ON_DEVICE = "gpu_user_annotation"  # a CUDA trace's copy of a record_function range, on the device's stream


@dataclass(frozen=True)
class Collective:
    name: str  # the functional op: all_reduce, reduce_scatter_tensor, all_gather_into_tensor, ...
    start_ns: int  # issued (recorder's clock: time.perf_counter_ns)
    end_ns: int  # its wait returned: the result was ready for the compute that needed it
    wait_ns: int  # of which the rank waited for it (the communication compute did not hide)


def _kineto_offset_ns(events: Sequence[Mapping[str, Any]], actions: Sequence[Action]) -> int | None:
    """Nanoseconds to add to a trace timestamp (microseconds) to read it on the recorder's clock:
    the recorder timed each action inside the ``compute:`` range the trace holds for it, in the
    same order. None when the two do not hold the same actions (nothing can be placed then). On a
    GPU the trace holds each range twice, on the host and on the device's stream (category
    ``gpu_user_annotation``, where its kernels ran): the host's are matched with the host's readings
    around each call (``Action.host_ns``: on a GPU the recorder's span itself is the device's)."""
    ranges = sorted((e for e in events if e.get("ph") == "X" and str(e.get("name", "")).startswith("compute:")
                     and e.get("cat") != _ON_DEVICE), key=lambda e: e["ts"])
    if not actions or [e["name"] for e in ranges] != [f"compute:{a.op.name}" for a in actions]:
        return None
    return round(statistics.median(a.host_ns[0] - e["ts"] * 1e3 for e, a in zip(ranges, actions)))


def tp_collectives(trace: Mapping[str, Any], actions: Sequence[Action], steps: Sequence[StepSpan]) -> list[Collective]:
    """The functional collectives of ``trace`` (a torch profiler chrome trace) issued inside the
    recorded pipeline ``steps``, each from its issue to the end of its wait (paired in order on
    each thread: autograd may run the backward's on a thread of its own), on the clock of
    ``actions`` (the recorder's, for the same profiled steps). Empty when the trace and the
    recorder do not cover the same actions. The host's side of each call, on a GPU too (its
    issue and its wait's return: not the NCCL kernel)."""
    events = trace.get("traceEvents", [])
    offset = _kineto_offset_ns(events, actions)
    if offset is None:
        return []
    pending: dict[Any, deque[tuple[str, float]]] = defaultdict(deque)
    out: list[Collective] = []
    for e in sorted((e for e in events if e.get("ph") == "X" and str(e.get("name", "")).startswith(_FUNCTIONAL)),
                    key=lambda e: e["ts"]):
        if e["name"] == _WAIT:
            if pending[e["tid"]]:
                name, issued = pending[e["tid"]].popleft()
                end = e["ts"] + e["dur"]
                out.append(Collective(name, round(issued * 1e3) + offset, round(end * 1e3) + offset,
                                      round(e["dur"] * 1e3)))
        elif e["name"] not in _NOT_COLLECTIVES:
            pending[e["tid"]].append((e["name"].removeprefix(_FUNCTIONAL), e["ts"]))
    return [c for c in out if any(s.host_ns[0] <= c.start_ns <= s.host_ns[1] for s in steps)]

