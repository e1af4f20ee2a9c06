"""Planner inputs for in-process tests: fixed message and runtime costs instead of calibration
ranks, and synthetic per-stage action costs."""

from __future__ import annotations

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
