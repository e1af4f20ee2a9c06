"""Schedules as torch runs them: the registry's names (``runner.pipeline.registry``) → torch's classes (or the
orders we generate, run by torch's schedule runtime), their stage placement, the pre-spawn check
that asks torch itself whether it accepts the layout, the action order each runs, and construction
on each rank."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable

from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

from runner._torch import pp as _torch_pp
from runner.errors import ConfigError
from runner.pipeline import zb_orders
from runner.pipeline.csv_file import CELL_FORMS, ScheduleFileError, example_names, read_schedule_file
from runner.pipeline.ops import Op
from runner.pipeline.registry import SCHEDULES, ScheduleKind, schedule_names

__all__ = ["SCHEDULES", "is_single_stage", "default_stages_per_rank", "placement", "check_schedule",
           "read_csv_schedule", "stage_layout", "splits_backward", "build_schedule", "schedule_order", "csv_order"]

log = logging.getLogger("runner.schedule")  # named as before runner/ became packages (runner.log)

V_SHAPED = {name for name, kind in SCHEDULES.items() if kind.v_shape}  # rank 0 holds the first and the last stage


def _kind(name: str) -> ScheduleKind:
    if name not in SCHEDULES:
        raise ConfigError(
            f"schedule.name={name!r} is not a schedule. "
            f"Fix: schedule=<one of {', '.join(schedule_names())}>."
        )
    return SCHEDULES[name]


def _schedule_class(name: str):
    torch_class = _kind(name).torch_class
    assert torch_class is not None, f"{name} is a generated order, not a torch class"
    return get_schedule_class(torch_class)


def _generated(name: str) -> Callable[[int, int], dict[int, list[Op]]] | None:
    """The function generating the schedule's order (``runner.pipeline.zb_orders``); None for torch's classes."""
    order = _kind(name).order
    return None if order is None else getattr(zb_orders, order)


def is_single_stage(name: str) -> bool:
    return _kind(name).order is not None or issubclass(_schedule_class(name), PipelineScheduleSingle)


def default_stages_per_rank(name: str) -> int:
    return 1 if is_single_stage(name) else 2


def placement(name: str, pp: int, num_stages: int) -> dict[int, int]:
    """Stage index → pipeline rank: looped, or V-shaped for ZBV/DualPipeV."""
    return _torch_pp.stage_to_rank_mapping(pp, num_stages, v_shape=SCHEDULES[name].v_shape)


COMPILE_FIX = ("Fix: train.compile=false, or a schedule with whole backward steps "
               f"({', '.join(n for n, kind in SCHEDULES.items() if not kind.splits_backward)}).")


def check_schedule(name: str, *, pp: int, stages_per_rank: int, microbatches: int, compiled: bool = False) -> None:
    """Construct the torch schedule class on stand-in stages, so torch's own rules (which change
    between releases) reject a layout before any rank starts; with ``compiled``, on stand-ins
    holding a compiled module, so torch's compile check speaks too. A generated order (ZB-H1/H2)
    goes through torch's validator and dry run itself (``_check_generated``)."""
    if _kind(name).order is not None:
        _check_generated(name, pp=pp, stages_per_rank=stages_per_rank, microbatches=microbatches, compiled=compiled)
        return
    cls = _schedule_class(name)
    single = issubclass(cls, PipelineScheduleSingle)
    if single and stages_per_rank != 1:
        raise ConfigError(
            f"schedule={name} runs one stage per rank, but parallel.stages_per_rank="
            f"{stages_per_rank}. Fix: parallel.stages_per_rank=1 (or null), or pick a multi-stage "
            f"schedule ({', '.join(n for n in SCHEDULES if not is_single_stage(n))})."
        )
    if not single and stages_per_rank < 2:
        raise ConfigError(
            f"schedule={name} needs at least 2 stages per rank, but parallel.stages_per_rank="
            f"{stages_per_rank}. Fix: parallel.stages_per_rank=2 (or null)."
        )
    num_stages = pp * stages_per_rank
    def construct(compiled: bool) -> None:
        stages = _torch_pp.stand_in_stages(pp, num_stages, stages_per_rank, compiled=compiled)
        cls(stages[0] if single else stages, microbatches)

    try:
        construct(compiled=False)
    except (ValueError, AssertionError, RuntimeError) as e:
        raise ConfigError(
            f"torch's {cls.__name__} rejects schedule={name} with parallel.pp={pp}, "
            f"parallel.stages_per_rank={stages_per_rank}, parallel.microbatches={microbatches} "
            f"({num_stages} stages): {e}\nFix: change parallel.microbatches (at least the "
            "number of stages, a multiple of parallel.pp is always safe) or the stage count."
        ) from e
    if compiled:
        try:
            construct(compiled=True)
        except RuntimeError as e:
            raise ConfigError(f"train.compile=true with schedule={name}: torch says: {e}\n{COMPILE_FIX}") from e


def _check_generated(name: str, *, pp: int, stages_per_rank: int, microbatches: int, compiled: bool) -> None:
    """A generated order: one stage per rank, the microbatches its shape needs, no compiled modules
    where backward is split, and torch's validator and dry run on the order itself."""
    kind, generate = _kind(name), _generated(name)
    assert generate is not None and kind.min_microbatches is not None, name
    if stages_per_rank != 1:
        raise ConfigError(
            f"schedule={name} runs one stage per rank, but parallel.stages_per_rank={stages_per_rank}. Fix: "
            f"parallel.stages_per_rank=1 (or null), or pick a multi-stage schedule "
            f"({', '.join(n for n in SCHEDULES if not is_single_stage(n))})."
        )
    need = kind.min_microbatches(pp)
    if microbatches < need:
        others = [f"schedule={n} (needs {k.min_microbatches(pp)})" for n, k in SCHEDULES.items()
                  if k.min_microbatches is not None and k.min_microbatches(pp) <= microbatches]
        raise ConfigError(
            f"schedule={name} needs at least {need} microbatches at parallel.pp={pp} (the forwards its warm-up "
            f"runs on the first rank before the first backward), but parallel.microbatches={microbatches}. "
            f"Fix: parallel.microbatches={need} or more (train.batch_size a multiple of parallel.dp x "
            f"parallel.microbatches){''.join(f', or {o}' for o in others)}."
        )
    if compiled and kind.splits_backward:
        raise ConfigError(
            f"train.compile=true with schedule={name}: its I/W actions split backward into input and weight "
            f"parts, which torch does not support for compiled stage modules. {COMPILE_FIX}"
        )
    try:
        _torch_pp.check_actions(_torch_pp.to_actions(generate(pp, microbatches)), pp, microbatches)
    except (AssertionError, ValueError, RuntimeError, KeyError) as e:  # a bug of ours: say so before launch
        raise ConfigError(f"schedule={name} with parallel.pp={pp}, parallel.microbatches={microbatches}: torch's "
                          f"validator rejects the generated order: {e}") from e


def _check_each_once(path: str, order: dict[int, list[Op]]) -> None:
    """Each stage runs each microbatch's forward once and its backward once (``B``, or ``I`` and ``W``).
    torch's validator counts each kind's microbatches as a set, so a repeated cell (``1W1`` twice)
    passed it and failed on a rank mid-step, and ``0B0`` beside ``0I0,0W0`` passed for a microbatch
    whose backward is missing (the counts add up), running one backward twice."""
    seen: dict[Op, int] = {}
    for rank, ops in order.items():
        for op in ops:
            if op in seen:
                where = f"rank {rank}'s row" if seen[op] == rank else f"the rows of ranks {seen[op]} and {rank}"
                raise ConfigError(
                    f"schedule.csv={path!r} runs {op.name} twice ({where}): each "
                    f"stage runs a microbatch's forward once and its backward once (B, or I then W). "
                    f"Fix: remove one {op.name}.")
            seen[op] = rank
    for op, rank in seen.items():
        if op.kind == "B" and (Op(op.stage, "I", op.microbatch) in seen or Op(op.stage, "W", op.microbatch) in seen):
            raise ConfigError(
                f"schedule.csv={path!r} runs both the full backward {op.name} and a split one "
                f"({op.stage}I{op.microbatch}/{op.stage}W{op.microbatch}) on rank {rank}: the microbatch's "
                f"gradient would be added twice. Fix: keep {op.name}, or {op.stage}I{op.microbatch} then "
                f"{op.stage}W{op.microbatch}.")


def read_csv_schedule(path: str, *, pp: int, stages_per_rank: int | None, microbatches: int,
                      compiled: bool = False):
    """Lint a schedule file (any shape ``runner.pipeline.csv_file`` reads); returns (num_stages, stage →
    rank placement). What was converted to read it is logged."""
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"schedule.csv={path!r}: no such file, and no shipped example of that name. Fix: give "
                          "the path of a CSV file, or the name of a shipped example: "
                          f"{', '.join(example_names()) or '(none installed)'}.")
    try:
        schedule_file = read_schedule_file(file)
    except (ScheduleFileError, UnicodeDecodeError) as e:
        raise ConfigError(f"schedule.csv={path!r} is malformed: {e}\nFix: one row per pipeline rank; cells "
                          f"{CELL_FORMS}.") from e
    for note in schedule_file.notes:
        log.warning("schedule.csv=%r: %s", path, note)
    actions = _torch_pp.to_actions(schedule_file.order)
    computes = [op for row in schedule_file.order.values() for op in row]
    if compiled and any(op.kind in ("I", "W") for op in computes):
        raise ConfigError(
            f"train.compile=true with schedule.csv={path!r}: its I/W actions split backward into input "
            "and weight parts, which torch does not support for compiled stage modules (its zero-bubble "
            f"schedules refuse them). {COMPILE_FIX.replace('a schedule', 'B actions or a schedule')}"
        )
    if len(actions) != pp:
        raise ConfigError(
            f"schedule.csv={path!r} has {len(actions)} rows (ranks) but parallel.pp={pp}. "
            f"Fix: parallel.pp={len(actions)}."
        )
    file_mbs = 1 + max(op.microbatch for op in computes)
    if file_mbs != microbatches:
        raise ConfigError(
            f"schedule.csv={path!r} schedules {file_mbs} microbatches but parallel.microbatches="
            f"{microbatches}. Fix: parallel.microbatches={file_mbs}."
        )
    _check_each_once(path, schedule_file.order)
    num_stages = 1 + max(op.stage for op in computes)
    try:
        stage_to_rank = _torch_pp.check_actions(actions, num_stages, microbatches)
    except (AssertionError, ValueError, RuntimeError, KeyError) as e:
        raise ConfigError(f"schedule.csv={path!r} is not a valid schedule: {e}") from e
    per_rank = {r: sum(1 for owner in stage_to_rank.values() if owner == r) for r in range(pp)}
    if stages_per_rank is not None and set(per_rank.values()) != {stages_per_rank}:
        raise ConfigError(
            f"schedule.csv={path!r} places {per_rank} stages per rank but parallel.stages_per_rank="
            f"{stages_per_rank}. Fix: parallel.stages_per_rank=null (the file decides)."
        )
    return num_stages, stage_to_rank


def stage_layout(name: str, parallel, csv: str | None, *, compiled: bool) -> tuple[int, dict[int, int]]:
    """(number of stages, stage → pipeline rank) as the schedule ``name``, or the schedule file
    ``csv``, dictates for the ``parallel`` config group; checked with torch before any rank starts."""
    p = parallel
    if p.pp == 1:  # the unsplit reference: one stage, no schedule
        ignored = [f"parallel.{k}={p[k]}" for k in ("stages_per_rank", "split_points", "stage_modules")
                   if p.get(k) is not None]
        if ignored:
            log.warning("parallel.pp=1 trains the unsplit model; ignoring %s", ", ".join(ignored))
        return 1, {0: 0}
    if csv is not None:
        return read_csv_schedule(csv, pp=p.pp, stages_per_rank=p.stages_per_rank, microbatches=p.microbatches,
                                 compiled=compiled)
    spr = p.stages_per_rank or default_stages_per_rank(name)
    check_schedule(name, pp=p.pp, stages_per_rank=spr, microbatches=p.microbatches, compiled=compiled)
    return p.pp * spr, placement(name, p.pp, p.pp * spr)


def splits_backward(name: str, csv: str | None) -> bool:
    """Whether the schedule (or the schedule file ``csv``) runs separate input (I) and weight (W)
    backward actions."""
    if csv is None:
        return SCHEDULES[name].splits_backward
    return any(op.kind in ("I", "W") for ops in csv_order(csv).values() for op in ops)


def build_schedule(name: str, stages: list, microbatches: int, loss_fn: Callable, csv: str | None):
    """The torch schedule over this rank's ``PipelineStage``s. Losses are means per microbatch,
    weighted by their share of the batch's counted targets (``runner.losses.TargetWeighted``);
    the schedule sums their gradients (``scale_grads=False``) and the step divides them by the
    microbatch count once (``pipeline.PipelinedStep``): the step's loss and gradients are those of
    the mean over the batch's counted targets, the same quantity as the unsplit model's."""
    if csv is not None:  # the file's action order, whatever the name
        return _torch_pp.csv_schedule(stages, microbatches, loss_fn, csv_order(csv))
    generate = _generated(name)
    if generate is not None:  # ours, run as a schedule file's order is (one stage per rank: pp ranks)
        return _torch_pp.csv_schedule(stages, microbatches, loss_fn, generate(stages[0].group_size, microbatches))
    cls = _schedule_class(name)
    target = stages[0] if issubclass(cls, PipelineScheduleSingle) else stages
    return cls(target, microbatches, loss_fn=loss_fn, scale_grads=False)


def schedule_order(name: str, pp: int, microbatches: int, stages_per_rank: int) -> dict[int, list[Op]]:
    """The per-rank compute order a torch schedule runs, from its declared ``pipeline_order``
    (overlapped F;B actions expanded). torch 2.13 declares ``Schedule1F1B``'s last rank with
    forwards numbered 1..m instead of 0..m-1 (it runs 0..m-1): renumbered here, and the test
    suite compares every schedule's order with what a real run recorded. A generated order is
    returned as generated."""
    generate = _generated(name)
    if generate is not None:
        if stages_per_rank != 1:
            raise ValueError(f"schedule={name} runs one stage per rank, not {stages_per_rank}")
        return generate(pp, microbatches)
    stages = _torch_pp.stand_in_stages(pp, pp * stages_per_rank, stages_per_rank)
    cls = _schedule_class(name)
    schedule = cls(stages[0] if stages_per_rank == 1 else stages, microbatches)
    order = {}
    for rank in range(pp):
        ops = []
        for action in schedule.pipeline_order[rank]:
            for a in (action.sub_actions or (action,)) if action is not None else ():
                if a.is_compute_op and a.microbatch_index is not None:
                    ops.append(Op(a.stage_index, a.computation_type.value, a.microbatch_index))
        forwards = {op.microbatch for op in ops if op.kind == "F"}
        if forwards == set(range(1, microbatches + 1)):
            ops = [op._replace(microbatch=op.microbatch - 1) if op.kind == "F" else op for op in ops]
        order[rank] = ops
    return order


def csv_order(path: str) -> dict[int, list[Op]]:
    """The per-rank compute order of a schedule file (read as ``runner.pipeline.csv_file`` reads it)."""
    return read_schedule_file(Path(path)).order
