"""Schedule synthesis: searched orders run (torch's dry run, as a user's CSV), respect the memory
budget, come near a computed lower bound, beat or match the built-ins, and stay deterministic;
the planner lists them, and tied predictions are declared as ties."""

from __future__ import annotations

import random

import pytest

from runner.outputs.timeline import write_schedule_csv
from runner.pipeline.ops import Op
from runner.pipeline.schedule import (
    SCHEDULES,
    V_SHAPED,
    is_single_stage,
    placement,
    read_csv_schedule,
    schedule_order,
)
from runner.pipeline.simulate import peak_in_flight, simulate
from runner.plan.planner import Candidate, _mark_ties, plan
from runner.plan.report import search_report, table
from runner.plan.synthesize import Problem, lower_bound, synthesize

from helpers.config import TINY, compose
from helpers.plan import FIXED, synthetic_costs

# The margin the searched pipeline stays within over the lower bound (the busiest rank's compute
# after the first forward can reach it, plus what must follow its last action; or one
# microbatch's path through every stage and back). The bound ignores the memory budget and that
# a rank cannot compute two things at once on the way in and out, so no order reaches it at
# m = pp; measured over these cases: at most 11% (pp=4, m=4, V), mostly under 6%.
MARGIN = 0.15


def _builtins(pp: int, m: int, spr: int, v_shape: bool) -> dict[str, dict[int, list[Op]]]:
    """The built-in orders for this placement that torch accepts."""
    out = {}
    for name in SCHEDULES:
        if is_single_stage(name) != (spr == 1) or (name in V_SHAPED) != v_shape:
            continue
        try:
            out[name] = schedule_order(name, pp, m, spr)
        except (ValueError, AssertionError, RuntimeError):
            continue  # e.g. DualPipeV with fewer microbatches than stages
    return out


def _dry_run(path, pp: int, m: int, stage_to_rank: dict[int, int]):
    def check(order):
        write_schedule_csv(path, order)
        assert read_csv_schedule(str(path), pp=pp, stages_per_rank=None, microbatches=m)[1] == stage_to_rank
    return check


LAYOUTS = [(pp, m, spr, v) for pp in (2, 4) for m in (4, 8) for spr, v in ((1, False), (2, False), (2, True))]


@pytest.mark.parametrize("skew", [1.0, 3.0], ids=["equal", "heavy-last"])
@pytest.mark.parametrize("pp,m,spr,v_shape", LAYOUTS, ids=[f"pp{p}-m{m}-{'v' if v else 'loop'}{s}"
                                                             for p, m, s, v in LAYOUTS])
def test_synthesized_order_runs_and_comes_near_the_lower_bound(tmp_path, pp, m, spr, v_shape, skew):
    n = pp * spr
    stage_to_rank = placement("zbv" if v_shape else "1f1b", pp, n)
    costs = synthetic_costs(n, skew)
    problem = Problem(m, stage_to_rank, costs, comm_s=0.1)
    seeds = _builtins(pp, m, spr, v_shape)
    path = tmp_path / "synthesized.csv"
    found = synthesize(problem, seeds=seeds, budget=120, seed=0, check=_dry_run(path, pp, m, stage_to_rank))
    assert found is not None and found.evaluated == 120
    # What a run checks before spawning: torch's validator and its dry run with sends and receives.
    write_schedule_csv(path, found.order)
    num_stages, placed = read_csv_schedule(str(path), pp=pp, stages_per_rank=None, microbatches=m)
    assert (num_stages, placed) == (n, stage_to_rank)
    done = simulate(found.order, costs, num_stages=n, comm_s=0.1)  # raises if it cannot progress
    assert max(a.end for a in done) == pytest.approx(found.makespan_s)
    bound = lower_bound(problem)
    assert found.lower_bound_s == bound <= found.makespan_s * (1 + 1e-9) <= bound * (1 + MARGIN) * (1 + 1e-9)
    # Never worse than the built-ins it started from.
    for name, order in seeds.items():
        assert found.makespan_s <= max(a.end for a in simulate(order, costs, num_stages=n, comm_s=0.1)) + 1e-9, name


def test_the_lower_bound_is_what_a_one_stage_pipeline_cannot_beat():
    # 2 ranks, F = 1, B = 2, no split, free messages: 1F1B with m microbatches takes (m + 1) x 3,
    # which is the bound (rank 1 waits one forward; rank 0 waits for the last backward).
    costs = {(s, k): c for s in range(2) for k, c in (("F", 1.0), ("B", 2.0))}
    problem = Problem(4, {0: 0, 1: 1}, costs)
    assert lower_bound(problem) == pytest.approx(15.0)
    step = max(a.end for a in simulate(schedule_order("1f1b", 2, 4, 1), costs, num_stages=2))
    assert step == pytest.approx(15.0)


def test_synthesis_respects_the_memory_budget_and_counts_deferred_weight_gradients():
    costs = synthetic_costs(4, 1.0)
    v_shape = placement("zbv", 2, 4)
    unlimited = synthesize(Problem(8, v_shape, costs, comm_s=0.1), seeds={}, budget=100, seed=0)
    budget = 4  # stage-microbatches per rank: what ZBV holds
    limited = synthesize(Problem(8, v_shape, costs, comm_s=0.1, memory_limit=budget), seeds={}, budget=100, seed=0)
    assert max(peak_in_flight(unlimited.order).values()) > budget  # without a budget it buys speed with memory
    # Held from F until B, or until W after an I: a W put off keeps its activations.
    assert max(peak_in_flight(limited.order).values()) <= budget
    assert limited.makespan_s >= unlimited.makespan_s
    # A seed that puts off its Ws holds two microbatches on rank 1 until then: over a budget of
    # one, so the search must not return it (nor anything else holding two).
    deferred = {0: [Op(0, "F", 0), Op(0, "B", 0), Op(0, "F", 1), Op(0, "B", 1)],
                1: [Op(1, "F", 0), Op(1, "I", 0), Op(1, "F", 1), Op(1, "I", 1), Op(1, "W", 0), Op(1, "W", 1)]}
    assert peak_in_flight(deferred) == {0: 1, 1: 2}
    tight = synthesize(Problem(2, {0: 0, 1: 1}, synthetic_costs(2, 1.0), memory_limit=1), seeds={"deferred": deferred},
                       budget=40, seed=0)
    assert tight.order != deferred and max(peak_in_flight(tight.order).values()) == 1
    # Below one microbatch's need (both stages of rank 0 at once) no order exists.
    assert synthesize(Problem(8, v_shape, costs, memory_limit=1), seeds={}, budget=20, seed=0) is None
    # In bytes per stage-microbatch: a heavy stage 0 leaves room for fewer microbatches.
    heavy = {0: 3.0, 1: 1.0, 2: 1.0, 3: 1.0}
    in_bytes = synthesize(Problem(8, v_shape, costs, comm_s=0.1, stage_bytes=heavy, memory_limit=10.0), seeds={},
                          budget=100, seed=0)
    assert max(peak_in_flight(in_bytes.order, heavy).values()) <= 10.0


def test_synthesis_is_deterministic_for_a_seed_and_bounded_by_its_budget():
    problem = Problem(8, placement("1f1b", 4, 4), synthetic_costs(4, 3.0), comm_s=0.1)
    runs = [synthesize(problem, seeds={}, budget=80, seed=7) for _ in range(2)]
    assert runs[0].order == runs[1].order and runs[0].evaluated == runs[1].evaluated == 80
    assert runs[0].seconds > 0
    assert synthesize(problem, seeds={}, budget=150, seed=7).makespan_s <= runs[0].makespan_s + 1e-9


def test_plan_lists_synthesized_orders_beside_the_builtins(tmp_path):
    cfg = compose(*TINY, *FIXED, "parallel.pp=2", "train.batch_size=8", "plan.microbatches=[4]", "plan.repeats=1",
                  "plan.synthesize=true", "plan.search_budget=60")
    candidates, timelines, _, _ = plan(cfg, tmp_path)
    searched = [c for c in candidates if c.schedule == "synthesized"]
    # m=4: one stage per rank, two looped, two in a V; each for the run's split (and the time-balanced one).
    assert {(c.stages_per_rank, c.search["placement"]) for c in searched} == {(1, "loop"), (2, "loop"), (2, "V")}
    for c in searched:
        assert c.valid and id(c) in timelines, c.reason
        assert c.overrides[:2] == ["schedule=csv", f"schedule.csv={c.search['csv']}"]
        assert (tmp_path / c.search["csv"].rsplit("/", 1)[1]).is_file()
        assert c.search["evaluated"] == 60 and c.search["seconds"] > 0
        same = [b for b in candidates if b.valid and b.schedule != "synthesized" and b.microbatches == 4
                and b.stages_per_rank == c.stages_per_rank and b.split_points == c.split_points
                and (b.schedule in V_SHAPED) == (c.search["placement"] == "V")]
        assert same and c.pipeline_s <= min(b.pipeline_s for b in same) + 1e-9
        assert c.lower_bound_s <= c.pipeline_s * (1 + 1e-9)  # equal when the order is optimal (up to rounding)
    report = "\n".join(search_report(candidates))
    assert "lower bound" in report and "best built-in there" in report
    assert "synthesized" in table(candidates)


def _candidate(name: str, step: float, peak: int) -> Candidate:
    return Candidate(name, 4, 1, [f"schedule={name}"], valid=True, predicted_step_time_s=step,
                     peak_activation_bytes=[peak], peak_activations=[1], stage_sizes=[1], bubble=0.1, pipeline_s=step,
                     lower_bound_s=step)


def test_candidates_predicted_within_the_tolerance_tie_and_the_pick_does_not_flip():
    # Three candidates 1% apart (inside a 5% tolerance) and one 20% slower. However noise orders
    # the three, they tie and the one holding least memory is recommended.
    picks = set()
    rng = random.Random(0)
    for _ in range(20):
        cands = [_candidate("gpipe", 1.00 * rng.uniform(0.985, 1.015), 300),
                 _candidate("1f1b", 1.01 * rng.uniform(0.985, 1.015), 100),
                 _candidate("zbv", 1.02 * rng.uniform(0.985, 1.015), 200), _candidate("looped_bfs", 1.2, 50)]
        ranked = sorted(cands, key=lambda c: c.predicted_step_time_s)
        _mark_ties(ranked, 0.05)
        assert [c.schedule for c in ranked if c.tie] and not ranked[-1].tie
        assert sum(c.recommended for c in ranked) == 1
        picks.add(next(c.schedule for c in ranked if c.recommended))
    assert picks == {"1f1b"}
    printed = table(ranked)
    assert "* 1f1b" in printed and "= gpipe" in printed and "  looped_bfs" in printed
    # Apart by more than the tolerance: no tie, the fastest is recommended.
    apart = [_candidate("gpipe", 1.0, 300), _candidate("1f1b", 1.2, 100)]
    _mark_ties(apart, 0.05)
    assert [c.recommended for c in apart] == [True, False] and not any(c.tie for c in apart)
