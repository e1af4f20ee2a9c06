"""Runner overhead: the runner's steady step against the smallest hand-written loop over the same
stages (``programs/bare_loop.py``), in alternating runs."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Mapping

from bench.common import MODEL, ROOT, compose
from bench.markdown import against_one, meta_line, ratios_line
from bench.runs import Context, error_line, run_cli, step_times
from bench.section import Page, Section

BARE_LOOP = Path(__file__).resolve().parents[1] / "programs" / "bare_loop.py"


def overhead(ctx: Context) -> dict[str, Any]:
    """The runner's median steady-state step time over a bare loop's (same model, stages, data,
    schedule, 2 spawned ranks), alternating A/B."""
    from omegaconf import OmegaConf

    work = ctx.work
    overrides = ["schedule=1f1b", "parallel.microbatches=8", f"train.steps={ctx.args.overhead_steps}", *MODEL]
    cfg = OmegaConf.to_container(compose([*overrides, f"device={ctx.args.device}"]), resolve=True)
    pairs = []
    for i in range(ctx.args.repeats):
        run = work / f"overhead-runner-{i}"
        t0 = time.time()
        done = run_cli(ctx, *overrides, "profile.enabled=false", "launch.threads_per_rank=1", f"hydra.run.dir={run}")
        out = work / f"overhead-bare-{i}.json"
        store = work / f"loop-store-{i}"
        bare = subprocess.run([sys.executable, str(BARE_LOOP), json.dumps(cfg), str(store), str(out)],
                              env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True)
        if not (run / "metrics.jsonl").is_file() or not out.is_file():
            pairs.append({"error": error_line(run, done) if not (run / "metrics.jsonl").is_file()
                          else (bare.stderr.strip().splitlines() or ["bare loop failed"])[-1][:300]})
            continue
        runner_s = statistics.median(step_times(run, set()))
        bare_s = statistics.median(json.loads(out.read_text())[1:])
        pairs.append({"runner_s": runner_s, "bare_s": bare_s, "ratio": runner_s / bare_s,
                      "under_load": ctx.loaded(t0, time.time())})
    return {"model": MODEL, "steps": ctx.args.overhead_steps, "pairs": pairs}


def render(data: Mapping[str, Any], page: Page) -> list[str]:
    res = data["results"]
    return ["## Runner overhead", "", meta_line(data["meta"], res.get("pairs")), "",
            "Median steady-state step time of the runner (1F1B, pp=2, m=8, profiling off, `"
            + " ".join(res.get("model", [])) + "`; its step adds the global-norm clip and the loss all-reduce) over a "
            "minimal hand-written loop that builds the same stages and calls `Schedule1F1B.step()` and AdamW, "
            "alternating runs: " + ratios_line(res.get("pairs", [])) + "."
            + against_one(res.get("pairs", []), "the runner"), ""]


SECTION = Section("overhead", overhead, render)
