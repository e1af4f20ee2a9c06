"""Checkpoint saves in the background: the training loop's time per step with a save every other
step in the foreground (``checkpoint.async_save=false``), in the background (``true``) and without
saves, in alternating runs."""

from __future__ import annotations

import json
import statistics
import time
from typing import Any, Mapping, Sequence

from bench.markdown import meta_line, num, star
from bench.runs import Context, error_line, run_cli
from bench.section import Page, Section

# A step short against its state (4 samples per step): the save is a large share of the loop.
SHAPE = ["model.dim=256", "model.n_layers=8", "train.seq_len=128", "train.batch_size=8", "parallel.pp=2",
         "parallel.microbatches=4", "schedule=1f1b"]
EVERY = 2
CONFIGS = {"none": [], "sync": [f"checkpoint.every={EVERY}"],
           "async": [f"checkpoint.every={EVERY}", "checkpoint.async_save=true"]}


def _loop(run_dir) -> dict[str, Any]:
    """Per step from step 2 on: the step's own time and the seconds the loop waited for saves."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((run_dir / "summary.json").read_text())
    steps = [r["step_time_s"] for r in records if r["step"] > 1]
    blocked = summary.get("checkpoint_blocked_s", [])
    return {"step_s": statistics.median(steps), "blocked_s": blocked,
            "loop_s": (sum(steps) + sum(blocked)) / len(steps)}


def checkpointing(ctx: Context) -> dict[str, Any]:
    """Every config once per repeat, the order reversed on odd repeats."""
    runs = []
    for repeat in range(ctx.args.repeats):
        names = list(CONFIGS) if repeat % 2 == 0 else list(reversed(CONFIGS))
        for name in names:
            run_dir = ctx.work / f"checkpoint-{name}-{repeat}"
            t0 = time.time()
            done = run_cli(ctx, *SHAPE, *CONFIGS[name], f"train.steps={ctx.args.checkpoint_steps}",
                           "profile.enabled=false", f"hydra.run.dir={run_dir}")
            run: dict[str, Any] = {"config": name, "repeat": repeat}
            if (run_dir / "summary.json").is_file():
                run.update(_loop(run_dir))
            else:
                run["error"] = error_line(run_dir, done)
            run["under_load"] = ctx.loaded(t0, time.time())
            runs.append(run)
            print(f"[bench] checkpoint {name} #{repeat}: {run.get('loop_s') or run.get('error')}", flush=True)
    return {"shape": SHAPE, "every": EVERY, "steps": ctx.args.checkpoint_steps, "runs": runs}


def _ratios(runs: Sequence[Mapping[str, Any]], a: str, b: str) -> list[float]:
    by = {(r["config"], r["repeat"]): r for r in runs if r.get("loop_s")}
    return [by[(a, rep)]["loop_s"] / by[(b, rep)]["loop_s"] for (name, rep) in by if name == a and (b, rep) in by]


def _observations(runs: Sequence[Mapping[str, Any]]) -> list[str]:
    """What the numbers say, in sentences built from them: the wait per save, and the step's own time."""
    def median_of(config: str, key: str) -> float | None:
        vals = [v for r in runs if r["config"] == config and r.get(key) for v in
                (r[key] if isinstance(r[key], list) else [r[key]])]
        return statistics.median(vals) if vals else None

    wait_sync, wait_async = median_of("sync", "blocked_s"), median_of("async", "blocked_s")
    step = {c: median_of(c, "step_s") for c in CONFIGS}
    if None in (wait_sync, wait_async, *step.values()):
        return []
    return [f"- The loop waited {wait_async:.3f} s per save in the background against {wait_sync:.3f} s in the "
            f"foreground (medians over the saves), x{wait_async / wait_sync:.2f}.",
            f"- The steps' own median time: {step['none']:.3f} s without saves, {step['sync']:.3f} s with saves in "
            f"the foreground, {step['async']:.3f} s with saves in the background"
            + (": on this host the background writes (and their hashing) share the cores the ranks compute on."
               if step["async"] > 1.1 * max(step["none"], step["sync"]) else ".")]


def render(data: Mapping[str, Any], page: Page) -> list[str]:
    res = data["results"]
    runs = res.get("runs", [])
    lines = ["## Checkpoint saves in the background", "", meta_line(data["meta"], runs), "",
             f"`{' '.join(res.get('shape', []))}`, {res.get('steps')} steps, a save every {res.get('every')} steps "
             "(`checkpoint.every`), profiling off; every config once per repeat, the order reversed on odd "
             "repeats. Loop time per step = (the steps' own times from step 2 on + the seconds the loop waited "
             "for saves, `summary.json`'s `checkpoint_blocked_s`) / steps. With `checkpoint.async_save=true` the "
             "loop waits only for each rank's copy of its state (and for a previous save still running); its "
             "writes share the host's cores with training.", "",
             "| ratio of loop time per step | per repeat | median |", "|---|---|---|"]
    for label, a, b in [("async / sync", "async", "sync"), ("sync / no saves", "sync", "none"),
                        ("async / no saves", "async", "none")]:
        vals = _ratios(runs, a, b)
        lines.append(f"| {label} | {', '.join(f'{v:.3f}' for v in vals)} | "
                     f"{num(statistics.median(vals)) if vals else ''} |")
    lines += ["", *_observations(runs)]
    lines += ["", "| config | loop time per step (s) | median step (s) | median wait per save (s) |",
              "|---|---|---|---|"]
    for r in runs:
        if r.get("error"):
            lines.append(f"| {r['config']} #{r['repeat']} | failed: {r['error']} | | |")
            continue
        wait = num(statistics.median(r["blocked_s"])) if r.get("blocked_s") else ""
        lines.append(f"| {r['config']} #{r['repeat']}{star(r)} | {num(r['loop_s'])} | {num(r['step_s'])} | {wait} |")
    return lines + [""]


SECTION = Section("checkpoint", checkpointing, render)
