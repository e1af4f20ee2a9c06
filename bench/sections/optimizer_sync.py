"""The optimizer step without the barrier, measured: zbh2 at pp=4 on this host's CPU with
``train.optimizer_sync=barrier``, ``post_validate`` and ``deferred`` in alternating rounds; each run's
steady step time and its steady-state bubble over the recorded steps (``bubble.steady``), against the
simulator's steady step without the barrier for the order as run (``steady_step``) and its floor
(``compute_floor``). The clip is off (``train.grad_clip=0``): no step is rolled back, so the ratios
show the overlap alone (a rollback's cost: docs/optimizer-sync.md)."""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any, Mapping

from bench.common import MODEL, steady
from bench.markdown import meta_line, star
from bench.runs import Context, error_line, run_cli
from bench.section import Page, Section

MODES = ["barrier", "post_validate", "deferred"]
LAYOUT = ["schedule=zbh2", "parallel.pp=4", "parallel.microbatches=8", "train.grad_clip=0", *MODEL]


def _read(run_dir: Path, done) -> dict[str, Any]:
    summary_file = run_dir / "summary.json"
    if not summary_file.is_file():
        return {"error": error_line(run_dir, done)}
    summary = json.loads(summary_file.read_text())
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    bubble = summary["bubble"]
    return {"steady_s": steady([m["step_time_s"] for m in lines], skip=2), "steady": bubble.get("steady"),
            "bubble_per_step": bubble["mean"], "simulated_barrier_step_s": bubble["simulated_step_s"],
            "post_validate": summary.get("post_validate")}


def optimizer_sync(ctx: Context) -> dict[str, Any]:
    steps = ctx.args.sync_steps
    # The recorder over steps 3.. (the first includes shape inference); profiling itself off.
    common = [*LAYOUT, f"train.steps={steps}", "profile.enabled=false", "profile.wait=2", "profile.warmup=0",
              f"profile.active={steps - 2}"]
    rounds = []
    for repeat in range(ctx.args.sync_repeats):
        t0, runs = time.time(), {}
        for mode in MODES if repeat % 2 == 0 else reversed(MODES):  # a drifting load favours none
            run_dir = ctx.work / f"sync-{mode}-{repeat}"
            runs[mode] = _read(run_dir, run_cli(ctx, *common, f"train.optimizer_sync={mode}",
                                                f"hydra.run.dir={run_dir}"))
            print(f"[bench] optimizer_sync {mode} #{repeat}: {runs[mode].get('steady_s') or runs[mode].get('error')}",
                  flush=True)
        rounds.append({"repeat": repeat, "runs": runs, "under_load": ctx.loaded(t0, time.time())})
    return {"layout": LAYOUT, "steps": steps, "rounds": rounds}


def _ms(seconds: float | None) -> str:
    return f"{seconds * 1e3:.0f}" if seconds is not None else "-"


def render(data: Mapping[str, Any], page: Page) -> list[str]:
    res = data["results"]
    rounds = res["rounds"]
    lines = ["## The optimizer step without the barrier", "", meta_line(data["meta"], rounds), "",
             "zbh2 at pp=4, m=8 (" + ", ".join(f"`{o}`" for o in res["layout"][3:]) + f", {res['steps']} steps), "
             "`train.optimizer_sync` = `barrier`, `post_validate` and `deferred` in alternating rounds (* a round "
             "under load: on this host the four ranks share 2 cores, so one rank's optimizer and another's next "
             "warm-up compete for them). *step*: median step time after step 2; *steady step* and *bubble*: over "
             "the recorded steps 3.. (`bubble.steady`: the time between the first and the last recorded step's "
             "ends per step, and each rank's idle share of it, mean over ranks); *overlapped*: recorded steps "
             "that began on a rank before the previous one ended on another; *simulated*: the simulator's steady "
             "step without the barrier for the order as run with the run's own mean action times, and its floor "
             "(the busiest rank's compute per step).", "",
             "| round | mode | step (ms) | vs barrier | steady step (ms) | bubble | overlapped | simulated (ms) | "
             "floor (ms) | steady / simulated |", "|---|---|---|---|---|---|---|---|---|---|"]
    ratios: dict[str, list[float]] = {m: [] for m in MODES[1:]}
    for r in rounds:
        base = r["runs"].get("barrier", {}).get("steady_s")
        for mode in MODES:
            run = r["runs"].get(mode, {})
            if "error" in run or not run:
                lines.append(f"| {r['repeat']}{star(r)} | {mode} | failed: {run.get('error', 'not run')} |"
                             + " |" * 7)
                continue
            st = run.get("steady") or {}
            ratio = run["steady_s"] / base if base and mode != "barrier" else None
            if ratio is not None:
                ratios[mode].append(ratio)
            sim = st.get("simulated_step_s")
            lines.append("| " + " | ".join([
                f"{r['repeat']}{star(r)}", mode, _ms(run["steady_s"]), f"{ratio:.3f}" if ratio else "1",
                _ms(st.get("step_s")), f"{st['mean']:.3f}" if st else "-", str(st.get("overlapped_steps", "-")),
                _ms(sim), _ms(st.get("floor_s")),
                f"{st['step_s'] / sim:.2f}" if st and sim else "-"]) + " |")
    lines.append("")
    for mode, vals in ratios.items():
        if vals:
            lines.append(f"- `{mode}` over `barrier`, step time: " + ", ".join(f"{v:.3f}" for v in vals)
                         + f" (median {statistics.median(vals):.3f}).")
    return [*lines, ""]


SECTION = Section("optimizer_sync", optimizer_sync, render, ranks=lambda args: 4)
