"""Profiling cost: the steady step with the profiler on, outside its window, against the same run
with profiling off, in alternating runs."""

from __future__ import annotations

import json
import statistics
import time
from typing import Any, Mapping

from bench.common import MODEL
from bench.markdown import against_one, meta_line, ratios_line
from bench.runs import Context, error_line, run_cli, step_times
from bench.section import Page, Section


def profiling(ctx: Context) -> dict[str, Any]:
    """Steady-state step time with profiling on (steps outside the window) / off, alternating."""
    common = ["schedule=1f1b", "parallel.microbatches=8", f"train.steps={ctx.args.profile_steps}", *MODEL]
    pairs = []
    for i in range(ctx.args.repeats):
        on, off = ctx.work / f"prof-on-{i}", ctx.work / f"prof-off-{i}"
        t0 = time.time()
        done_on = run_cli(ctx, *common, "profile.enabled=true", f"hydra.run.dir={on}")
        done_off = run_cli(ctx, *common, "profile.enabled=false", f"hydra.run.dir={off}")
        missing = [(d, done) for d, done in ((on, done_on), (off, done_off)) if not (d / "summary.json").is_file()]
        if missing:
            pairs.append({"error": error_line(*missing[0])})
            continue
        window = set(json.loads((on / "summary.json").read_text())["bubble"]["steps"])
        window |= {min(window) - 1}  # the profiler's warm-up step
        on_s, off_s = statistics.median(step_times(on, window)), statistics.median(step_times(off, set()))
        pairs.append({"on_s": on_s, "off_s": off_s, "ratio": on_s / off_s, "under_load": ctx.loaded(t0, time.time())})
    return {"model": MODEL, "steps": ctx.args.profile_steps, "pairs": pairs}


def render(data: Mapping[str, Any], page: Page) -> list[str]:
    res = data["results"]
    return ["## Profiling cost", "", meta_line(data["meta"], res.get("pairs")), "",
            "Median steady-state step time with `profile.enabled=true`, outside the profiled window, over the same "
            "with profiling off (1F1B, pp=2, m=8, " + f"{res.get('steps')} steps), alternating runs: "
            + ratios_line(res.get("pairs", [])) + "." + against_one(res.get("pairs", []), "a profiled run"), ""]


SECTION = Section("profiling", profiling, render)
