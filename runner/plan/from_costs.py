"""Plans from given costs (``python -m runner.plan plan.costs=<file.yaml|json>``): the built-in
schedules of one stage per rank and a synthesized order, simulated with the file's costs (one
stage per rank, messages between neighbouring ranks, memory per action) without a model, a
calibration or ranks. A candidate's step is its simulated pipeline: the file has no optimizer or
all-reduce costs; where it names a weight tied across stages (``tied``: its stages and gradient
bytes), the sum where the ranks holding its copies meet after their backward
(``runner.plan.link.tied_meetings`` on ``link``: ``plan.comm_*``), which the search scores too.
Without the barrier (``plan.barrier=false``) it is the steady step of steps back to back
(``deferred_step``, with that meeting), for the built-in orders and the searched one alike (the
search minimises the longest rank's span, then re-scores its finalists by that steady step:
``runner.plan.synthesize.rescore``); a step that must be validated at its own end
(``commit_step_s``) takes the pipeline's makespan and the sum."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from runner.outputs.timeline import write_schedule_csv
from runner.pipeline.ops import Op
from runner.pipeline.schedule import SCHEDULES, is_single_stage, read_csv_schedule, schedule_order
from runner.pipeline.simulate import deferred_step, expected_makespan, peak_in_flight, simulate
from runner.plan.given import GivenCosts, memory_limit
from runner.plan.link import DEFAULT_LINK, Link, tied_meetings
from runner.plan.planner import DEFERRED, Candidate, _mark_ties
from runner.plan.problem import Problem, lower_bound
from runner.plan.synthesize import synthesize

__all__ = ["given_problem", "builtin_orders", "plan_from_costs"]


def given_problem(given: GivenCosts, *, barrier: bool = True, link: Link = DEFAULT_LINK) -> Problem:
    """The file's costs as a search problem: stage r on rank r, its limit resolved (1F1B's memory
    is p microbatches' activations on every rank), its tied sum priced on ``link``; ``barrier``
    false scores steps that overlap."""
    stage_bytes = {s: (given.activation_bytes[s] if given.activation_bytes else 1.0) for s in range(given.pp)}
    problem = Problem(given.microbatches, {s: s for s in range(given.pp)}, given.costs(), given.comm_s, stage_bytes,
                      weight_grad_fraction=given.weight_grad_fraction, barrier=barrier,
                      meetings=tuple(tied_meetings(given.tied, link)))
    return replace(problem, memory_limit=memory_limit("memory_limit", given.memory_limit, problem))


def builtin_orders(pp: int, microbatches: int) -> dict[str, dict[int, list[Op]]]:
    """The built-in schedules of one stage per rank that have an order at these counts."""
    out = {}
    for name in SCHEDULES:
        if is_single_stage(name):
            try:
                out[name] = schedule_order(name, pp, microbatches, 1)
            except (ValueError, AssertionError, RuntimeError):
                continue  # e.g. too few microbatches for its shape
    return out


def _candidate(name: str, order: dict[int, list[Op]], problem: Problem, overrides: list[str],
               with_bytes: bool) -> tuple[Candidate, list]:
    timeline = simulate(order, problem.costs, num_stages=problem.num_stages, comm_s=problem.comm_s)
    makespan = max(a.end for a in timeline)
    met = expected_makespan(order, problem.costs, num_stages=problem.num_stages, comm_s=problem.comm_s,
                            meetings=problem.meetings)  # after the tied sum (the makespan without one)
    # Without the barrier a step is the steady step of steps back to back (train.optimizer_sync=
    # deferred's, without updates: the file has none), as every plan without the barrier scores it.
    pipeline, step = makespan, met
    if not problem.barrier:
        pipeline = deferred_step(order, problem.costs, num_stages=problem.num_stages, comm_s=problem.comm_s)
        step = deferred_step(order, problem.costs, num_stages=problem.num_stages, comm_s=problem.comm_s,
                             meetings=problem.meetings) if problem.meetings else pipeline
    busy = sum(a.end - a.start for a in timeline)
    nbytes = peak_in_flight(order, problem.stage_bytes, problem.weight_grad_fraction)
    in_mb = peak_in_flight(order, None, problem.weight_grad_fraction)
    counts = peak_in_flight(order)
    c = Candidate(name, problem.microbatches, 1, overrides, valid=True, predicted_step_time_s=step,
                  pipeline_s=pipeline, after_pipeline_s=step - pipeline, bubble=1 - busy / (problem.pp * pipeline),
                  lower_bound_s=lower_bound(problem), peak_activations=[int(counts[r]) for r in sorted(counts)],
                  # Without activation_bytes there are no bytes to give (0; the table prints "-").
                  peak_activation_bytes=[round(nbytes[r]) if with_bytes else 0 for r in sorted(nbytes)],
                  peak_activation_mb=[round(in_mb[r], 3) for r in sorted(in_mb)],
                  stage_costs_s={f"{s}{k}": v for (s, k), v in sorted(problem.costs.items())},
                  commit_step_s=None if problem.barrier else met)
    c.fits_memory = problem.memory_limit is None or max(nbytes.values()) <= problem.memory_limit * (1 + 1e-9)
    return c, timeline


def plan_from_costs(given: GivenCosts, out: Path, *, budget: int, seed: int, tie_tolerance: float,
                    barrier: bool = True, link: Link = DEFAULT_LINK) -> tuple[list[Candidate], dict[int, list]]:
    """Every candidate, fastest within the limit first (ties and the recommended one marked),
    and each one's timeline by ``id(candidate)``. The synthesized order is written as
    ``synthesized_pp<p>_m<m>_loop1.csv`` into ``out``, checked as a run checks a user's CSV.
    ``barrier`` false (``plan.barrier``): every step, searched or built-in, is the steady step of
    overlapping steps (``deferred_step``). ``link``: what the file's tied sum is priced on."""
    problem = given_problem(given, barrier=barrier, link=link)
    pp, m = given.pp, given.microbatches
    results, timelines = [], {}
    with_bytes = given.activation_bytes is not None
    seeds = builtin_orders(pp, m)
    for name, order in seeds.items():
        c, timeline = _candidate(name, order, problem, [f"parallel.pp={pp}", f"schedule={name}",
                                                        f"parallel.microbatches={m}", "parallel.stages_per_rank=1"],
                                  with_bytes)
        results.append(c)
        timelines[id(c)] = timeline
    path = out / f"synthesized_pp{pp}_m{m}_loop1.csv"

    def dry_run(order: dict[int, list[Op]]) -> None:  # what a run checks before it spawns
        write_schedule_csv(path, order)
        read_csv_schedule(str(path), pp=pp, stages_per_rank=None, microbatches=m)

    found = synthesize(problem, seeds=seeds, budget=budget, seed=f"{seed}/{path.name}", check=dry_run)
    overrides = [f"parallel.pp={pp}", "schedule=csv", f"schedule.csv={path}", f"parallel.microbatches={m}",
                 "parallel.stages_per_rank=null"]
    if found is None:
        results.append(Candidate("synthesized", m, 1, overrides, valid=False,
                                 reason=f"no order holds a microbatch within memory_limit={given.memory_limit}"))
    else:
        write_schedule_csv(path, found.order)
        c, timeline = _candidate("synthesized", found.order, problem, overrides, with_bytes)
        c.search = {"csv": str(path), "placement": "loop", "origin": found.origin, "evaluated": found.evaluated,
                    "rejected": found.rejected, "improved_by_moves": found.improved_by_moves,
                    "seconds": round(found.seconds, 3), "seed": seed}
        results.append(c)
        timelines[id(c)] = timeline
    if not barrier:  # what was scored: runs of these commands overlap their steps
        for c in results:
            c.overrides.append(DEFERRED)
    ranked = sorted(results, key=lambda c: (not c.valid, not c.fits_memory, c.predicted_step_time_s or 0.0))
    _mark_ties(ranked, tie_tolerance)
    return ranked, timelines

