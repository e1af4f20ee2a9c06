"""The optimizer step without the barrier, measured: zbh2 at pp=4 on this host's CPU with
``train.optimizer_sync=barrier``, ``post_validate`` and ``deferred``, and the order the search
without the barrier synthesizes at twice 1F1B's memory for the zbh2 barrier run's own action times
(``schedule=csv``) with ``barrier`` and ``deferred``, in alternating rounds; each run's steady step
time and its steady-state bubble over the recorded steps (``bubble.steady``), against the
simulator's steady step without the barrier for the order as run (``steady_step``), its floor
(``compute_floor``) and, for zbh2, the paper's closed-form bubble (``zb_paper.zbh2_bubble``). The
clip is off (``train.grad_clip=0``): no step is rolled back, so the ratios show the overlap alone
(a rollback's cost: docs/optimizer-sync.md)."""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any, Mapping

from bench.common import MODEL, compose, steady
from bench.markdown import meta_line, star
from bench.runs import Context, error_line, run_cli
from bench.section import Page, Section
from bench.sections.zb_paper import zbh2_bubble

MODES = ["barrier", "post_validate", "deferred"]
# The synthesized order with and without the barrier (post_validate, which keeps the wait, only for zbh2).
SYNTH_MODES = ["barrier", "deferred"]
LAYOUT = ["schedule=zbh2", "parallel.pp=4", "parallel.microbatches=8", "train.grad_clip=0", *MODEL]
PP, MICROBATCHES = 4, 8


def _read(run_dir: Path, done) -> dict[str, Any]:
    summary_file = run_dir / "summary.json"
    if not summary_file.is_file():
        return {"error": error_line(run_dir, done)}
    summary = json.loads(summary_file.read_text())
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    bubble = summary["bubble"]
    return {"steady_s": steady([m["step_time_s"] for m in lines], skip=2), "steady": bubble.get("steady"),
            "bubble_per_step": bubble["mean"], "simulated_barrier_step_s": bubble["simulated_step_s"],
            "costs_s": bubble.get("mean_costs_s"), "post_validate": summary.get("post_validate")}


def _synthesize(ctx: Context, costs_s: Mapping[str, float]) -> dict[str, Any]:
    """The barrier-free search at twice 1F1B's memory on a zbh2 barrier run's mean action times, as
    ``python -m runner.plan plan.costs=<file> plan.barrier=false plan.memory_limit=2x1f1b`` plans
    a costs file (M_W / M_B measured on the model, messages at 0 as the run's simulator takes
    them); its CSV, the built-in orders' and the best round schedule's steps by the same measure."""
    import torch

    from runner.pipeline.simulate import peak_in_flight, simulated_step
    from runner.plan.from_costs import given_problem, plan_from_costs
    from runner.plan.given import GivenCosts
    from runner.plan.rounds import round_schedule, round_variants
    from runner.plan.weight_memory import measure_weight_grad_fraction

    cfg = compose(LAYOUT)
    fraction = measure_weight_grad_fraction(cfg, cfg.train.batch_size // MICROBATCHES, torch.device("cpu"))
    per = [[costs_s.get(f"{s}{k}", 0.0) for s in range(PP)] for k in "FIW"]
    given = GivenCosts("zbh2 barrier #0", PP, MICROBATCHES, *per, 0.0, fraction, "2x1f1b", None)
    out = ctx.work / "sync-plan"
    out.mkdir(parents=True, exist_ok=True)
    candidates, _ = plan_from_costs(given, out, budget=200, seed=0, tie_tolerance=0.05, barrier=False)
    found = next(c for c in candidates if c.schedule == "synthesized")
    if not found.valid:
        return {"error": found.reason}
    problem = given_problem(given, barrier=False)
    rounds = []
    for variant in round_variants(problem):
        order = round_schedule(problem, variant)
        if order is not None and max(peak_in_flight(order, problem.stage_bytes, fraction).values()) \
                <= problem.memory_limit * (1 + 1e-9):
            rounds.append((simulated_step(order, problem.costs, num_stages=PP, barrier=False), variant.describe()))
    csv = Path(found.search["csv"])
    return {"csv": str(csv), "order": csv.read_text(), "origin": found.search["origin"],
            "evaluated": found.search["evaluated"], "seconds": found.search["seconds"],
            "weight_grad_fraction": fraction, "costs_s": dict(costs_s), "memory_limit": "2x1f1b",
            "peak_activation_mb": found.peak_activation_mb, "floor_s": found.lower_bound_s,
            "spans_s": {c.schedule: c.predicted_step_time_s for c in candidates if c.valid},
            "best_round": dict(zip(("span_s", "rounds"), min(rounds))) if rounds else None}


def _overrides(schedule: str, synth: Mapping[str, Any]) -> list[str]:
    if schedule == "zbh2":
        return LAYOUT
    return ["schedule=csv", f"schedule.csv={synth['csv']}", "parallel.stages_per_rank=null", *LAYOUT[1:]]


def optimizer_sync(ctx: Context) -> dict[str, Any]:
    steps = ctx.args.sync_steps
    # The recorder over steps 3.. (the first includes shape inference); profiling itself off.
    common = [f"train.steps={steps}", "profile.enabled=false", "profile.wait=2", "profile.warmup=0",
              f"profile.active={steps - 2}"]
    pairs = [("zbh2", m) for m in MODES] + [("synthesized", m) for m in SYNTH_MODES]
    rounds: list[dict[str, Any]] = []
    synth: dict[str, Any] = {}
    for repeat in range(ctx.args.sync_repeats):
        t0, runs = time.time(), {"zbh2": {}, "synthesized": {}}
        for schedule, mode in pairs if repeat % 2 == 0 else reversed(pairs):  # a drifting load favours none
            if schedule == "synthesized" and not synth:  # from round 0's zbh2 barrier run, which ran first
                base = runs["zbh2"].get("barrier", {})
                synth = _synthesize(ctx, base["costs_s"]) if base.get("costs_s") else \
                    {"error": f"no costs: the zbh2 barrier run failed ({base.get('error')})"}
            if "error" in synth and schedule == "synthesized":
                runs[schedule][mode] = {"error": f"no synthesized schedule: {synth['error']}"}
                continue
            run_dir = ctx.work / f"sync-{schedule}-{mode}-{repeat}"
            runs[schedule][mode] = _read(run_dir, run_cli(ctx, *_overrides(schedule, synth), *common,
                                                          f"train.optimizer_sync={mode}", f"hydra.run.dir={run_dir}"))
            print(f"[bench] optimizer_sync {schedule} {mode} #{repeat}: "
                  f"{runs[schedule][mode].get('steady_s') or runs[schedule][mode].get('error')}", flush=True)
        rounds.append({"repeat": repeat, "runs": runs, "under_load": ctx.loaded(t0, time.time())})
    return {"layout": LAYOUT, "steps": steps, "rounds": rounds, "synthesized": synth}


def _ms(seconds: float | None) -> str:
    return f"{seconds * 1e3:.0f}" if seconds is not None else "-"


def _formula(costs_s: Mapping[str, float] | None) -> float | None:
    """The paper's ZB-H2 bubble rate (``zbh2_bubble``) for equal stages of the mean F, I and W of
    the stages that pass a gradient back (1..p-1): stage 0's input takes none, so its I is nothing
    and its W the whole backward, which the formula's equal stages do not have."""
    if not costs_s:
        return None
    f, i, w = (statistics.fmean(costs_s.get(f"{s}{k}", 0.0) for s in range(1, PP)) for k in "FIW")
    return zbh2_bubble(PP, MICROBATCHES, f, i, w)


def _rate(x: float) -> str:
    return f"{x:.3f}".replace("-0.000", "0.000")  # a step at its floor, to rounding


def _row(r: Mapping[str, Any], schedule: str, mode: str, base: float | None) -> str:
    run = r["runs"].get(schedule, {}).get(mode) or {"error": "not run"}
    if "error" in run:
        return f"| {r['repeat']}{star(r)} | {schedule} | {mode} | failed: {run['error']} |" + " |" * 10
    st = run.get("steady") or {}
    sim, floor, step = st.get("simulated_step_s"), st.get("floor_s"), st.get("step_s")
    formula = _formula(run.get("costs_s")) if schedule == "zbh2" else None
    return "| " + " | ".join([
        f"{r['repeat']}{star(r)}", schedule, mode, _ms(run["steady_s"]),
        f"{run['steady_s'] / base:.3f}" if base and mode != "barrier" else "1", _ms(step),
        str(st.get("overlapped_steps", "-")), f"{st['mean']:.3f}" if st else "-", _ms(sim), _ms(floor),
        f"{step / sim:.2f}" if step and sim else "-", _rate(1 - floor / step) if step and floor else "-",
        _rate(1 - floor / sim) if sim and floor else "-", "-" if formula is None else _rate(formula)]) + " |"


def render(data: Mapping[str, Any], page: Page) -> list[str]:
    res = data["results"]
    rounds = res["rounds"]
    lines = ["## The optimizer step without the barrier", "", meta_line(data["meta"], rounds), "",
             "zbh2 and a synthesized order at pp=4, m=8 (" + ", ".join(f"`{o}`" for o in res["layout"][3:])
             + f", {res['steps']} steps): zbh2 with `train.optimizer_sync` = `barrier`, `post_validate` and "
             "`deferred`, the synthesized order (below; `schedule=csv`) with `barrier` and `deferred`, in alternating "
             "rounds (* a round under load: on this host the four ranks share 2 cores, so one rank's optimizer and "
             "another's next warm-up compete for them). *step*: median step time after step 2; *vs barrier*: over "
             "the same schedule's `barrier` run of the round; *steady step* and *bubble*: over the recorded steps "
             "3.. (`bubble.steady`: the time between the first and the last recorded step's ends per step, and each "
             "rank's idle share of it, mean over ranks); *overlapped*: recorded steps that began on a rank before "
             "the previous one ended on another; *simulated*: the simulator's steady step without the barrier for "
             "the order as run with the run's own mean action times, and its floor (the busiest rank's compute per "
             "step). The last three columns are the paper's bubble rate, 1 - floor / step: of the *measured* steady "
             "step, of the *simulated* one, and ZB-H2's by the *paper's formula* (its section 2, (p - 1)(F + I - "
             "2W) over m(F+I+W) plus itself, `bench.sections.zb_paper.zbh2_bubble`, for equal stages of the run's "
             "mean F, I and W over stages 1-3, those that pass a gradient back: stage 0's I is nothing and its W the "
             "whole backward; zbh2 rows only).", "",
             "| round | schedule | mode | step (ms) | vs barrier | steady step (ms) | overlapped | bubble | "
             "simulated (ms) | floor (ms) | steady / simulated | bubble: measured | simulated | paper's formula |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rounds:
        for schedule, modes in (("zbh2", MODES), ("synthesized", SYNTH_MODES)):
            base = (r["runs"].get(schedule, {}).get("barrier") or {}).get("steady_s")
            lines += [_row(r, schedule, mode, base) for mode in modes]
    return [*lines, "", *_ratio_lines(rounds), *_synthesized_lines(res.get("synthesized") or {}), ""]


def _ratio_lines(rounds: list[Mapping[str, Any]]) -> list[str]:
    def step(r: Mapping[str, Any], schedule: str, mode: str) -> float | None:
        return (r["runs"].get(schedule, {}).get(mode) or {}).get("steady_s")

    lines = []
    pairs = [(f"zbh2 `{m}` over `barrier`", ("zbh2", m), ("zbh2", "barrier")) for m in MODES[1:]]
    pairs += [("synthesized `deferred` over `barrier`", ("synthesized", "deferred"), ("synthesized", "barrier"))]
    pairs += [(f"synthesized over zbh2, `{m}`", ("synthesized", m), ("zbh2", m)) for m in SYNTH_MODES]
    for label, num, den in pairs:
        vals = [a / b for r in rounds if (a := step(r, *num)) and (b := step(r, *den))]
        if vals:
            lines.append(f"- {label}, step time: " + ", ".join(f"{v:.3f}" for v in vals)
                         + f" (median {statistics.median(vals):.3f}).")
    return lines


def _synthesized_lines(synth: Mapping[str, Any]) -> list[str]:
    if not synth:
        return []
    if "error" in synth:
        return ["", f"The synthesized order: not built ({synth['error']})."]
    spans, costs = synth["spans_s"], synth["costs_s"]
    best_round = synth.get("best_round")
    return ["", "The synthesized order: the search without the barrier (`runner.plan.from_costs.plan_from_costs` "
            "with `barrier=False`, as `python -m runner.plan plan.costs=<file> plan.barrier=false "
            f"plan.memory_limit={synth['memory_limit']}` plans a costs file; budget {synth['evaluated']} orders, seed "
            f"0, {synth['seconds']:.1f} s) on round 0's zbh2 `barrier` run's mean action times (ms: "
            + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in sorted(costs.items()))
            + f"), messages at 0, M_W / M_B = {synth['weight_grad_fraction']:.3f} (measured on the model, "
            f"`runner.plan.weight_memory`), at twice 1F1B's memory (peak in microbatches' activations per rank: "
            + ", ".join(f"{v:g}" for v in synth["peak_activation_mb"]) + f", limit {2 * PP}). It grew from "
            f"{synth['origin']}. Its step by the search's measure (the longest rank's span) on those times: "
            f"{spans['synthesized'] * 1e3:.0f} ms against zbh2's {spans.get('zbh2', 0) * 1e3:.0f} ms, zbh1's "
            f"{spans.get('zbh1', 0) * 1e3:.0f} ms and the floor's {synth['floor_s'] * 1e3:.0f} ms"
            + (f"; the best round schedule alone ({best_round['rounds']}) {best_round['span_s'] * 1e3:.0f} ms"
               if best_round else "") + ". The order as run (`schedule.csv`):", "", "```",
            *synth["order"].strip().splitlines(), "```"]


SECTION = Section("optimizer_sync", optimizer_sync, render, ranks=lambda args: 4)
