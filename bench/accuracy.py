"""The planner's error on single plans, from ``benchmarks/planner.json``: each round's plan against
the runs that followed it (not the medians over rounds that the planner section tabulates), per
model size and over all sizes, the configurations that round's plan probed apart from the others.
``scripts/planner_accuracy.py`` prints it; the ``accuracy`` section renders it in BENCHMARKS.md."""

from __future__ import annotations

import statistics
from typing import Any, Mapping, Sequence

__all__ = ["percentile", "single_plan_errors", "accuracy"]


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0..1) with linear interpolation between order statistics (numpy's default)."""
    xs = sorted(values)
    pos = q * (len(xs) - 1)
    low = int(pos)
    high = min(low + 1, len(xs) - 1)
    return xs[low] + (xs[high] - xs[low]) * (pos - low)


def _probed(plan_round: Mapping[str, Any]) -> set[str]:
    return {p["label"].replace(" m=", "/") for p in (plan_round.get("fit") or {}).get("probes", [])}


def single_plan_errors(size: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Every (round, configuration) with a prediction and a measured step: predicted / measured - 1,
    and whether that round's plan probed the configuration (fitted its cost model to a run of it)."""
    out = []
    for r, plan_round in enumerate(size.get("rounds", [])):
        probed = _probed(plan_round)
        for key, predicted in plan_round["predicted"].items():
            measured = (plan_round["measured"].get(key) or {}).get("step_s")
            if measured and predicted.get("step_s"):
                out.append({"round": r, "config": key, "error": predicted["step_s"] / measured - 1,
                            "probed": key in probed})
    return out


def _figures(errors: Sequence[Mapping[str, Any]]) -> dict[str, Any] | None:
    if not errors:
        return None
    size = [abs(e["error"]) for e in errors]
    return {"n": len(size), "median": statistics.median(size), "p90": percentile(size, 0.9),
            "signed_median": statistics.median(e["error"] for e in errors), "within_10": sum(s <= 0.10 for s in size)}


def accuracy(planner: Mapping[str, Any]) -> dict[str, Any]:
    """Per size and ``all``: figures (n, median and 90th percentile of the absolute error, median
    signed error, how many within 10%) for every plan, the probed configurations and the others."""
    sizes = planner["results"].get("sizes") or {"benchmark": planner["results"]}
    per = {name: single_plan_errors(s) for name, s in sizes.items() if "error" not in s}
    per["all"] = [e for errors in per.values() for e in errors]
    return {name: {"every": _figures(errors), "probed": _figures([e for e in errors if e["probed"]]),
                   "not_probed": _figures([e for e in errors if not e["probed"]])}
            for name, errors in per.items()}
