"""Planner: predicted against measured. Per model size, rounds of ``python -m runner.plan`` at pp=2
followed by real runs of every schedule x m; the renderer says how close the predictions come,
where the error sits, and whether they order the schedules as the runs do."""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from bench.common import MODEL, SCHEDULES, median
from bench.markdown import meta_line, num
from bench.runs import Context, plan_label, run_plan, steady_s, sweep_pp
from bench.section import Page, Section

# Planner validation over model sizes: name -> (model overrides, microbatch counts, steps per run).
# Actions of ~0.2-0.6 ms (the smoke model), 1-3 ms (issue 19's model at the default width) and
# 30-250 ms (MODEL): the planner must hold at each, not only where compute dwarfs the runtime.
PLANNER_SIZES = {
    "smoke": (["model.dim=32", "model.n_layers=2", "train.seq_len=16", "train.batch_size=8"], [2, 4], 30),
    "small": (["model.n_layers=8", "train.batch_size=32"], [2, 4], 20),
    "benchmark": (MODEL, [4, 8], 8),
}
QUICK_SIZES = {"smoke": PLANNER_SIZES["smoke"]}  # --quick: does the section run at all (minutes)


def _ranks_agree(pairs: Sequence[tuple[float, float]]) -> float | None:
    """Spearman's rank correlation of (predicted, measured) pairs (no ties expected)."""
    if len(pairs) < 3:
        return None

    def ranks(xs):
        order = sorted(range(len(xs)), key=lambda i: xs[i])
        out = [0] * len(xs)
        for r, i in enumerate(order):
            out[i] = r
        return out
    rp, rm = ranks([p for p, _ in pairs]), ranks([m for _, m in pairs])
    n = len(pairs)
    return 1 - 6 * sum((a - b) ** 2 for a, b in zip(rp, rm)) / (n * (n * n - 1))


def _plan_round(ctx: Context, out: Path, microbatches: Sequence[int], model: Sequence[str] = MODEL) -> dict[str, Any]:
    from runner.pipeline.schedule import default_stages_per_rank

    started = time.time()
    plan = run_plan(ctx, out, model, microbatches)
    if "error" in plan:
        return plan
    # The candidates a plain run of each schedule uses (its default stages per rank and split).
    predicted = {f"{c['schedule']}/{c['microbatches']}": {
        "step_s": c["predicted_step_time_s"], "bubble": c["bubble"], "after_s": c.get("after_pipeline_s"),
        "costs": c.get("stage_costs_s")}
        for c in plan if c["valid"] and c["stages_per_rank"] == default_stages_per_rank(c["schedule"])
        and c.get("split_points") is None}
    recommended = next((c for c in plan if c.get("recommended")), None)
    fit = out / "fit.json"
    return {"predicted": predicted, "calibration": json.loads((out / "calibration.json").read_text()),
            "fit": json.loads(fit.read_text()) if fit.exists() else None, "plan_s": time.time() - started,
            "recommended": None if recommended is None else plan_label(recommended),
            "tied": [plan_label(c) for c in plan if c.get("tie")]}


def _planner_size(ctx: Context, name: str, model: Sequence[str], microbatches: list[int], steps: int
                  ) -> dict[str, Any]:
    rounds = []
    for r in range(ctx.args.planner_rounds):
        started = time.time()
        work = ctx.work / f"planner-{name}-{r}"
        plan = _plan_round(ctx, work / "plan", microbatches, model)
        if "error" in plan:
            return {"error": plan["error"]}
        runs = [ctx.mark(run) for run in sweep_pp(ctx, 2, microbatches, steps, model=model, sweep=work / "runs")]
        measured = {f"{run['schedule']}/{run['m']}": {
            "step_s": steady_s(run), "bubble": run.get("bubble"), "under_load": run.get("under_load"),
            "replayed_s": run.get("simulated_step_s"), "pipeline_s": run.get("pipeline_step_s"),
            "costs": run.get("mean_costs_s"),
            **({} if run["status"] == "ok" else {"error": run.get("error")})} for run in runs}
        rounds.append({**plan, "measured": measured})
        print(f"[bench] planner {name} round {r + 1}/{ctx.args.planner_rounds}: {time.time() - started:.0f} s",
              flush=True)
    return {"model": list(model), "pp": 2, "steps": steps, "microbatches": microbatches, "rounds": rounds}


def planner(ctx: Context) -> dict[str, Any]:
    """Per model size: rounds of ``python -m runner.plan`` at pp=2 (calibrated on this host, child
    costs timed in-process), then every schedule x m run for real. Rounds spread each schedule's
    runs over the section, so that a slow spell of this shared machine does not land on one
    schedule only."""
    a = ctx.args
    sizes = QUICK_SIZES if a.quick else {k: v for k, v in PLANNER_SIZES.items() if k in a.planner_sizes}
    out = {}
    for name, (model, microbatches, steps) in sizes.items():
        if name == "benchmark":
            microbatches = a.planner_microbatches or microbatches
        out[name] = _planner_size(ctx, name, model, microbatches, a.planner_steps or steps)
    return {"sizes": out}


def planner_rows(res: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Per (schedule, m): the medians over rounds of predicted and measured step times, the
    measured range, and the replay of each run's own costs."""
    rows = []
    for name in SCHEDULES:
        for m in res["microbatches"]:
            key = f"{name}/{m}"
            pred = [r["predicted"][key] for r in res["rounds"] if key in r["predicted"]]
            meas = [r["measured"][key] for r in res["rounds"] if (r["measured"].get(key) or {}).get("step_s")]
            if not pred or not meas:
                continue
            steps = [x["step_s"] for x in meas]
            replayed = [x["replayed_s"] / x["step_s"] for x in meas if x.get("replayed_s")]
            predictions = [x["step_s"] for x in pred]
            rows.append({"schedule": name, "m": m, "predicted_s": statistics.median(predictions),
                         "predicted_spread": max(predictions) / min(predictions) - 1,
                         "measured_s": statistics.median(steps), "measured_min": min(steps),
                         "measured_max": max(steps),
                         "predicted_bubble": statistics.median(x["bubble"] for x in pred),
                         "measured_bubble": median([x["bubble"] for x in meas if x.get("bubble") is not None]),
                         "replayed": median(replayed)})
    return rows


def separated_pairs(rows: Sequence[Mapping[str, Any]]) -> tuple[int, int, list[str]]:
    """Pairs of schedules whose measured ranges over the rounds do not overlap, and how many of
    them the prediction orders the same way (with the ones it does not)."""
    agree, total, wrong = 0, 0, []
    for i, a in enumerate(rows):
        for b in rows[i + 1:]:
            fast, slow = (a, b) if a["measured_max"] < b["measured_min"] else (b, a)
            if fast["measured_max"] >= slow["measured_min"]:
                continue  # within the run-to-run spread: no measured order to hold the planner to
            total += 1
            if fast["predicted_s"] < slow["predicted_s"]:
                agree += 1
            else:
                wrong.append(f"{fast['schedule']} < {slow['schedule']}")
    return agree, total, wrong


def _ratio_median(pairs: Iterable[tuple[float | None, float | None]]) -> float | None:
    return median([p / m for p, m in pairs if p is not None and m])


def _attribution(res: Mapping[str, Any]) -> dict[str, Any]:
    """Where a size's error sits, as medians over every (round, configuration): the predicted
    pipeline over the run's ``pipeline_step_s``, the predicted rest of the step (all-reduce, clip,
    optimizer) over the run's, and each recorded action's mean cost over the planned one, forwards
    apart from backwards (B, I and W)."""
    pipe, after, cost = [], [], {"F": [], "B": []}
    for r in res["rounds"]:
        for key, p in r["predicted"].items():
            m = r["measured"].get(key) or {}
            if not m.get("step_s") or p.get("after_s") is None:
                continue
            if m.get("pipeline_s"):
                pipe.append((p["step_s"] - p["after_s"], m["pipeline_s"]))
                after.append((p["after_s"], m["step_s"] - m["pipeline_s"]))
            for action, seconds in (m.get("costs") or {}).items():
                planned = (p.get("costs") or {}).get(action)
                if planned:
                    cost["F" if action.endswith("F") else "B"].append((seconds, planned))
    return {"pipeline": _ratio_median(pipe), "after": _ratio_median(after),
            "cost_f": _ratio_median(cost["F"]), "cost_b": _ratio_median(cost["B"])}


def _recommendations(res: Mapping[str, Any]) -> str:
    """The recommended candidate of each round, with how many rounds named it and declared a tie."""
    picks: dict[str, list[bool]] = {}
    for r in res["rounds"]:
        if r.get("recommended"):
            picks.setdefault(r["recommended"], []).append(bool(r.get("tied")))
    if not picks:
        return "not recorded"
    return ", ".join(f"{label} x{len(ties)}" + (f" ({sum(ties)} as a tie)" if any(ties) else "")
                     for label, ties in sorted(picks.items(), key=lambda kv: -len(kv[1])))


def _probed(res: Mapping[str, Any]) -> set[str]:
    """The configurations (``schedule/m``) the plans probed: their own runs fitted the model."""
    return {p["label"].replace(" m=", "/") for r in res["rounds"] for p in (r.get("fit") or {}).get("probes", [])}


def _planner_summary(sizes: Mapping[str, Mapping[str, Any]]) -> list[str]:
    lines = ["| size | model | median F (ms) | within 10% | median error | bias (median signed) | median error, "
             "not probed | pipeline "
             "predicted / measured | rest of step predicted / measured | action cost run / planned, F | B | "
             "recommended per round |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, res in sizes.items():
        if "error" in res:
            lines.append(f"| {name} | failed: {res['error']} ||||||||||")
            continue
        rows = planner_rows(res)
        errors = [r["predicted_s"] / r["measured_s"] - 1 for r in rows]
        probed = _probed(res)
        unprobed = [abs(e) for r, e in zip(rows, errors) if f"{r['schedule']}/{r['m']}" not in probed]
        forwards = [v for r in res["rounds"] for m in r["measured"].values() for k, v in (m.get("costs") or {}).items()
                    if k.endswith("F")]
        att = _attribution(res)
        forward_ms = median(forwards) * 1e3 if forwards else None
        lines.append(f"| {name} | `{' '.join(res['model'])}` | {num(forward_ms, '.2f')}"
                     f" | {sum(abs(e) <= 0.10 for e in errors)} of {len(errors)} | "
                     f"{num(median([abs(e) for e in errors]), '.1%')} | {num(median(errors), '+.1%')} | "
                     f"{num(median(unprobed), '.1%') if probed else 'no probes'} | "
                     f"{num(att['pipeline'])} | {num(att['after'])} | {num(att['cost_f'])} | "
                     f"{num(att['cost_b'])} | {_recommendations(res)} |")
    return lines + [""]


def render(data: Mapping[str, Any], page: Page) -> list[str]:
    res = data["results"]
    lines = ["## Planner: predicted vs measured", "", meta_line(data["meta"]), ""]
    if "error" in res:
        return lines + [f"The planner failed: {res['error']}", ""]
    sizes = res["sizes"] if "sizes" in res else {"benchmark": res}  # results from before the sizes
    if len(sizes) > 1:
        lines += ["Per model size (pp=2; medians over rounds and configurations). *Pipeline* compares the predicted "
                  "pipeline with the run's `pipeline_step_s`, *rest of step* the predicted all-reduce + clip + "
                  "optimizer with the run's `step_time_s - pipeline_step_s`, and *action cost* each recorded "
                  "action's mean (the run's `mean_costs_s`) with the planned one: where an error comes from. "
                  "*Recommended per round*: the plan's recommendation each round, and how often it was declared "
                  "a tie (`plan.tie_tolerance`). Each plan fits its cost model to probe runs of four layouts "
                  "(`runner.plan.probe`; the benchmark's runs of those layouts are separate runs, after the plan); "
                  "*not probed* leaves those configurations out.", "", *_planner_summary(sizes)]
    for name, size in sizes.items():
        if len(sizes) > 1:
            lines += [f"### {name}", ""]
        if "error" in size:
            lines += [f"The planner failed: {size['error']}", ""]
            continue
        lines += _render_planner_size(size)
    return lines


def _render_planner_size(res: Mapping[str, Any]) -> list[str]:
    lines = []
    rows = planner_rows(res)
    cals = [r["calibration"] for r in res["rounds"]]
    n = len(res["rounds"])

    def cal_range(key: str, scale: float, fmt: str) -> str:
        return _span([c[key] * scale for c in cals], fmt, "-")

    lines += ["`python -m runner.plan` on the model `" + " ".join(res["model"]) + "` at pp=2, against real runs "
              f"of every schedule (its default stages per rank) x m, {res['steps']} steps each (steady median: over "
              "the last two thirds of the steps; in results from before the model sizes, all but the first). "
              f"{n} rounds, each a fresh plan (calibration and child timings) followed by all the runs; the "
              "numbers are medians over rounds, and the measured range is min-max over rounds. Calibrated per "
              f"round: message {cal_range('latency_s', 1e6, '.0f')} us + bytes / "
              f"{cal_range('bandwidth', 1e-9, '.2f')} GB/s"
              + f", +{cal_range('busy_delay_s', 1e6, '.0f')} us while its sender computes"
              + f", runtime overhead {cal_range('action_overhead_s', 1e6, '.0f')} us per action, co-running "
              f"compute x{cal_range('corunning_slowdown', 1, '.2f')}"
              + f" (action times varying by {cal_range('action_jitter', 100, '.0f')}%)"
              + ". " + _fit_ranges(res["rounds"])
              + "*Replayed* is the simulator fed each run's own recorded per-action costs (the run's "
              "`bubble.simulated_step_s`), "
              "over that run's step: the simulation's share of the error, apart from the cost estimates.", "",
              "| schedule | m | predicted (ms) | measured (ms) | measured range | predicted / measured | replayed / "
              "measured | bubble predicted | measured |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda x: (x["m"], SCHEDULES.index(x["schedule"]))):
        lines.append(f"| {r['schedule']} | {r['m']} | {r['predicted_s'] * 1e3:.2f} | {r['measured_s'] * 1e3:.2f} | "
                     f"{r['measured_min'] * 1e3:.2f}-{r['measured_max'] * 1e3:.2f} | "
                     f"{r['predicted_s'] / r['measured_s']:.3f} | "
                     f"{num(r['replayed'])} | {num(r['predicted_bubble'])} | {num(r['measured_bubble'])} |")
    signed = [r["predicted_s"] / r["measured_s"] - 1 for r in rows]
    errors = [abs(e) for e in signed]
    if errors:
        noise = statistics.median(r["measured_max"] / r["measured_min"] - 1 for r in rows)
        lines += ["", f"Within 10% of the measured step: {sum(e <= 0.10 for e in errors)} of {len(errors)} "
                  f"(median error {statistics.median(errors):.1%}, worst {max(errors):.1%}, median signed "
                  f"{statistics.median(signed):+.1%}); a configuration's "
                  f"own runs differ by {noise:.1%} (median over configurations, slowest over fastest round)."
                  + (f" Recommended per round: {_recommendations(res)}."
                     if any("recommended" in r for r in res["rounds"]) else "")]
        lines += _between_rounds(rows) + _probe_noise(res["rounds"])
    for m in sorted({r["m"] for r in rows}):
        at_m = [r for r in rows if r["m"] == m]
        rho = _ranks_agree([(r["predicted_s"], r["measured_s"]) for r in at_m])
        agree, total, wrong = separated_pairs(at_m)
        best_p = min(at_m, key=lambda r: r["predicted_s"])
        best_m = min(at_m, key=lambda r: r["measured_s"])
        spread = max(r["measured_s"] for r in at_m) / best_m["measured_s"] - 1
        lines.append(f"- m={m}: the measured schedules differ by {spread:.0%} fastest to slowest. Of the "
                     f"{total} pairs whose measured ranges do not overlap, the prediction orders {agree} the same way"
                     + (f" (not: {', '.join(wrong)})" if wrong else "") + f"; rank correlation over all "
                     f"{len(at_m)}: {num(rho, '.2f')}. Fastest predicted: {best_p['schedule']}, measured "
                     f"{best_p['measured_s'] / best_m['measured_s'] - 1:+.1%} against the measured fastest "
                     f"({best_m['schedule']}).")
    return lines + [""]


def _fit_ranges(rounds: Sequence[Mapping[str, Any]]) -> str:
    """The cost model each round's plan fitted to its probes, as ranges over rounds."""
    fits = [r["fit"] for r in rounds if r.get("fit")]
    if not fits:
        return "No probes (results from before them: the child timings and the calibration alone). "

    def span(key: str, scale: float, fmt: str) -> str:
        return _span([f[key] * scale for f in fits], fmt, " to ")

    probes = ", ".join(p["label"] for p in fits[0]["probes"])
    plan_s = [r["plan_s"] for r in rounds if r.get("plan_s")]
    took = f" Each plan took {_span(plan_s, '.0f', '-')} s, probes included." if plan_s else ""
    return (f"Fitted per round to its probes ({probes}): forwards x{span('forward_scale', 1, '.2f')} and backwards "
            f"x{span('backward_scale', 1, '.2f')} their timings, {span('gap_s', 1e6, '+.0f')} us per action, the "
            f"rest of the step x{span('rest_scale', 1, '.2f')}.{took} ")


def _span(values: Sequence[float], fmt: str, between: str) -> str:
    """min-max of ``values`` as formatted, or the one value where both read the same."""
    low, high = f"{min(values):{fmt}}", f"{max(values):{fmt}}"
    return low if low == high else f"{low}{between}{high}"


def _probe_noise(rounds: Sequence[Mapping[str, Any]]) -> list[str]:
    """A plan's probe runs next to the benchmark's runs of the same configuration, minutes later:
    how much two runs of one configuration differ, which no prediction fitted to probes beats."""
    pairs = [(p["measured_step_s"], (r["measured"].get(p["label"].replace(" m=", "/")) or {}).get("step_s"))
             for r in rounds for p in (r.get("fit") or {}).get("probes", [])]
    diffs = sorted(abs(probe / run - 1) for probe, run in pairs if run)
    if not diffs:
        return []
    return [f"- Two runs of one configuration minutes apart (a plan's probe, then the benchmark's run): they differ "
            f"by {statistics.median(diffs):.1%} (median over {len(diffs)} pairs; {diffs[-1]:.0%} at most): the noise "
            "a prediction fitted to probes carries into each round."]


def _between_rounds(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """How much the plans themselves move between rounds, and how much of a run the replay of its
    own action costs accounts for."""
    lines = []
    if len(rows) and any(r["predicted_spread"] for r in rows):
        moved = statistics.median(r["predicted_spread"] for r in rows)
        lines.append(f"- Successive plans of one configuration differ by {moved:.1%} (median over configurations, "
                     "highest over lowest prediction; each round's plan times the children and calibrates anew).")
    replayed = [r["replayed"] for r in rows if r.get("replayed") is not None]
    if replayed:
        short = ("; every replay falls short of its run (the time a run spends between its actions, which the "
                 "replay does not see and the planner's fitted gap per action stands for)" if max(replayed) < 1 else "")
        lines.append(f"- Replayed / measured: x{min(replayed):.2f}-x{max(replayed):.2f} over configurations{short}.")
    return lines


SECTION = Section("planner", planner, render)
