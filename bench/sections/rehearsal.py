"""Rehearsal (``rehearse=on``, docs/rehearsal.md): the benchmark model on three small layouts, each
run for real and rehearsed rank by rank; the composed step against the measured one, as ratios from
the same run of this section. Then the planner's tp prediction (docs/planner.md): a tiny model at
pp=2 x tp=2 and pp=4, each run for real and planned, pp=2 x tp=2 both by the tp cost model and
with ``plan.rehearse=true``."""

from __future__ import annotations

import json
import time
from typing import Any, Mapping

from bench.common import MODEL, median
from bench.markdown import meta_line, num, star
from bench.runs import Context, alternating_runs, error_line, read_run, run_cli
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
    return {"overrides": common, "layouts": REHEARSAL_RUNS, "runs": runs, "rehearsals": rehearsals,
            "planner": planner_tp(ctx)}


# The planner's tp prediction: a model small enough that tp's all-reduces dominate its step, its link
# and runtime fixed (no calibration, no probes), one candidate per layout (1F1B at m=4; the planner
# also lists the split balancing measured time where it differs: only the run's own split is read).
PLAN_MODEL = ["model.dim=32", "model.n_layers=6", "train.seq_len=16", "data.vocab_size=48", "train.batch_size=8",
              "schedule=1f1b", "parallel.microbatches=4", "profile.enabled=false"]
PLAN_LAYOUTS = {"pp2xtp2": ["parallel.pp=2", "parallel.tp=2"], "pp4": ["parallel.pp=4"]}
PLAN_STEPS = 10
PLAN_KEYS = ["plan.microbatches=[4]", "plan.schedules=[1f1b]", "plan.repeats=1", "plan.probe_seconds=0",
             "plan.comm_latency_s=2e-4", "plan.comm_bandwidth=1e9", "plan.action_overhead_s=0",
             "plan.corunning_slowdown=1", "plan.comm_busy_delay_s=0", "plan.action_jitter=0"]
PLANS = {"pp2xtp2": ["pp2xtp2", False], "pp2xtp2-rehearsed": ["pp2xtp2", True], "pp4": ["pp4", False]}


def _planned(ctx: Context, name: str, layout: str, rehearse: bool) -> dict[str, Any]:
    """One ``python -m runner.plan``: its 1F1B m=4 candidate at the run's split."""
    out, started = ctx.work / f"rehearsal-plan-{name}", time.time()
    done = run_cli(ctx, *PLAN_MODEL, *PLAN_LAYOUTS[layout], *PLAN_KEYS, f"plan.rehearse={str(rehearse).lower()}",
                   f"hydra.run.dir={out}", module="runner.plan")
    found = None
    if (out / "plan.json").is_file():
        found = next((c for c in json.loads((out / "plan.json").read_text()) if c["schedule"] == "1f1b"
                      and c["microbatches"] == 4 and not c.get("split_points")), None)
    if done.returncode != 0 or found is None or not found.get("valid"):
        reason = (found or {}).get("reason") or error_line(out, done)
        return {"plan": name, "layout": layout, "rehearse": rehearse, "status": "failed", "error": reason}
    return ctx.mark({"plan": name, "layout": layout, "rehearse": rehearse, "status": "ok",
                     "started_at": started, "finished_at": time.time(), "wall_s": time.time() - started,
                     "step_s": found["predicted_step_time_s"], "costed_by": found.get("costed_by"),
                     "model_step_s": (found.get("rehearsal") or {}).get("model_step_s")})


def planner_tp(ctx: Context) -> dict[str, Any]:
    """Each layout run for real (``PLAN_STEPS`` steps: its summary's step time, what the planner
    predicts) and planned; pp=2 x tp=2 also with ``plan.rehearse=true``."""
    runs = []
    for layout, overrides in PLAN_LAYOUTS.items():
        run_dir = ctx.work / f"rehearsal-plan-real-{layout}"
        done = run_cli(ctx, *PLAN_MODEL, *overrides, f"train.steps={PLAN_STEPS}", f"hydra.run.dir={run_dir}")
        runs.append(ctx.mark({"layout": layout, **read_run(run_dir, done)}))
        print(f"[bench] planner tp: {layout} ran {runs[-1].get('step_time_s') or runs[-1].get('error')}", flush=True)
    plans = []
    for name, (layout, rehearse) in PLANS.items():
        plans.append(_planned(ctx, name, layout, rehearse))
        print(f"[bench] planner tp: plan {name}: {plans[-1].get('step_s') or plans[-1].get('error')}", flush=True)
    return {"model": PLAN_MODEL, "layouts": PLAN_LAYOUTS, "plan_keys": PLAN_KEYS, "steps": PLAN_STEPS,
            "runs": runs, "plans": plans}


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
    return lines + ["", _MEANING, "", *_render_planner_tp(res.get("planner"))]


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _render_planner_tp(res: Mapping[str, Any] | None) -> list[str]:
    """The planner's tp prediction: measured / tp cost model / rehearsal per layout, and pp=2 x tp=2
    against pp=4 each way (a section run before this part existed has none)."""
    if not res:
        return []
    runs = {r["layout"]: r for r in res["runs"]}
    plans = {p["plan"]: p for p in res["plans"]}
    measured = {k: r.get("step_time_s") if r.get("status") == "ok" else None for k, r in runs.items()}
    model = {"pp2xtp2": plans["pp2xtp2"].get("step_s"), "pp4": plans["pp4"].get("step_s")}
    rehearsed = {"pp2xtp2": plans["pp2xtp2-rehearsed"].get("step_s"), "pp4": model["pp4"]}  # pp4: no tp, no FSDP
    failed = [f"{k}: {r['error']}" for k, r in {**runs, **plans}.items() if r.get("status") != "ok"]
    loaded = {k: star({"under_load": any(r.get("under_load") for r in [runs[k], *plans.values()]
                                         if r.get("layout") == k)}) for k in runs}
    lines = ["### The planner's tp prediction: costed by rehearsal, by the tp cost model, and measured", "",
             "The tiny built-in transformer (`" + " ".join(res["model"]) + "`) at pp=2 x tp=2 (`"
             + " ".join(res["layouts"]["pp2xtp2"]) + "`) and pp=4 (`" + " ".join(res["layouts"]["pp4"])
             + f"`), 4 ranks each. Measured: `summary.json`'s `step_time_s` of a {res['steps']}-step real run. "
               "Planned: `python -m runner.plan` with `" + " ".join(res["plan_keys"]) + "` (the link and runtime "
               "fixed: no calibration, no probes; `plan.schedules=[1f1b]` keeps one candidate per split), the 1F1B "
               "m=4 candidate at the run's split; pp=2 x tp=2 planned twice, by the tp cost model and with "
               "`plan.rehearse=true` (pp=4 has no tp or FSDP: the model costs it either way).", "",
             "| layout | measured (s) | planned, tp cost model (s) | / measured | planned, rehearsal (s) "
             "| / measured |",
             "|---|---|---|---|---|---|"]
    for k in ("pp2xtp2", "pp4"):
        shown = num(rehearsed[k]) if k == "pp2xtp2" else f"({num(rehearsed[k])}: not rehearsed)"
        lines.append(f"| {k}{loaded[k]} | {num(measured[k])} | {num(model[k])} | "
                     f"{num(_ratio(model[k], measured[k]), '.2f')} | {shown} "
                     f"| {num(_ratio(rehearsed[k], measured[k]), '.2f')} |")
    each = {name: _ratio(v["pp2xtp2"], v["pp4"]) for name, v in
            (("measured", measured), ("model", model), ("rehearsal", rehearsed))}
    lines += [f"| pp2xtp2 / pp4 | {num(each['measured'], '.2f')} | {num(each['model'], '.2f')} | "
              f"| {num(each['rehearsal'], '.2f')} | |", ""]
    if failed:
        lines += ["Failed: " + "; ".join(failed) + ".", ""]
    if None not in each.values():
        lines += [_ranking(each) + _took(plans["pp2xtp2-rehearsed"], plans["pp2xtp2"]), ""]
    within = plans["pp2xtp2-rehearsed"].get("model_step_s")
    if within is not None and model["pp2xtp2"]:
        lines += [f"The `plan.rehearse=true` plan predicts the same candidate by the tp cost model first: "
                  f"{num(within)} s, {within / model['pp2xtp2']:.2f}x the separate plan's {num(model['pp2xtp2'])} s; "
                  "the two differ only in when the children were timed (`plan.repeats=1`, in each plan's own "
                  "process).", ""]
    return lines


def _ranking(each: Mapping[str, float]) -> str:
    """Which way round each ranks the layouts, in words from the numbers."""
    def way(ratio: float) -> str:
        return f"{ratio:.2f}x slower than pp=4" if ratio >= 1 else f"{1 / ratio:.2f}x faster than pp=4"

    agree = {k: (each[k] > 1) == (each["measured"] > 1) for k in ("model", "rehearsal")}
    return (f"The runs measured pp=2 x tp=2 {way(each['measured'])}; the tp cost model plans it {way(each['model'])} "
            f"({'the right' if agree['model'] else 'the wrong'} way round), the rehearsal {way(each['rehearsal'])} "
            f"({'the right' if agree['rehearsal'] else 'the wrong'} way round). ")


def _took(rehearsed: Mapping[str, Any], modelled: Mapping[str, Any]) -> str:
    return (f"The `plan.rehearse=true` plan took {num(rehearsed.get('wall_s'), '.0f')} s (its rehearsals run every "
            f"pipeline rank's real step), the tp cost model's {num(modelled.get('wall_s'), '.0f')} s.")


# How to read the table (the same words whatever the numbers: the ratios say how much).
_MEANING = (
    "How to read it: a rehearsed rank computes alone, with every peer answered at once, so its actions hold no "
    "waiting and no communication; the composed step adds the messages between stages and the tp/dp collectives "
    "on the link's model, serially. On CPU over loopback gloo the real ranks also share two cores (a rehearsed "
    "rank has them to itself, one thread each way), and tp's all-reduces inside every block's actions move through "
    "memory copies on the cores that compute, which the default link does not model. On GPUs each rank owns its "
    "device and the link is set from `plan.comm_*`.")


SECTION = Section("rehearsal", rehearsal_vs_runs, render, ranks=_ranks)
