"""Synthesized schedules against the built-ins: ``python -m runner.plan plan.synthesize=true`` on
a model with a heavy last stage and one with equal stages, then the fastest synthesized schedule
against every built-in schedule's best plan, in alternating runs."""

from __future__ import annotations

import os
import re
from typing import Any, Mapping, Sequence

from bench.common import MIB, SCHEDULES, median
from bench.markdown import meta_line, num
from bench.runs import Context, plan_label, read_run, run_cli, run_plan, steady_s
from bench.section import Page, Section

# A large-vocabulary head (a last stage 2-3x the others) and equal stages (8 blocks of width 128, a
# small head).
SYNTH_MODELS = {
    "heavy-last": ["model.dim=64", "model.n_layers=6", "data.vocab_size=8192", "train.batch_size=32"],
    "equal": ["model.dim=128", "model.n_layers=8", "train.seq_len=64", "train.batch_size=32"],
}
QUICK_SYNTH = {"heavy-last": ["model.dim=32", "model.n_layers=2", "data.vocab_size=1024", "train.seq_len=16",
                              "train.batch_size=8"]}


def _synthesis_configs(plan: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The fastest synthesized candidate that fits, then each built-in schedule's fastest (any
    microbatch count, stages per rank and split the plan tried)."""
    configs = []
    for name in ["synthesized", *SCHEDULES]:
        best = next((c for c in plan if c["schedule"] == name and c["valid"] and c["fits_memory"]), None)
        if best is not None:
            configs.append({"label": plan_label(best), "schedule": name, "overrides": best["overrides"],
                            "predicted_s": best["predicted_step_time_s"],
                            "peak_activation_bytes": max(best["peak_activation_bytes"])})
    return configs


def _synthesis_model(ctx: Context, name: str, model: Sequence[str], pp: int) -> dict[str, Any]:
    a = ctx.args
    work = ctx.work / f"synthesis-{name}-pp{pp}"
    microbatches = [2, 4] if a.quick else [4, 8]
    plan = run_plan(ctx, work / "plan", model, microbatches, f"parallel.pp={pp}", "plan.synthesize=true")
    if "error" in plan:
        return {"error": plan["error"]}
    configs = _synthesis_configs(plan)
    if not configs or configs[0]["schedule"] != "synthesized":
        return {"error": "the plan has no synthesized candidate that fits", "configs": configs}
    common = [*model, f"parallel.pp={pp}", f"train.steps={a.synthesis_steps}", "profile.enabled=false",
              "profile.wait=1", "profile.warmup=0", f"profile.active={a.synthesis_steps - 1}"]
    for r in range(a.synthesis_rounds):
        # Alternating: every config once per round, the order rotated so none always runs first.
        for i in range(len(configs)):
            config = configs[(i + r) % len(configs)]
            # A label's "=" and "," would make hydra.run.dir=<dir> a key and a list.
            run_dir = work / f"round{r}" / re.sub(r"[^\w.-]+", "_", config["label"])
            done = run_cli(ctx, *common, *config["overrides"], f"hydra.run.dir={run_dir}")
            run = ctx.mark(read_run(run_dir, done))
            config.setdefault("runs", []).append({**run, "steady_s": steady_s(run)})
        print(f"[bench] synthesis {name} pp={pp} round {r + 1}/{a.synthesis_rounds}", flush=True)
    return {"model": list(model), "pp": pp, "steps": a.synthesis_steps, "microbatches": microbatches,
            "configs": configs}


def synthesis(ctx: Context) -> dict[str, Any]:
    """``python -m runner.plan plan.synthesize=true`` on a model with a heavy last stage and one with
    equal stages, at pp=2 (and pp=4 on a host with 4 cores or more), then the fastest synthesized
    schedule against every built-in schedule's best plan, in alternating runs."""
    models = QUICK_SYNTH if ctx.args.quick else SYNTH_MODELS
    pps = [2] + ([4] if (os.cpu_count() or 1) >= 4 and not ctx.args.quick else [])
    return {"cases": [{"name": name, **_synthesis_model(ctx, name, model, pp)}
                      for name, model in models.items() for pp in pps]}


def render(data: Mapping[str, Any], page: Page) -> list[str]:
    lines = ["## Synthesized schedules against the built-ins", "", meta_line(data["meta"]), "",
             "`python -m runner.plan plan.synthesize=true` (no memory limit) on each model, then the fastest "
             "synthesized schedule that plan found and each built-in schedule at its own best planned layout "
             "(microbatches, stages per rank, split), run in alternating rounds (every configuration once per "
             "round, the order rotated). *Ratio to synthesized*: a configuration's step over the synthesized "
             "schedule's in the same round, median and min-max over rounds (above 1: the synthesized one is "
             "faster); *predicted* is the plan's ratio. Peak activations: the plan's in-flight bytes per rank.", ""]
    for case in data["results"]["cases"]:
        lines += [f"### {case['name']}, pp={case.get('pp')}: `{' '.join(case.get('model', []))}`", ""]
        if "error" in case:
            lines += [f"Not measured: {case['error']}.", ""]
            continue
        configs = case["configs"]
        synth = configs[0]
        lines += ["| configuration | predicted (ms) | measured (ms) | predicted / measured | ratio to synthesized "
                  "(min-max) | predicted ratio | peak activations (MiB) |", "|---|---|---|---|---|---|---|"]
        wins, losses = [], []
        for c in configs:
            steps = [r.get("steady_s") or r.get("step_time_s") for r in c.get("runs", [])]
            own = [(s, t.get("steady_s") or t.get("step_time_s")) for s, t in zip(steps, synth.get("runs", []))]
            ratios = [s / t for s, t in own if s and t]
            measured = median([s for s in steps if s])
            ratio = median(ratios)
            spread = f" ({min(ratios):.3f}-{max(ratios):.3f})" if ratios else ""
            lines.append(f"| {c['label']}{'*' if any(r.get('under_load') for r in c.get('runs', [])) else ''} | "
                         f"{c['predicted_s'] * 1e3:.2f} | {num(measured and measured * 1e3, '.2f')} | "
                         f"{num(measured and c['predicted_s'] / measured)} | {num(ratio)}{spread} | "
                         f"{c['predicted_s'] / synth['predicted_s']:.3f} | {c['peak_activation_bytes'] / MIB:.1f} |")
            if c is not synth and ratios:
                (wins if min(ratios) > 1 else losses if max(ratios) < 1 else []).append(c["label"])
        others = len(configs) - 1
        lines += ["", f"The synthesized schedule was faster than {len(wins)} of {others} built-ins in every round"
                  + (f", slower than {', '.join(losses)} in every round" if losses else "")
                  + (f"; against the other {others - len(wins) - len(losses)} the rounds disagree (within the "
                     "run-to-run spread)" if others - len(wins) - len(losses) else "") + ".", ""]
    return lines


SECTION = Section("synthesis", synthesis, render)
