"""Startup: launch to the first step of ``experiment=smoke`` (and its phases) against a bare spawn
of 2 ranks (``programs/bare_spawn.py``), and how long a config error takes to be reported."""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Mapping

from bench.markdown import meta_line, num, star
from bench.runs import Context, read_run, run_cli
from bench.section import Page, Section

BARE_SPAWN = Path(__file__).resolve().parents[1] / "programs" / "bare_spawn.py"
# Config errors the command line reports before importing torch: a misspelt key (Hydra's
# composition), a value the runner does not know, a combination it rejects.
CONFIG_ERRORS = {"misspelt key": ["trian.steps=5"], "unknown value": ["train.precision=fp16"],
                 "rejected combination": ["parallel.dp=2"]}


def _timed_error(ctx: Context, overrides: list[str], run_dir: Path) -> dict[str, Any]:
    """Wall time of ``python -m runner <overrides>`` that must fail with a config error."""
    start = time.time()
    done = run_cli(ctx, *overrides, f"hydra.run.dir={run_dir}")
    return {"s": time.time() - start, "returncode": done.returncode,
            "error": (done.stderr.strip().splitlines() or [""])[-1][:200]}


def startup(ctx: Context) -> dict[str, Any]:
    """Runner launch -> first step of experiment=smoke (and its phases, where the summary has
    them) against a bare spawn of 2 ranks -> process group up, and the time a config error takes
    to be reported, alternating."""
    work = ctx.work
    pairs = []
    for i in range(ctx.args.repeats):
        run = work / f"smoke-{i}"
        t0 = time.time()
        done = run_cli(ctx, "experiment=smoke", "profile.enabled=false", f"hydra.run.dir={run}")
        r = read_run(run, done)
        out, store = work / f"bare-{i}.txt", work / f"store-{i}"
        start = time.time()
        subprocess.run([sys.executable, str(BARE_SPAWN), str(store), str(start), str(out), ctx.args.device],
                       check=False)
        bare = float(out.read_text()) if out.is_file() else None
        errors = {name: _timed_error(ctx, overrides, work / f"error-{i}-{n}")
                  for n, (name, overrides) in enumerate(CONFIG_ERRORS.items())}
        pairs.append({"runner_s": r.get("startup_s"), "phases_s": r.get("startup_phases_s"), "bare_s": bare,
                      "config_errors": errors, "error": r.get("error"), "under_load": ctx.loaded(t0, time.time())})
    return {"pairs": pairs}


def render(data: Mapping[str, Any], page: Page) -> list[str]:
    pairs = data["results"].get("pairs", [])
    lines = ["## Startup", "", meta_line(data["meta"], pairs), "",
             "`experiment=smoke` from launch (before Python imports torch) until its first step starts (summary "
             "`startup_s`: compose, imports, validate, spawn 2 ranks, process group, build) against a bare spawn of "
             "2 ranks that import torch and initialise a gloo group, alternating; where the summary has "
             "`startup_phases_s` (which runs on to the end of the first step, shape inference included), its total "
             "too:", "",
             "| runner to first step (s) | runner to end of the first step (s) | bare spawn (s) "
             "| ratio (first step / bare) |",
             "|---|---|---|---|"]
    for p in pairs:
        a, b = p.get("runner_s"), p.get("bare_s")
        to_end = sum(p["phases_s"].values()) if isinstance(p.get("phases_s"), dict) and p["phases_s"] else None
        if a is None or b is None:
            lines.append(f"| failed: {p.get('error') or 'no number'} | | {num(b, '.2f')} | |")
        else:
            lines.append(f"| {a:.2f}{star(p)} | {num(to_end, '.2f')} | {b:.2f} | {a / b:.2f} |")
    timed = [(p["runner_s"], p["bare_s"]) for p in pairs if p.get("runner_s") is not None and p.get("bare_s")]
    if timed:
        ratios = [a / b for a, b in timed]
        lines += ["", f"Median: the runner starts its first step {statistics.median(a for a, _ in timed):.2f} s after "
                      f"launch, a bare spawn has its group up after {statistics.median(b for _, b in timed):.2f} s "
                      f"(ratio {min(ratios):.2f}-{max(ratios):.2f} over {len(timed)} runs)."]
    phased = [p["phases_s"] for p in pairs if isinstance(p.get("phases_s"), dict) and p["phases_s"]]
    if phased:
        names: list[str] = []
        for ph in phased:
            names += [n for n in ph if n not in names]
        means = {n: statistics.fmean(ph[n] for ph in phased if n in ph) for n in names}
        total = sum(means.values())
        lines += ["", f"The runner's startup by phase (`startup_phases_s`, mean over {len(phased)} runs):", "",
                  "| phase | mean (s) | share |", "|---|---|---|"]
        lines += [f"| {n} | {means[n]:.2f} | {means[n] / total:.0%} |" if total else f"| {n} | {means[n]:.2f} | |"
                  for n in names]
        lines.append(f"| total | {total:.2f} | |")
        if total:
            largest = max(means, key=lambda n: means[n])
            lines += ["", f"The largest phase is `{largest}`, {means[largest] / total:.0%} of the startup."]
    else:
        lines += ["", "No per-phase split: these runs' summary.json has no `startup_phases_s`."]
    return lines + _render_config_errors(pairs) + [""]


SECTION = Section("startup", startup, render)


def _render_config_errors(pairs: list[Mapping[str, Any]]) -> list[str]:
    """Launch to exit of a command line with a config error (no torch imported before it is found)."""
    timed = [p["config_errors"] for p in pairs if p.get("config_errors")]
    if not timed:
        return ["", "No config-error timings in these results (added later to the section)."]
    lines = ["", "A config error, from launch to the exit with its message (the checks that need no torch run before "
             "torch is imported), next to the bare spawn above:", "",
             "| error | overrides | exit status | time (s), per run | median (s) |", "|---|---|---|---|---|"]
    for name, overrides in CONFIG_ERRORS.items():
        runs = [t[name] for t in timed if name in t]
        codes = sorted({r["returncode"] for r in runs})
        times = [r["s"] for r in runs]
        lines.append(f"| {name} | `{' '.join(overrides)}` | {', '.join(map(str, codes))} | "
                     f"{', '.join(f'{x:.2f}' for x in times)} | {statistics.median(times):.2f} |")
    return lines
