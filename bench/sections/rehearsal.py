"""Rehearsal (``rehearse=on``, docs/rehearsal.md): the benchmark model on three small layouts, each
run for real and rehearsed rank by rank; the composed step against the measured one, as ratios from
the same run of this section."""

from __future__ import annotations

import json
import time
from typing import Any, Mapping

from bench.common import MODEL, median
from bench.markdown import meta_line, num, star
from bench.runs import Context, alternating_runs, error_line, run_cli
from bench.section import Page, Section

# One thread per rank, real or rehearsed: a rehearsed rank runs alone, and would otherwise take every
# core, where the real run's ranks share them.
REHEARSAL_RUNS = {
    "pp2": ["parallel.pp=2", "parallel.microbatches=8"],
    "pp2-tp2": ["parallel.pp=2", "parallel.tp=2", "parallel.microbatches=8"],
    "dp2-pp2-fsdp": ["parallel.pp=2", "parallel.dp=2", "parallel.dp_mode=fsdp", "parallel.microbatches=4"],
}


def _ranks(args) -> int:
    return 4


def _rehearse(ctx: Context, name: str, common: list[str]) -> dict[str, Any]:
    run_dir = ctx.work / f"rehearsal-{name}"
    started = time.time()
    done = run_cli(ctx, "rehearse=on", *common, *REHEARSAL_RUNS[name], f"hydra.run.dir={run_dir}")
    report_file = run_dir / "rehearsal.json"
    if not report_file.is_file():
        return {"config": name, "status": "failed", "error": error_line(run_dir, done)}
    report = json.loads(report_file.read_text())
    step = report["step"]
    return ctx.mark({"config": name, "status": "ok", "wall_s": time.time() - started, "started_at": started,
                     "finished_at": time.time(), "ranks": [r["rank"] for r in report["ranks"]],
                     "step_s": step["step_s"], "pipeline_s": step["pipeline_s"],
                     "collectives_s": step["collectives_s"], "optimizer_s": step["optimizer_s"],
                     "bubble": step["bubble"], "rank_step_s": [r["step_s"] for r in report["ranks"]]})


def rehearsal_vs_runs(ctx: Context) -> dict[str, Any]:
    common = [*MODEL, "schedule=1f1b", "profile.enabled=false", "launch.threads_per_rank=1"]
    runs = alternating_runs(ctx, "rehearsal-real", REHEARSAL_RUNS, [*common, f"train.steps={ctx.args.option_steps}"])
    rehearsals = []
    for name in REHEARSAL_RUNS:
        rehearsals.append(_rehearse(ctx, name, common))
        print(f"[bench] rehearsal {name}: {rehearsals[-1].get('step_s') or rehearsals[-1].get('error')}", flush=True)
    return {"overrides": common, "layouts": REHEARSAL_RUNS, "runs": runs, "rehearsals": rehearsals}


def render(data: Mapping[str, Any], page: Page) -> list[str]:
    res, runs = data["results"], data["results"]["runs"]
    rehearsals = {r["config"]: r for r in res["rehearsals"]}
    lines = ["## Rehearsal: the composed step against the real run", "",
             meta_line(data["meta"], [*runs, *res["rehearsals"]]), "",
             "The benchmark model (`" + " ".join(res["overrides"]) + "`) on three layouts: "
             + "; ".join(f"{name}: `{' '.join(o)}`" for name, o in res["layouts"].items())
             + ". Each is run for real (steady step: the median from step 2 on, the median over repeats; pipeline: "
               "the pipeline call alone, from the recorder) and rehearsed (`rehearse=on`: one rank per pipeline "
               "rank, each alone, 3 steps; the composed step of docs/rehearsal.md, on the default link of 10 us and "
               "50 GB/s). Ratios are composed / measured, from the same run of this section.", "",
             "| layout | measured step (s) | composed step (s) | composed / measured | measured pipeline (s) "
             "| composed pipeline (s) | composed / measured | rehearsal took (s) |",
             "|---|---|---|---|---|---|---|---|"]
    for name in res["layouts"]:
        ok = [r for r in runs if r["config"] == name and r.get("status") == "ok"]
        rehearsed = rehearsals.get(name, {})
        if not ok or rehearsed.get("status") != "ok":
            error = rehearsed.get("error") or next((r.get("error") for r in runs if r["config"] == name), "not run")
            lines.append(f"| {name} | failed: {error} | | | | | | |")
            continue
        step = median([r["steady_s"] for r in ok if r.get("steady_s")])
        pipeline = median([r["pipeline_step_s"] for r in ok if r.get("pipeline_step_s")])
        loaded = star({"under_load": any(r.get("under_load") for r in [*ok, rehearsed])})
        lines.append(f"| {name}{loaded} | {num(step)} | {num(rehearsed['step_s'])} "
                     f"| {num(rehearsed['step_s'] / step if step else None, '.2f')} | {num(pipeline)} "
                     f"| {num(rehearsed['pipeline_s'])} "
                     f"| {num(rehearsed['pipeline_s'] / pipeline if pipeline else None, '.2f')} "
                     f"| {num(rehearsed['wall_s'], '.0f')} |")
    every = [*runs, *res["rehearsals"]]
    if every and all(r.get("under_load") for r in every):
        lines += ["", "Every run of this section shared the machine with other work: the ratios measure the load as "
                      "much as the rehearsal (a real run's ranks and a rehearsed rank were slowed by different "
                      "amounts at different times). Re-run it on a quiet machine before reading them as accuracy."]
    return lines + ["", _MEANING, ""]


# How to read the table (the same words whatever the numbers: the ratios say how much).
_MEANING = (
    "How to read it: a rehearsed rank computes alone, with every peer answered at once, so its actions hold no "
    "waiting and no communication; the composed step adds the messages between stages and the tp/dp collectives "
    "on the link's model, serially. On CPU over loopback gloo the real ranks also share two cores (a rehearsed "
    "rank has them to itself, one thread each way), and tp's all-reduces inside every block's actions move through "
    "memory copies on the cores that compute, which the default link does not model. On GPUs each rank owns its "
    "device and the link is set from `plan.comm_*`.")


SECTION = Section("rehearsal", rehearsal_vs_runs, render, ranks=_ranks)
