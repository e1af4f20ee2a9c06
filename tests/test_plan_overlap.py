"""The schedule search without the barrier (``plan.barrier=false``, issue #37 item 4): steps that
overlap are scored by the longest rank's span within a step (the Zero Bubble paper's measure),
whose floor is the busiest rank's compute, m(F+B+W). In-process, small settings."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import yaml

from runner.errors import ConfigError
from runner.pipeline.simulate import compute_floor, rank_span, simulate, steady_step
from runner.plan.__main__ import main_from_costs, plan_in
from runner.plan.from_costs import builtin_orders, given_problem
from runner.plan.given import GivenCosts
from runner.plan.problem import lower_bound
from runner.plan.synthesize import synthesize

from helpers.config import compose

# p = 4, m = 8 with the paper's proportions (Table 9's 1.5B: W about half of F and I; messages 3%).
P, M = 4, 8
F, IN, W, COMM = 1.0, 0.98, 0.5, 0.03  # F, I (the paper's B), W, message (ms)


def _problem(limit: str, *, barrier: bool):
    given = GivenCosts("t", P, M, [F] * P, [IN] * P, [W] * P, COMM, 0.4, limit, None)
    return given_problem(given, barrier=barrier)


def test_the_floor_without_the_barrier_is_the_busiest_ranks_compute():
    problem = _problem("2x1f1b", barrier=False)
    assert lower_bound(problem) == pytest.approx(M * (F + IN + W))  # m(F+B+W), the paper's floor
    assert lower_bound(replace(problem, barrier=True)) > M * (F + IN + W)  # the barrier adds the ramps


@pytest.mark.timeout(60)
def test_without_the_barrier_the_search_beats_the_barriers_best_order_in_the_steady_state():
    seeds = builtin_orders(P, M)
    with_barrier = synthesize(_problem("2x1f1b", barrier=True), seeds=seeds, budget=120, seed=0)
    problem = _problem("2x1f1b", barrier=False)
    found = synthesize(problem, seeds=seeds, budget=120, seed=0)
    assert with_barrier is not None and found is not None
    steady = {name: steady_step(s.order, problem.costs, num_stages=P, comm_s=COMM)[0]
              for name, s in (("barrier", with_barrier), ("overlap", found))}
    floor = compute_floor(found.order, problem.costs)
    assert floor == pytest.approx(M * (F + IN + W))
    # Scored by its span, the barrier-free order is faster once steps run back to back ...
    assert steady["overlap"] < steady["barrier"] * 0.99, steady
    # ... its span is what the search reports, no step repeats shorter than it, and none beats the floor.
    timeline = simulate(found.order, problem.costs, num_stages=P, comm_s=COMM)
    assert found.makespan_s == pytest.approx(rank_span(timeline))
    assert floor - 1e-9 <= steady["overlap"] <= found.makespan_s + 1e-9
    assert found.lower_bound_s == pytest.approx(floor)
    # ZB-H2 by the same measure (its put-off Ws still end its step late): the search beats it.
    assert found.makespan_s < rank_span(simulate(seeds["zbh2"], problem.costs, num_stages=P, comm_s=COMM)) * 0.99


@pytest.mark.timeout(60)
def test_plan_barrier_false_plans_a_costs_file_by_span_and_is_refused_elsewhere(tmp_path):
    data = {"pp": P, "microbatches": M, "F": F, "B": IN, "W": W, "comm_s": COMM, "weight_grad_fraction": 0.4,
            "memory_limit": "2x1f1b"}
    path = tmp_path / "costs.yaml"
    path.write_text(yaml.safe_dump(data))
    out = tmp_path / "out"
    out.mkdir()
    main_from_costs(compose(f"plan.costs={path}", "plan.barrier=false", "plan.search_budget=60"), out)
    rows = {r["schedule"]: r for r in json.loads((out / "plan.json").read_text())}
    floor = M * (F + IN + W)
    for name in ("zbh2", "synthesized"):  # every candidate by the span: none under the floor
        assert rows[name]["predicted_step_time_s"] >= floor - 1e-9
        assert rows[name]["lower_bound_s"] == pytest.approx(floor)
    assert rows["synthesized"]["predicted_step_time_s"] <= rows["zbh2"]["predicted_step_time_s"] + 1e-9
    with pytest.raises(ConfigError, match=r"plan.barrier=false.*Fix:"):  # a plan of this host: runs keep it
        plan_in(compose("plan.barrier=false"), tmp_path, ["plan.barrier=false"])


def test_the_bench_table_compares_with_the_floor_and_the_papers_zb2p():
    from bench.sections.zb_overlap import table_lines

    row = {"model": "1.5B", "pp": 8, "microbatches": 32, "limit": "2x1f1b", "floor_s": 1.4698, "zbh1_s": 1.6782,
           "zbh2_s": 1.6041, "step_s": 1.4698 * 1.005, "budget": 600, "seconds": 28.0, "under_load": True}
    lines = table_lines([row, {**row, "limit": "1f1b", "step_s": 1.6782}])
    assert "| 1.5B | 8 | 32 | 2x1f1b | 1469.8 | 1678.2 | 1604.1 | 1477.1 | +0.50% | 1475.5 | 600 | 28* |" in lines
    assert "| 1.5B | 8 | 32 | 1f1b | 1469.8 | 1678.2 | 1604.1 | 1678.2 | +14.18% | - | 600 | 28* |" in lines
    assert "- At 2x1f1b: within 1% of the floor (so of ZB-2p) in 1 of 1 settings." in lines
