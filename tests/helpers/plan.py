"""Planner inputs for in-process tests: fixed message and runtime costs instead of calibration
ranks, and synthetic per-stage action costs."""

from __future__ import annotations

from pathlib import Path

# Fixed message and runtime costs and no probes: in-process tests need no calibration or probe ranks.
FIXED = ["plan.comm_latency_s=2e-4", "plan.comm_bandwidth=1e9", "plan.action_overhead_s=0",
         "plan.corunning_slowdown=1", "plan.comm_busy_delay_s=0", "plan.action_jitter=0", "plan.probe_seconds=0"]


def synthetic_costs(num_stages: int, skew: float) -> dict[tuple[int, str], float]:
    """Relative costs as measured on CPU (I + W a little over B), plus a runtime overhead per
    action; ``skew`` makes the last stage (a large-vocabulary head) that many times heavier."""
    costs = {}
    for s in range(num_stages):
        scale = skew if s == num_stages - 1 else 1.0
        f, b, i, w = scale, 2 * scale, (1.2 * scale if s else 0.0), (1.0 * scale if s else 2 * scale)
        costs.update({(s, "F"): f + 0.1, (s, "B"): b + 0.1, (s, "I"): i + 0.1, (s, "W"): w + 0.1})
    return costs


def round_schedule_csv(path: Path) -> dict:
    """A round schedule at pp=2, m=4 (what the search without the barrier starts from: stage 0
    splits its backward too, I then W; rank 1 puts all its Ws off to the end), written as a CSV
    schedule at ``path``; returns its order."""
    from runner.outputs.timeline import write_schedule_csv
    from runner.pipeline.schedule import placement
    from runner.plan.problem import Problem
    from runner.plan.rounds import Rounds, round_schedule

    order = round_schedule(Problem(4, placement("1f1b", 2, 2), synthetic_costs(2, 1.0), comm_s=0.1, barrier=False),
                           Rounds(early_stop=True, eager_w=True, split_first=True))
    assert order is not None
    write_schedule_csv(path, order)
    return order
