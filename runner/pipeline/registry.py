"""Every schedule the runner knows: ``schedule=<name>`` → the ``torch.distributed.pipelining`` class
that runs it (or the action order we generate for torch's schedule runtime to run: the Zero Bubble
paper's ZB-H1 and ZB-H2, ``runner.pipeline.zb_orders``), how its stages are placed on the ranks, its
closed-form bubble, and what it rejects.
Every list of schedule names reads this registry: the config's choices, the error messages, the
planner's candidates, ``runner-schedule-csv``.

Adding a schedule that torch provides: one entry here and ``conf/schedule/<name>.yaml``
(``defaults: [/schema_schedule@_here_]`` and ``name: <name>``); one we generate: the same, with its
function's name in ``runner.pipeline.zb_orders`` as ``order`` and the fewest microbatches it takes.
``schedule=csv`` is no entry: a run whose ``schedule.csv`` names a file runs that file's action
order (``runner.pipeline.csv_file``); internally that is the layout's ``csv`` being set, not a schedule
name.

Imports nothing heavy (the checks before launch read it before torch is imported); the torch class,
and the function generating an order, are looked up by name where a schedule is checked or built
(``runner.pipeline.schedule``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

__all__ = ["ScheduleKind", "SCHEDULES", "CSV", "schedule_names", "theoretical_bubble"]


@dataclass(frozen=True)
class ScheduleKind:
    name: str  # schedule=<name>
    # The class torch.distributed.pipelining's get_schedule_class knows by this name; None where
    # the runner generates the order (``order``).
    torch_class: str | None
    # Stage placement: V (stages fold back, rank 0 holds the first and the last stage) or looped.
    v_shape: bool = False
    # Backward split into input (I) and weight (W) actions: torch refuses compiled stage modules
    # for these (train.compile=true is rejected before launch).
    splits_backward: bool = False
    # The closed-form idle fraction of a step, (pp, microbatches, stages per rank) -> fraction,
    # assuming equal stages; None where the ideal depends on the F/B/W cost ratio (simulated then).
    bubble: Callable[[int, int, int], float] | None = None
    # A generated order: the name of its function in ``runner.pipeline.zb_orders``, (pp, microbatches) ->
    # rank -> its actions, one stage per rank (stage r on rank r), run by torch's schedule runtime as
    # a schedule file is; and the fewest microbatches its shape takes, pp -> microbatches.
    order: str | None = None
    min_microbatches: Callable[[int], int] | None = None
    # Stages per rank unless parallel.stages_per_rank says: 1 for torch's single-stage schedules and
    # the generated orders, 2 for the multi-stage ones (tests/test_validate.py holds it to torch's).
    stages_per_rank: int = 1


def _fill_drain(pp: int, m: int, v: int) -> float:
    """GPipe (Huang et al. 2019) and 1F1B (PipeDream-Flush, Narayanan et al. 2021): p-1 idle slots
    of m+p-1."""
    return (pp - 1) / (m + pp - 1)


def _interleaved(pp: int, m: int, v: int) -> float:
    """Interleaved 1F1B (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on
    GPU Clusters") and looped BFS (Lamy-Poirier 2023, "Breadth-First Pipeline Parallelism"): stages
    v times smaller shrink the ramp, (p-1)/(v*m+p-1)."""
    return (pp - 1) / (v * m + pp - 1)


def _zbh1_microbatches(pp: int) -> int:
    """ZB-H1's shape (Qi et al. 2024, "Zero Bubble Pipeline Parallelism"): 1F1B's warm-up, pp forwards
    on the first rank."""
    return pp


def _zbh2_microbatches(pp: int) -> int:
    """ZB-H2's shape: 2pp - 1 forwards on the first rank before its first input gradient comes back."""
    return 2 * pp - 1


SCHEDULES: dict[str, ScheduleKind] = {kind.name: kind for kind in (
    ScheduleKind("gpipe", "GPipe", bubble=_fill_drain),
    ScheduleKind("1f1b", "1F1B", bubble=_fill_drain),
    ScheduleKind("interleaved_1f1b", "Interleaved1F1B", bubble=_interleaved, stages_per_rank=2),
    ScheduleKind("looped_bfs", "LoopedBFS", bubble=_interleaved, stages_per_rank=2),
    ScheduleKind("interleaved_zb", "InterleavedZeroBubble", splits_backward=True, stages_per_rank=2),
    ScheduleKind("zbv", "ZBVZeroBubble", v_shape=True, splits_backward=True, stages_per_rank=2),
    ScheduleKind("dualpipev", "DualPipeV", v_shape=True, splits_backward=True, stages_per_rank=2),
    ScheduleKind("zbh1", None, splits_backward=True, order="zbh1_order", min_microbatches=_zbh1_microbatches),
    ScheduleKind("zbh2", None, splits_backward=True, order="zbh2_order", min_microbatches=_zbh2_microbatches),
)}

CSV = "csv"  # schedule=csv: the action order of the file schedule.csv names


def schedule_names() -> tuple[str, ...]:
    """What ``schedule.name`` accepts: every registered schedule, and ``csv``."""
    return (*SCHEDULES, CSV)


def theoretical_bubble(schedule: str, *, pp: int, microbatches: int, stages_per_rank: int) -> float | None:
    """The closed-form idle fraction of ``schedule``'s step (``ScheduleKind.bubble``); None where
    there is none (zero-bubble, ZB-H1/H2, DualPipeV, a CSV file: simulate those)."""
    kind = SCHEDULES.get(schedule)
    return kind.bubble(pp, microbatches, stages_per_rank) if kind and kind.bubble else None
