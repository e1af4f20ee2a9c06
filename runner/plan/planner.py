"""The planner: predict each candidate layout's step time, bubble and activation memory before
running it, and recommend one (``python -m runner.plan``, in ``__main__.py``).

Candidates are schedule x microbatches x stages per rank x split (the run's own, and the one
balancing measured time where it differs), plus the run's CSV schedule if it has one. Each is
checked with every check a run makes before spawning; the valid ones are simulated
(``runner.pipeline.simulate``) with per-stage F/B/I/W costs measured here, child by child on one
microbatch in this process (``runner.plan.costs``), scaled as fitted to a few steps of real runs of
the model or to a previous run (``runner.plan.probe``), plus a message cost per send
(``runner.plan.calibrate``). With ``plan.synthesize=true`` it also searches action orders for these costs under
``plan.memory_limit`` (``runner.plan.synthesize``) and lists them as CSV schedules. Candidates
predicted within ``plan.tie_tolerance`` of the fastest tie; the recommended one is the tied
candidate with the least activation memory.
"""

from __future__ import annotations

import copy
import logging
import math
import os
import subprocess
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Mapping, NamedTuple, Sequence

from omegaconf import DictConfig

from runner.compose import check_schema
from runner.errors import ConfigError
from runner.layout import Layout, ResolvedRun
from runner.models.hf import resolve_verify
from runner.models.split import split_by_cost
from runner.options import OptimizerSync
from runner.outputs.timeline import write_schedule_csv
from runner.parallel.dims import ParallelDims
from runner.pipeline.config import CsvScheduleConfig
from runner.pipeline.csv_file import resolve_schedule_file
from runner.pipeline.ops import Op
from runner.pipeline.schedule import (
    SCHEDULES,
    V_SHAPED,
    csv_order,
    is_single_stage,
    read_csv_schedule,
    schedule_order,
)
from runner.pipeline.simulate import deferred_step, expected_ends, expected_makespan, peak_in_flight, simulate
from runner.plan import tp_cost
from runner.plan.calibrate import Calibration, calibrate
from runner.plan.costs import ChildCost, measure_child_costs
from runner.plan.given import check_fraction, is_costs_file, memory_limit
from runner.plan.link import configured_link, tied_meetings
from runner.plan.memory import annotate_memory, rank_params
from runner.plan.probe import (
    Fit,
    Launch,
    fitted_model,
    layout_costs,
    rank_updates,
    read_run,
    rest_s,
    sent_bytes,
)
from runner.plan.rehearsed import Rehearse, cost_from_rehearsal, link_overrides, needs_rehearsal, rehearsal_key
from runner.plan.synthesize import Problem, lower_bound, synthesize
from runner.plan.weight_memory import measure_weight_grad_fraction
from runner.ranks.dist import pick_device, resolve_device
from runner.ranks.host import usable_cpus
from runner.validate import validate

__all__ = ["Candidate", "PlanResult", "DEFERRED", "check_barrier_free", "check_plan_keys", "check_schedules",
           "amortized_step", "committed_steps", "plan", "tried_schedules"]

log = logging.getLogger(__name__)

# plan.barrier=false scores train.optimizer_sync=deferred's overlapping steps: every candidate's
# command carries it, so that running it gets the overlap scored.
DEFERRED = "train.optimizer_sync=deferred"


class Prediction(NamedTuple):
    step_s: float  # the predicted step
    pipeline_s: float  # of it, the simulated pipeline
    lower_bound_s: float  # no order of the layout's actions runs its pipeline faster


@dataclass
class Candidate:
    schedule: str
    microbatches: int
    stages_per_rank: int | None  # a CSV's own, once its file is read
    overrides: list[str]
    valid: bool
    reason: str = ""
    split_points: list[str] | None = None  # the children starting stages 1..; null: the run's own split
    stage_sizes: list[int] = field(default_factory=list)  # top-level children per stage
    predicted_step_time_s: float | None = None
    bubble: float | None = None
    peak_activations: list[int] = field(default_factory=list)  # microbatches in flight, per rank
    peak_activation_bytes: list[int] = field(default_factory=list)  # per action: an I keeps plan.weight_grad_fraction
    peak_activation_mb: list[float] = field(default_factory=list)  # the same in microbatches' activations (M_B)
    fits_memory: bool = True
    # the simulated pipeline with mean action times (no jitter); plan.barrier=false: its steady step, steps overlapping
    pipeline_s: float | None = None
    # of the predicted step: the tied weights' sums, the loss/norm all-reduce and the optimizer (plan.barrier=false:
    # what the updates between a rank's steps, the tied sums, the deferred all-reduce and the jitter add to the
    # steady pipeline)
    after_pipeline_s: float | None = None
    stage_costs_s: dict[str, float] = field(default_factory=dict)  # "<stage><F|B|I|W>": seconds, as simulated
    lower_bound_s: float | None = None  # no order of this layout's actions runs its pipeline faster
    tie: bool = False  # predicted within plan.tie_tolerance of the fastest that fits
    recommended: bool = False  # the one the best line names
    search: dict | None = None  # a synthesized order: how the search went
    rank_params: list[int] = field(default_factory=list)  # parameters per pipeline rank
    rank_memory_bytes: list[int] = field(default_factory=list)  # whole rank, per pipeline rank (runner.plan.memory)
    within_error: bool = False  # predicted within the planner's measured error of the fastest (runner.plan.report)
    degrees: dict[str, int] | None = None  # pp, dp, tp where not the run's own (plan.search_degrees)
    costed_by: str = "model"  # or "rehearsal" (plan.rehearse: runner.plan.rehearsed)
    rehearsal: dict | None = None  # plan.rehearse: the rehearsal's directory and step, or why it failed
    # plan.barrier=false: a step validated at its own end (evaluated, saved, compared by verify, the
    # run's last), which the next cannot overlap: the pipeline, the tied sums, the slowest update, the all-reduce
    commit_step_s: float | None = None
    # plan.barrier=false: the step averaged over the run's steps, its committed ones at commit_step_s
    amortized_step_s: float | None = None

    def score_barrier(self, order: Mapping[int, Sequence[Op]], costs: Mapping[tuple[int, str], float], *,
                      num_stages: int, pp: int, comm_s: float, calibration: Calibration, busy_s: float,
                      pipeline_s: float, rest_s: float, meetings: Sequence[tuple[tuple[int, ...], float]]) -> None:
        """``plan.barrier=true``: the step is the pipeline's mean end with action times varying as
        calibrated, the tied weights' gradient sums where the ranks holding a copy meet after it
        (``meetings``: ``tied_meetings``), then ``rest_s`` (the all-reduce and the update);
        ``pipeline_s`` is the pipeline with mean times. The model's costs and the rehearsed ones alike."""
        makespan, met = expected_ends(order, costs, num_stages=num_stages, comm_s=comm_s,
                                      jitter=calibration.action_jitter, meetings=meetings)
        self.predicted_step_time_s = met + rest_s
        self.after_pipeline_s = self.predicted_step_time_s - makespan
        self.bubble = 1 - busy_s / (pp * makespan)
        self.pipeline_s = pipeline_s

    def score_deferred(self, order: Mapping[int, Sequence[Op]], costs: Mapping[tuple[int, str], float], *,
                       num_stages: int, pp: int, comm_s: float, updates: Mapping[int, float],
                       calibration: Calibration, busy_s: float,
                       meetings: Sequence[tuple[tuple[int, ...], float]]) -> None:
        """``plan.barrier=false``: the step is ``train.optimizer_sync=deferred``'s steady step
        (``deferred_step``: steps back to back, each rank's update between its own steps, the tied
        weights' gradient sums where the ranks holding a copy meet (``meetings``: ``tied_meetings``),
        the loss/norm all-reduce one message waited for a step later), its mean with action times
        varying as calibrated; the pipeline is that steady step without updates, sums or all-reduce and
        mean times (what ``vs bound`` holds against the busiest rank's compute), the rest is what
        they add. The model's costs and the rehearsed ones (``runner.plan.rehearsed``) alike."""
        self.predicted_step_time_s = deferred_step(order, costs, num_stages=num_stages, comm_s=comm_s,
                                                   update_s=updates, reduce_s=calibration.latency_s,
                                                   meetings=meetings, jitter=calibration.action_jitter)
        self.pipeline_s = deferred_step(order, costs, num_stages=num_stages, comm_s=comm_s)
        self.after_pipeline_s = self.predicted_step_time_s - self.pipeline_s
        self.bubble = 1 - busy_s / (pp * self.pipeline_s)
        self.commit_step_s = (expected_makespan(order, costs, num_stages=num_stages, comm_s=comm_s,
                                                jitter=calibration.action_jitter, meetings=meetings)
                              + max(updates.values(), default=0.0) + calibration.latency_s)

    def amortize(self, committed: int, steps: int) -> None:
        """``amortized_step_s``: ``committed`` of ``steps`` steps at ``commit_step_s`` (``committed_steps``)."""
        if self.commit_step_s is not None and self.predicted_step_time_s is not None and steps:
            self.amortized_step_s = amortized_step(self.predicted_step_time_s, self.commit_step_s, committed, steps)

    def prediction(self) -> Prediction:
        """The times of a valid candidate (``_predict`` sets them together with ``valid``)."""
        step, pipeline, bound = self.predicted_step_time_s, self.pipeline_s, self.lower_bound_s
        assert self.valid and step is not None and pipeline is not None and bound is not None, self
        return Prediction(step, pipeline, bound)


class PlanResult(NamedTuple):
    candidates: list[Candidate]  # fastest within the memory limit first
    timelines: dict[int, list]  # the predicted timeline of each valid candidate, by id(candidate)
    calibration: Calibration | None  # None when no candidate got as far as a layout
    fit: Fit | None  # the cost model fitted to the probes (or plan.costs), or the unfitted one


def _candidates(cfg: DictConfig) -> list[tuple[str, int, int | None]]:
    """(schedule, microbatches, stages per rank): every torch schedule (or those of
    ``plan.schedules``) at every ``plan.microbatches`` that divides the batch, and the run's own CSV
    schedule if it has one (its file decides the microbatches and the stages per rank)."""
    replica_batch = cfg.train.batch_size // cfg.parallel.dp
    out: list[tuple[str, int, int | None]] = []
    for name in tried_schedules(cfg):
        for m in cfg.plan.microbatches:
            if replica_batch % m == 0:
                for spr in [1] if is_single_stage(name) else [2, 3, 4]:
                    out.append((name, m, spr))
    if cfg.schedule.name == "csv":
        try:
            order = csv_order(resolve_schedule_file(cfg.schedule.csv))
            m = 1 + max(op.microbatch for ops in order.values() for op in ops)
        except (OSError, RuntimeError, ValueError):
            m = cfg.parallel.microbatches  # an unreadable file: validate() says what is wrong with it
        out.append(("csv", m, None))
    return out


def tried_schedules(cfg: DictConfig) -> list[str]:
    """The built-in schedules the plan tries: ``plan.schedules`` (checked by ``check_schedules``),
    or every one, in the order of ``SCHEDULES``."""
    chosen = cfg.plan.get("schedules")
    return [name for name in SCHEDULES if chosen is None or name in chosen]


def check_schedules(cfg: DictConfig) -> None:
    """``plan.schedules``: null, or a non-empty list, for a plan of this host (a target's plan and a
    costs file's try every schedule). Its names are the schema's choices, refused before this
    (``runner.compose.check_schema``, the first check of ``runner.validate.check_config``)."""
    chosen = cfg.plan.get("schedules")
    if chosen is None:
        return
    elsewhere = ("plan.target", cfg.plan.target) if cfg.plan.target else \
        ("plan.costs", cfg.plan.costs) if cfg.plan.costs and is_costs_file(cfg.plan.costs) else None
    if elsewhere:
        raise ConfigError(f"plan.schedules={list(chosen)} with {elsewhere[0]}={elsewhere[1]}: plan.schedules limits "
                          f"a plan of this host only; {elsewhere[0]} tries every schedule. Fix: "
                          f"plan.schedules=null, or drop {elsewhere[0]}.")
    if not chosen:
        raise ConfigError(f"plan.schedules={list(chosen)}: no schedule to try. Fix: plan.schedules=[<some of "
                          f"{', '.join(SCHEDULES)}>], or plan.schedules=null for every one.")


def _overrides(name: str, m: int, spr: int | None, csv: str | None, split_points: Sequence[str] | None) -> list[str]:
    out = (["schedule=csv", f"schedule.csv={csv}", f"parallel.microbatches={m}", "parallel.stages_per_rank=null"]
           if name == "csv" else [f"schedule={name}", f"parallel.microbatches={m}", f"parallel.stages_per_rank={spr}"])
    return out + ([f"parallel.split_points=[{','.join(split_points)}]"] if split_points else [])


def _neighbour_cpus(resolved: ResolvedRun) -> list[tuple[int, ...]] | None:
    """The cores two neighbouring ranks of the run's first pipeline are pinned to (its first two
    ranks where pp is 1), or None where the run pins no ranks."""
    if resolved.rank_cpus is None:
        return None
    pair = resolved.dims.ranks_of("pp", 0)[:2] if resolved.pp > 1 else [0, 1]
    return [resolved.rank_cpus[r] for r in pair]


def _calibration(plan_cfg: DictConfig, message_bytes: int, device: str,
                 cpus: Sequence[Sequence[int]] | None) -> Calibration:
    """The configured message and action costs; whatever is null is measured on two ranks (on
    ``cpus``: the cores of the run's first two pipeline ranks)."""
    fields = ("latency_s", "bandwidth", "action_overhead_s", "corunning_slowdown", "busy_delay_s", "action_jitter")
    given = (plan_cfg.comm_latency_s, plan_cfg.comm_bandwidth, plan_cfg.action_overhead_s,
             plan_cfg.corunning_slowdown, plan_cfg.comm_busy_delay_s, plan_cfg.action_jitter)
    measured = calibrate(message_bytes, device=device, cpus=cpus) \
        if None in given else None
    given_or_measured = Calibration(*(v if v is not None else getattr(measured, f) for v, f in zip(given, fields)))
    if measured is None:
        return given_or_measured
    return replace(given_or_measured, allreduce_latency_s=measured.allreduce_latency_s,
                   allreduce_bandwidth=measured.allreduce_bandwidth)  # tp's collectives (runner.plan.tp_cost)


def _saved_bytes(layout: Layout, child: Mapping[str, ChildCost]) -> dict[int, float]:
    return {s: sum(child[n].saved_bytes for n in names) for s, names in enumerate(layout.stages)}


def _predict(candidate: Candidate, layout: Layout, order: dict[int, list[Op]], child: Mapping[str, ChildCost],
             calibration: Calibration, model: Fit, plan_cfg: DictConfig) -> list | None:
    """Fill in the candidate's prediction; returns its timeline of mean action times (None when
    its order cannot run)."""
    costs, comm_s = layout_costs(layout.stages, child, calibration, model)
    candidate.stage_sizes = [len(names) for names in layout.stages]
    try:
        timeline = simulate(order, costs, num_stages=layout.num_stages, comm_s=comm_s)
    except ValueError as e:
        candidate.reason = f"the order cannot run: {e}"
        return None
    busy = {r: 0.0 for r in range(layout.pp)}
    for a in timeline:
        busy[a.rank] += a.end - a.start
    candidate.valid = True
    rank_stages = {r: layout.stages_on(r) for r in range(layout.pp)}
    candidate.stage_costs_s = {f"{s}{k}": v for (s, k), v in sorted(costs.items())}
    meetings = tied_meetings(layout.tied, calibration.all_reduce_link())
    if plan_cfg.barrier:
        candidate.score_barrier(order, costs, num_stages=layout.num_stages, pp=layout.pp, comm_s=comm_s,
                                calibration=calibration, busy_s=sum(busy.values()),
                                pipeline_s=max(a.end for a in timeline), meetings=meetings,
                                rest_s=model.rest_scale * rest_s(rank_stages, layout.stages, child, calibration))
    else:
        candidate.score_deferred(order, costs, num_stages=layout.num_stages, pp=layout.pp, comm_s=comm_s,
                                 updates=model.scaled_updates(rank_updates(rank_stages, layout.stages, child,
                                                                           calibration)),
                                 calibration=calibration, busy_s=sum(busy.values()), meetings=meetings)
    problem = Problem(layout.microbatches, layout.stage_to_rank, costs, comm_s, _saved_bytes(layout, child),
                      barrier=plan_cfg.barrier)
    candidate.lower_bound_s = lower_bound(problem)
    fraction = plan_cfg.weight_grad_fraction
    counts, nbytes = peak_in_flight(order), peak_in_flight(order, problem.stage_bytes, fraction)
    candidate.peak_activations = [int(counts[r]) for r in sorted(counts)]  # counts: whole numbers
    candidate.peak_activation_bytes = [round(nbytes[r]) for r in sorted(nbytes)]
    candidate.rank_params = rank_params(layout.stages, {n: c.params for n, c in child.items()}, layout.stage_to_rank,
                                        layout.pp)
    in_mb = peak_in_flight(order, None, fraction)
    candidate.peak_activation_mb = [round(in_mb[r], 3) for r in sorted(in_mb)]
    limit = memory_limit("plan.memory_limit", plan_cfg.memory_limit, problem)
    candidate.fits_memory = limit is None or max(nbytes.values()) <= limit * (1 + 1e-9)
    return timeline


@dataclass
class _Planning:
    """What planning the candidates one after another builds up: the children's timings by
    microbatch size, the calibration and the cost model (from the first candidate with a layout),
    the candidates and their predicted timelines, and the built-in orders a search starts from."""

    cfg: DictConfig  # plan.weight_grad_fraction resolved
    kind: str  # where the run would compute: cuda or cpu
    device: Any  # the device the children are timed on
    out: Path | None
    launch: Launch | None
    child_costs: dict[int, dict[str, ChildCost]] = field(default_factory=dict)
    calibration: Calibration | None = None
    model: Fit | None = None
    results: list[Candidate] = field(default_factory=list)
    timelines: dict[int, list] = field(default_factory=dict)  # by id(candidate)
    # (m, V-shaped, stages per rank) -> the built-in orders there and the layouts (by split) to search
    families: dict[tuple[int, bool, int], dict] = field(default_factory=dict)
    rehearse: Rehearse | None = None  # plan.rehearse: runs a candidate's rehearsal
    rehearsals: dict[tuple, dict | str] = field(default_factory=dict)  # by rehearsal_key: the report, or an error


def plan(cfg: DictConfig, out: Path | None = None, launch: Launch | None = None,
         rehearse: Rehearse | None = None) -> PlanResult:
    """Every candidate, fastest within the memory limit first (ties and the recommended one
    marked), the predicted timeline of each valid one (keyed by ``id(candidate)``), the message
    and action costs used and the cost model fitted to the probes (None when no candidate got
    as far as a layout). ``launch`` (``runner.launch.launch``) runs the probes; without it the
    plan has none. Probe runs and synthesized CSVs go into ``out`` (required for either). With
    ``plan.synthesize``, searched orders join the built-ins: one per microbatch count, placement
    (1 and 2 stages per rank, looped or V) and split, written as CSV files into ``out``. With
    ``plan.rehearse``, ``rehearse`` (``runner.plan.rehearsed.rehearse_by_cli``) rehearses each layout
    involving tp or FSDP into ``out``, and its candidates are costed from that.

    A step is predicted as the simulated pipeline (compute as fitted + the runtime's per-action
    overhead, + a message per cross-rank dependency; its mean length with action times varying as
    calibrated), then the loss/norm all-reduce (one message) and the slowest rank's optimizer
    update: what ``summary.json``'s ``step_time_s`` measures. With ``plan.barrier=false``,
    ``train.optimizer_sync=deferred``'s steady step instead (``Candidate.score_deferred``): what
    ``summary.json``'s ``bubble.steady.step_s`` measures; every command then carries ``DEFERRED``."""
    check_plan_keys(cfg)
    if out is None and (launch is not None or cfg.plan.synthesize or cfg.plan.rehearse):
        raise ValueError("plan(): probe runs, rehearsals and synthesized schedules are written into a directory: "
                         "pass out=")
    if cfg.plan.rehearse and rehearse is None:
        raise ValueError("plan(): plan.rehearse=true needs rehearse= (runner.plan.rehearsed.rehearse_by_cli)")
    kind, device = _timing_device(cfg)
    state = _Planning(_with_weight_grad_fraction(cfg, device), kind, device, out, launch,
                      rehearse=rehearse if cfg.plan.rehearse else None)
    for base, (name, m, spr) in tp_cost.by_degrees(state.cfg, _candidates):  # the run's degrees first
        _plan_candidate(state, base, name, m, spr)
    if state.cfg.plan.synthesize and state.calibration is not None and state.model is not None and out is not None:
        _plan_synthesized(state)
    if not cfg.plan.barrier:  # what was scored: runs of these commands overlap their steps
        committed, steps = committed_steps(cfg)
        for c in state.results:
            c.overrides.append(DEFERRED)
            c.amortize(committed, steps)
    ranked = sorted(state.results, key=lambda c: (not c.valid, not c.fits_memory, c.predicted_step_time_s or 0.0))
    _mark_ties(ranked, state.cfg.plan.tie_tolerance)
    annotate_memory(ranked, state.cfg)
    return PlanResult(ranked, state.timelines, state.calibration, state.model)


def _timing_device(cfg: DictConfig) -> tuple[str, Any]:
    """Where the run would compute (a GPU per rank, or the CPU), and the device the children are
    timed on there; warns where this host's cores would make the timings read low."""
    ranks = ParallelDims.from_config(cfg.parallel).world_size
    kind = resolve_device(cfg.device, ranks)
    device = pick_device(kind, 0)
    if kind == "cpu":
        _warn_shared_cores(ranks)
    return kind, device


def _warn_shared_cores(ranks: int) -> None:
    cores = len(usable_cpus())  # this process's share of the host (taskset, a container's cpuset)
    if ranks > cores:
        log.warning("%d ranks on %d CPU cores take turns on the cores, which the planner does not simulate: its "
                    "step times assume a core per rank and will read low. Plan on a host with a core per rank.",
                    ranks, cores)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    if load > cores / 2:
        # Measured under a load average of 4 on 2 cores: a 4-byte message took 4 ms (a scheduler
        # time slice, not the transport's 60 us) and a 4 MiB one no longer, the runtime overhead
        # came out anywhere in 0-1.8 ms and the co-running slowdown 1.8-2.6.
        log.warning("the 1-minute load average is %.1f on %d CPU cores: other processes share this host, and the "
                    "calibration and the child timings measure them too. Plan on a quiet host, or set plan.comm_*, "
                    "plan.action_overhead_s and plan.corunning_slowdown from a quiet calibration.json.", load, cores)


def _with_weight_grad_fraction(cfg: DictConfig, device) -> DictConfig:
    """``cfg`` with ``plan.weight_grad_fraction`` measured on the model where it is null (a copy)."""
    if cfg.plan.weight_grad_fraction is not None:
        return cfg
    cfg = copy.deepcopy(cfg)
    size = cfg.train.batch_size // (cfg.parallel.dp * min(cfg.plan.microbatches))
    cfg.plan.weight_grad_fraction = measure_weight_grad_fraction(cfg, max(1, size), device)
    log.info("M_W / M_B (plan.weight_grad_fraction), measured: %.3f", cfg.plan.weight_grad_fraction)
    return cfg


def _plan_candidate(state: _Planning, base: DictConfig, name: str, m: int, spr: int | None) -> None:
    """One candidate of ``base``'s degrees (and the split balancing measured time, where it
    differs): checked as a run checks it, then predicted."""
    moved = tp_cost.degree_overrides(base, state.cfg)  # the pp x dp x tp of the same ranks, where not the run's
    own = Candidate(name, m, spr, moved + _overrides(name, m, spr, state.cfg.schedule.get("csv"),
                                                     base.parallel.split_points),
                    valid=False, split_points=base.parallel.split_points,
                    degrees=tp_cost.degrees_of(base) if moved else None)
    state.results.append(own)
    trial = copy.deepcopy(base)
    trial.schedule.name, trial.parallel.microbatches, trial.parallel.stages_per_rank = name, m, spr
    try:
        resolved = validate(trial)  # a CSV that would deadlock fails here, in torch's dry run
    except ConfigError as e:
        own.reason = str(e).splitlines()[0]
        return
    layout = resolved.layout
    order = _order(own, layout, spr)
    child = _costs(state, base, resolved, m)
    # Built-in schedules at the run's degrees seed the search (plan.synthesize), by family.
    family = (m, name in V_SHAPED, spr) if spr is not None and spr <= 2 and not moved else None
    rehearsed = state.rehearse is not None and needs_rehearsal(base)
    for candidate, split_layout in [(own, layout), *_split_by_time(state, own, layout, child, trial, moved)]:
        _predict_and_keep(state, candidate, split_layout, order, child, family, rehearsed)


def _order(own: Candidate, layout: Layout, spr: int | None) -> dict[int, list[Op]]:
    """The candidate's actions in order: its schedule's, or (``spr`` None) the run's CSV schedule's,
    whose file also decides the candidate's stages per rank."""
    if spr is not None:
        return schedule_order(own.schedule, layout.pp, own.microbatches, spr)
    assert layout.csv is not None  # validate() read the file
    order = csv_order(layout.csv)
    own.stages_per_rank = layout.num_stages // layout.pp
    return order


def _costs(state: _Planning, base: DictConfig, resolved: ResolvedRun, m: int) -> dict[str, ChildCost]:
    """The children's costs at ``m`` microbatches under ``base``'s tp degree. The first candidate
    to get this far also sets the calibration and the cost model: both need a layout's messages."""
    child = _child_costs(base, state.child_costs, m, state.device)
    if state.calibration is None or state.model is None:
        state.calibration, state.model = _calibrate(state, resolved, child)
    return tp_cost.tp_child_costs(child, base, state.calibration, base.train.batch_size // (base.parallel.dp * m))


def _calibrate(state: _Planning, resolved: ResolvedRun, child: Mapping[str, ChildCost]) -> tuple[Calibration, Fit]:
    """The message and action costs (measured on the cores ``resolved`` pins its first ranks to)
    and the cost model fitted to the probes (``state.launch`` runs them)."""
    cfg = state.cfg
    calibration = _calibration(cfg.plan, sent_bytes(resolved.layout.stages, child), state.kind,
                               _neighbour_cpus(resolved))
    child_at = tp_cost.tp_child_at(lambda n: _child_costs(cfg, state.child_costs, n, state.device), cfg, calibration)
    return calibration, fitted_model(cfg, calibration, child_at, state.out, state.launch)


def _split_by_time(state: _Planning, own: Candidate, layout: Layout, child: Mapping[str, ChildCost],
                   trial: DictConfig, moved: list[str]) -> list[tuple[Candidate, Layout]]:
    """The split balancing measured time as a candidate of its own, where it differs from the
    run's, which balances parameter counts (an embedding is heavy in parameters and light in time)."""
    points = split_by_cost(list(child), [c.forward_s + c.backward_s for c in child.values()], layout.num_stages)
    if points == [names[0] for names in layout.stages[1:]]:
        return []
    by_time = Candidate(own.schedule, own.microbatches, own.stages_per_rank,
                        moved + _overrides(own.schedule, own.microbatches, own.stages_per_rank,
                                           state.cfg.schedule.get("csv"), points),
                        valid=False, split_points=points, degrees=own.degrees)
    state.results.append(by_time)
    trial.parallel.split_points = points
    try:
        return [(by_time, validate(trial).layout)]
    except ConfigError as e:  # e.g. tied weights that this split would put on two stages
        by_time.reason = str(e).splitlines()[0]
        return []


def _predict_and_keep(state: _Planning, candidate: Candidate, layout: Layout, order: dict[int, list[Op]],
                      child: Mapping[str, ChildCost], family: tuple[int, bool, int] | None,
                      rehearsed: bool = False) -> None:
    """Predict ``candidate`` (``rehearsed``: then from its layout's rehearsal), keep its timeline
    and, in a ``family`` (microbatches, V-shaped, stages per rank), its order and layout for the search."""
    assert state.calibration is not None and state.model is not None  # set by _costs
    timeline = _predict(candidate, layout, order, child, state.calibration, state.model, state.cfg.plan)
    if timeline is None:
        return
    if rehearsed:
        timeline = _from_rehearsal(state, candidate, layout, order, child)
        if timeline is None:  # not ranked beside rehearsed ones on the model's step: refused, with the reason
            candidate.valid, candidate.reason = False, candidate.rehearsal["error"] if candidate.rehearsal else ""
            return
    state.timelines[id(candidate)] = timeline
    if family is not None:
        found = state.families.setdefault(family, {"seeds": {}, "layouts": {}})
        found["seeds"][candidate.schedule] = order
        found["layouts"].setdefault(tuple(candidate.split_points or ()), layout)


def _from_rehearsal(state: _Planning, candidate: Candidate, layout: Layout, order: dict[int, list[Op]],
                    child: Mapping[str, ChildCost]) -> list | None:
    """``candidate`` costed from the rehearsal of its layout (run once per ``rehearsal_key``, into
    ``rehearsals/<n>`` of the plan's directory); None, the error recorded, where the rehearsal failed
    (the candidate is then listed invalid: a model-costed step beside rehearsed ones would outrank them)."""
    assert state.rehearse is not None and state.calibration is not None and state.model is not None
    assert state.out is not None  # plan() requires it with plan.rehearse
    key = rehearsal_key(candidate.overrides, order)
    run_dir = state.out / "rehearsals" / str(len(state.rehearsals))
    if key not in state.rehearsals:
        try:
            deferred = [] if state.cfg.plan.barrier else [DEFERRED]  # rehearsed as its command runs
            state.rehearsals[key] = {"dir": str(run_dir), "report": state.rehearse(
                [*candidate.overrides, *deferred, *link_overrides(state.calibration)], run_dir)}
        except (RuntimeError, OSError, ValueError, subprocess.TimeoutExpired) as e:
            state.rehearsals[key] = f"the rehearsal failed: {e}"
    done = state.rehearsals[key]
    if isinstance(done, str):
        log.warning("%s: %s", candidate.overrides, done)
        candidate.rehearsal = {"error": done}
        return None
    _, comm_s = layout_costs(layout.stages, child, state.calibration, state.model)
    try:
        return cost_from_rehearsal(candidate, layout, order, done["report"], state.calibration, comm_s,
                                   _saved_bytes(layout, child), Path(done["dir"]), barrier=state.cfg.plan.barrier)
    except (KeyError, ValueError) as e:
        candidate.rehearsal = {"error": f"the rehearsal cannot cost it: {e}", "dir": done["dir"]}
        return None


def _plan_synthesized(state: _Planning) -> None:
    """``plan.synthesize``: a searched order per family of built-in orders and split, as a candidate."""
    cfg, out = state.cfg, state.out
    assert state.calibration is not None and state.model is not None and out is not None
    for (m, v_shape, _), family in state.families.items():
        for split, layout in family["layouts"].items():
            child = state.child_costs[cfg.train.batch_size // (cfg.parallel.dp * m)]
            candidate, timeline = _synthesized(cfg, layout, v_shape, list(split) or None, family["seeds"], child,
                                               state.calibration, state.model, out)
            state.results.append(candidate)
            if timeline is not None:
                state.timelines[id(candidate)] = timeline


# The calibration's other given values: (key, the least it may be, what it is). A slowdown under 1
# would have two ranks computing together faster than one alone; a negative time, steps shortened.
_GIVEN_COSTS = (("action_overhead_s", 0.0, "seconds added to every action"),
                ("corunning_slowdown", 1.0, "a factor on compute time with the other rank computing"),
                ("comm_busy_delay_s", 0.0, "seconds added to a message whose sender is busy"),
                ("action_jitter", 0.0, "a coefficient of variation of action times"))


def _check_given_costs(plan_cfg: DictConfig) -> None:
    for key, least, what in _GIVEN_COSTS:
        value = plan_cfg.get(key)
        if value is not None and not (math.isfinite(float(value)) and float(value) >= least):
            raise ConfigError(f"plan.{key}={value}: it is {what}, at least {least:g}. Fix: plan.{key}={least:g} "
                              "or more, or null to measure it.")


def check_plan_keys(cfg: DictConfig) -> None:
    """The planner's own keys, once and before anything is timed (every candidate would
    otherwise fail alike, or the calibration run first); first the schema's checks (a name in
    ``plan.schedules`` that is no schedule), which the command line and the API ran already."""
    check_schema(cfg)
    memory_limit("plan.memory_limit", cfg.plan.memory_limit)
    check_schedules(cfg)
    configured_link(cfg.plan.comm_latency_s, cfg.plan.comm_bandwidth)  # a given link's values
    _check_given_costs(cfg.plan)
    elsewhere = ("plan.target", cfg.plan.target) if cfg.plan.target else \
        ("plan.costs", cfg.plan.costs) if cfg.plan.costs and is_costs_file(cfg.plan.costs) else None
    if cfg.plan.get("rehearse") and elsewhere:
        raise ConfigError(f"plan.rehearse=true with {elsewhere[0]}={elsewhere[1]}: a rehearsal measures each layout "
                          f"on this host, {elsewhere[0]} plans from costs given instead. Fix: plan.rehearse=false, "
                          f"or drop {elsewhere[0]}.")
    if cfg.plan.weight_grad_fraction is not None:
        check_fraction("plan.weight_grad_fraction", cfg.plan.weight_grad_fraction)
    if not cfg.plan.microbatches or min(cfg.plan.microbatches) < 1:
        raise ConfigError(f"plan.microbatches={list(cfg.plan.microbatches)}: the planner needs microbatch counts "
                          "of at least 1 to try. Fix: e.g. plan.microbatches=[2,4,8].")
    replica_batch = cfg.train.batch_size // max(1, cfg.parallel.dp)
    if cfg.schedule.name != "csv" and not any(replica_batch % m == 0 for m in cfg.plan.microbatches):
        raise ConfigError(f"plan.microbatches={list(cfg.plan.microbatches)}: none divides a replica's batch "
                          f"(train.batch_size={cfg.train.batch_size} / parallel.dp={cfg.parallel.dp}), so there is "
                          "no candidate to plan. Fix: a train.batch_size that one of them divides, or "
                          "plan.microbatches=[<divisors of it>].")
    if cfg.plan.costs and not is_costs_file(cfg.plan.costs):
        read_run(cfg.plan.costs)


def committed_steps(cfg: DictConfig) -> tuple[int, int]:
    """Of the run's ``train.steps``, how many ``train.optimizer_sync=deferred`` validates at their
    own end (``runner.train.Trainer._commits``): the last, those evaluated (``eval.every``), saved
    (``checkpoint.every``) or compared by ``verify`` (the first ``verify_steps`` + 1); and the steps."""
    steps, evaluated, saved = cfg.train.steps, cfg.eval.every, cfg.checkpoint.every

    def every(n: int) -> int:  # of steps 1..n, those evaluated or saved
        both = math.lcm(evaluated, saved) if evaluated and saved else 0
        return sum(n // k for k in (evaluated, saved) if k) - (n // both if both else 0)

    head = min(cfg.verify_steps + 1 if resolve_verify(cfg) else 0, steps)  # verify's, from step 1
    return head + max(0, every(steps - 1) - every(head)) + (steps > head), steps


def amortized_step(steady_s: float, commit_s: float, committed: int, steps: int) -> float:
    """The step averaged over ``steps``, ``committed`` of them (``committed_steps``) at ``commit_s``
    and the others at ``steady_s``."""
    return steady_s + committed / steps * (commit_s - steady_s)


def check_barrier_free(cfg: DictConfig, overrides: Sequence[str]) -> None:
    """``plan.barrier=false`` scores steps that overlap, which runs get with
    ``train.optimizer_sync=deferred`` (the candidates' commands carry it): refused, before anything
    is timed, with another ``train.optimizer_sync`` given and where ``deferred`` cannot run (``verify`` with
    ``checkpoint.resume``: ``runner.validate``)."""
    if cfg.plan.barrier:
        return
    given = [o.split("=", 1)[1] for o in overrides if o.lstrip("+~").startswith("train.optimizer_sync=")]
    other = next((v for v in given if v != OptimizerSync.deferred), None)
    if other is not None:
        raise ConfigError(f"plan.barrier=false with train.optimizer_sync={other}: a plan without the barrier "
                          f"scores steps that overlap, which only train.optimizer_sync=deferred runs (each "
                          f"candidate's command carries it). Fix: drop train.optimizer_sync={other}, or "
                          "plan.barrier=true to plan steps with the barrier.")
    if cfg.checkpoint.resume and resolve_verify(cfg):
        raise ConfigError(f"plan.barrier=false with verify=true and checkpoint.resume={cfg.checkpoint.resume}: "
                          "the plan's commands run train.optimizer_sync=deferred, which a verified resumed run "
                          "refuses (verify reads the AdamW state before the first update). Fix: verify=false, "
                          "or plan.barrier=true.")


def _child_costs(cfg: DictConfig, child_costs: dict[int, dict[str, ChildCost]], microbatches: int,
                 device) -> dict[str, ChildCost]:
    """The child timings at the microbatch size of ``microbatches`` (timed once per size)."""
    size = cfg.train.batch_size // (cfg.parallel.dp * microbatches)
    if size not in child_costs:
        child_costs[size] = measure_child_costs(cfg, size, cfg.plan.repeats, device)
    return child_costs[size]


def _synthesized(cfg: DictConfig, layout: Layout, v_shape: bool, split_points: list[str] | None,
                 seeds: Mapping[str, dict], child: Mapping[str, ChildCost], calibration: Calibration, model: Fit,
                 out: Path) -> tuple[Candidate, list | None]:
    """Search an order for this layout's costs and ``plan.memory_limit``, write it as a CSV in
    ``out``, and plan it as the run would: checked like a user's CSV, then predicted."""
    m, spr = layout.microbatches, layout.num_stages // layout.pp
    name = f"synthesized_pp{layout.pp}_m{m}_{'v' if v_shape else 'loop'}{spr}{'_split' if split_points else ''}.csv"
    path = out / name
    candidate = Candidate("synthesized", m, spr, _overrides("csv", m, None, str(path), split_points), valid=False,
                          split_points=split_points)
    costs, comm_s = layout_costs(layout.stages, child, calibration, model)
    problem = Problem(m, layout.stage_to_rank, costs, comm_s, _saved_bytes(layout, child),
                      weight_grad_fraction=cfg.plan.weight_grad_fraction, barrier=cfg.plan.barrier,
                      meetings=tuple(tied_meetings(layout.tied, calibration.all_reduce_link())))
    problem = replace(problem, memory_limit=memory_limit("plan.memory_limit", cfg.plan.memory_limit, problem))

    def dry_run(order: dict[int, list[Op]]) -> None:  # what a run checks before it spawns
        write_schedule_csv(path, order)
        if read_csv_schedule(str(path), pp=layout.pp, stages_per_rank=None, microbatches=m)[1] != layout.stage_to_rank:
            raise ConfigError(f"{path} places stages differently from the layout it was searched for")

    found = synthesize(problem, seeds=seeds, budget=cfg.plan.search_budget, check=dry_run,
                       seed=f"{cfg.plan.search_seed}/{path.name}")
    if found is None:
        candidate.reason = f"no order holds a microbatch within plan.memory_limit={cfg.plan.memory_limit}"
        return candidate, None
    write_schedule_csv(path, found.order)
    candidate.search = {"csv": str(path), "placement": "V" if v_shape else "loop", "origin": found.origin,
                        "evaluated": found.evaluated,
                        "rejected": found.rejected, "improved_by_moves": found.improved_by_moves,
                        "seconds": round(found.seconds, 3), "seed": cfg.plan.search_seed}
    trial = copy.deepcopy(cfg)
    trial.schedule = CsvScheduleConfig(csv=str(path))
    trial.parallel.microbatches, trial.parallel.stages_per_rank, trial.parallel.split_points = m, None, split_points
    try:
        checked = validate(trial).layout
    except ConfigError as e:  # the search checked it already: this would be a bug
        candidate.reason = str(e).splitlines()[0]
        return candidate, None
    return candidate, _predict(candidate, checked, found.order, child, calibration, model, cfg.plan)


def _mark_ties(ranked: list[Candidate], tolerance: float) -> None:
    """The candidates that fit, predicted within ``tolerance`` of the fastest, tie: the plan cannot
    tell them apart. Of those it recommends the one holding the least activation memory, then a
    built-in schedule over a synthesized one (no file to keep), then the fastest: a choice that
    stays put when noise reorders the tied predictions."""
    fitting = [c for c in ranked if c.valid and c.fits_memory]
    if not fitting:
        return
    fastest = fitting[0].prediction().step_s
    tied = [c for c in fitting if c.prediction().step_s <= fastest * (1 + tolerance)]
    for c in tied:
        c.tie = len(tied) > 1
    min(tied, key=lambda c: (max(c.peak_activation_bytes), max(c.peak_activation_mb or [0.0]),
                             c.schedule == "synthesized", c.prediction().step_s)).recommended = True

