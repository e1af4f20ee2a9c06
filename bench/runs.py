"""Running the runner from a benchmark and reading what its runs wrote: the context a section
runs in (arguments, work directory, waits, load), ``python -m runner`` and ``runner.plan`` as
subprocesses, a schedule x microbatch sweep, a run's numbers, and a section's JSON file."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from bench.common import ROOT, SCHEDULES, SWEEP_MODEL, steady
from bench.machine import LoadMonitor, machine, wait_for_quiet


class Context:
    def __init__(self, args: argparse.Namespace, work: Path):
        self.args, self.work = args, work
        self.waits: list[dict[str, Any]] = []
        self.monitor: LoadMonitor | None = None

    def quiet(self, label: str) -> None:
        if self.args.max_wait > 0:
            self.waits.append(wait_for_quiet(label, self.args.max_wait))

    def loaded(self, start: float | None, end: float | None) -> bool | None:
        return self.monitor.loaded(start, end) if self.monitor is not None else None

    def mark(self, run: dict[str, Any]) -> dict[str, Any]:
        run["under_load"] = self.loaded(run.get("started_at"), run.get("finished_at"))
        return run

    def rerun_loaded(self, runs: list[dict[str, Any]], rerun: Callable[[dict[str, Any]], dict[str, Any]],
                     label: str) -> list[dict[str, Any]]:
        """Once, after waiting for a quiet machine: re-run every run that shared the machine."""
        todo = [i for i, r in enumerate(runs) if r.get("under_load")]
        if not todo or not self.args.rerun_loaded:
            return runs
        self.quiet(f"{label}: re-running {len(todo)} runs that ran under load")
        for i in todo:
            runs[i] = {**self.mark(rerun(runs[i])), "rerun": True}
        print(f"[bench] {label}: re-ran {len(todo)} runs, {sum(bool(runs[i].get('under_load')) for i in todo)} "
              "still under load", flush=True)
        return runs


def run_cli(ctx: Context, *args: str, module: str = "runner", env: Mapping[str, str] | None = None
            ) -> subprocess.CompletedProcess:
    """``python -m runner`` (or ``runner.plan``) with these overrides, on the benchmark's device."""
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    return subprocess.run([sys.executable, "-m", module, *args, f"device={ctx.args.device}"], cwd=ctx.work,
                          env=full_env, capture_output=True, text=True)


def error_line(run_dir: Path, done: subprocess.CompletedProcess | None) -> str:
    error_file = run_dir / "error.txt"
    if error_file.is_file():
        return error_file.read_text().strip().splitlines()[0][:300]
    if done is not None:
        tail = [line for line in done.stderr.strip().splitlines() if line.strip()]
        return (tail[-1] if tail else f"exit code {done.returncode}")[:300]
    return "no summary.json"


def read_run(run_dir: Path, done: subprocess.CompletedProcess | None = None) -> dict[str, Any]:
    """What a benchmark keeps of one run: its summary's numbers and every step time."""
    summary_file = run_dir / "summary.json"
    if not summary_file.is_file():
        return {"status": "failed", "error": error_line(run_dir, done), "dir": str(run_dir)}
    s = json.loads(summary_file.read_text())
    metrics = run_dir / "metrics.jsonl"
    step_times = [json.loads(line)["step_time_s"] for line in metrics.read_text().splitlines()] \
        if metrics.is_file() else []
    bubble = s.get("bubble") or {}
    return {
        "status": "ok", "dir": str(run_dir),
        "step_time_s": s.get("step_time_s"), "tokens_per_s": s.get("tokens_per_s"), "step_times": step_times,
        "bubble": bubble.get("mean"), "bubble_per_rank": bubble.get("per_rank"),
        "bubble_theoretical": bubble.get("theoretical"), "theoretical_source": bubble.get("theoretical_source"),
        "bubble_simulated": bubble.get("simulated"), "simulated_step_s": bubble.get("simulated_step_s"),
        "pipeline_step_s": bubble.get("pipeline_step_s"),
        "mean_costs_s": bubble.get("mean_costs_s", {}),
        "peak_mem_bytes": s.get("peak_mem_bytes"), "stages": s.get("stages"), "num_stages": s.get("num_stages"),
        "startup_s": s.get("startup_s"), "startup_phases_s": s.get("startup_phases_s"),
        "final_loss": s.get("final_loss"), "started_at": s.get("started_at"), "finished_at": s.get("finished_at"),
        "weights_read_bytes": s.get("weights_read_bytes"),
    }


def alternating_runs(ctx: Context, label: str, layouts: Mapping[str, Sequence[str]], common: Sequence[str]
                     ) -> list[dict[str, Any]]:
    """Each layout (name -> overrides) run ``option_repeats`` times on top of ``common``, in forward
    and then reverse order (so a drifting host load favours none), with the steady step time."""
    runs = []
    for repeat in range(ctx.args.option_repeats):
        for name in layouts if repeat % 2 == 0 else reversed(list(layouts)):
            run_dir = ctx.work / f"{label}-{name}-{repeat}"
            run = read_run(run_dir, run_cli(ctx, *common, *layouts[name], f"hydra.run.dir={run_dir}"))
            if run["status"] == "ok":
                run["steady_s"] = steady(run["step_times"], skip=2)
            runs.append(ctx.mark({"config": name, "repeat": repeat, **run}))
            print(f"[bench] {label} {name} #{repeat}: {run.get('steady_s') or run.get('error')}", flush=True)
    return runs


def _job_overrides(job_dir: Path) -> dict[str, str]:
    import yaml

    overrides = yaml.safe_load((job_dir / ".hydra" / "overrides.yaml").read_text()) or []
    return dict(o.split("=", 1) for o in overrides)


def sweep_pp(ctx: Context, pp: int, microbatches: list[int], steps: int, *, model: Sequence[str] = SWEEP_MODEL,
             sweep: Path | None = None) -> list[dict[str, Any]]:
    """One Hydra multirun over schedules x m at this pp; any job the sweep did not leave (it stops
    on a launcher error) is re-run on its own."""
    sweep = sweep or ctx.work / f"efficiency-pp{pp}"
    common = _sweep_common(pp, steps, model)
    done = run_cli(ctx, "-m", f"schedule={','.join(SCHEDULES)}",
                   f"parallel.microbatches={','.join(map(str, microbatches))}", *common, f"hydra.sweep.dir={sweep}")
    runs: dict[tuple[str, int], dict[str, Any]] = {}
    jobs = [d for d in sweep.iterdir() if (d / ".hydra" / "overrides.yaml").is_file()] if sweep.is_dir() else []
    for job in jobs:
        o = _job_overrides(job)
        runs[(o["schedule"], int(o["parallel.microbatches"]))] = read_run(job, done)
    for name in SCHEDULES:
        for m in microbatches:
            if (name, m) not in runs or runs[(name, m)]["status"] == "running":
                runs[(name, m)] = single_pp(ctx, pp, name, m, steps, sweep / f"single-{name}-m{m}", model)
    return [{"pp": pp, "schedule": name, "m": m, **runs[(name, m)]} for name in SCHEDULES for m in microbatches]


def _sweep_common(pp: int, steps: int, model: Sequence[str] = SWEEP_MODEL) -> list[str]:
    # Profiling off; the bubble is recorded over steps 1.. (profile.wait=1, warmup=0: no profiler to warm up).
    return [f"parallel.pp={pp}", f"train.steps={steps}", "profile.enabled=false", "profile.wait=1",
            "profile.warmup=0", f"profile.active={steps - 1}", *model]


def single_pp(ctx: Context, pp: int, name: str, m: int, steps: int, run_dir: Path,
              model: Sequence[str] = SWEEP_MODEL) -> dict[str, Any]:
    """One efficiency run outside the sweep (a job the sweep did not leave, or a re-run)."""
    done = run_cli(ctx, f"schedule={name}", f"parallel.microbatches={m}", *_sweep_common(pp, steps, model),
                   f"hydra.run.dir={run_dir}")
    return {"pp": pp, "schedule": name, "m": m, **read_run(run_dir, done)}


def step_times(run_dir: Path, skip: set[int]) -> list[float]:
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    # Steps are numbered from 1; the first includes shape inference.
    return [m["step_time_s"] for m in lines if m["step"] not in skip and m["step"] > 1]


def steady_s(run: Mapping[str, Any]) -> float | None:
    """A run's steady step time: the median over its last two thirds of steps. The first steps of a
    run are slower (1-3 ms actions: steps 2-5 measured x1.03-1.3 the later ones, with and without
    the profiler), and what the planner predicts is the steady state."""
    times = run.get("step_times") or []
    return steady(times, skip=max(1, len(times) // 3)) if len(times) > 3 else run.get("step_time_s")


def plan_label(c: Mapping[str, Any]) -> str:
    """A plan.json candidate as ``schedule/m`` (the key of a plain run), plus its stages per rank
    and split where they differ from a plain run's."""
    from runner.pipeline.schedule import default_stages_per_rank

    name = c["schedule"] + (f"-{c['search']['placement']}" if c.get("search") else "")
    extra = "" if c["schedule"] == "synthesized" or c["stages_per_rank"] == default_stages_per_rank(c["schedule"]) \
        else f" v={c['stages_per_rank']}"
    return f"{name}/{c['microbatches']}{extra}" + (f" split {','.join(c['split_points'])}" if c.get("split_points")
                                                   else "")


def run_plan(ctx: Context, out: Path, model: Sequence[str], microbatches: Sequence[int], *extra: str
             ) -> list[dict[str, Any]] | dict[str, Any]:
    """``python -m runner.plan`` at pp=2 (or ``extra``'s pp): its plan.json, or an error."""
    done = run_cli(ctx, *model, "parallel.pp=2", f"plan.microbatches=[{','.join(map(str, microbatches))}]", *extra,
                   f"hydra.run.dir={out}", module="runner.plan")
    if done.returncode != 0:
        return {"error": (done.stderr.strip().splitlines() or ["plan failed"])[-1][:300]}
    return json.loads((out / "plan.json").read_text())


def save(results_dir: Path, section: str, results: dict[str, Any], ctx: Context, *, started: float,
         duration_s: float | None, load: dict[str, Any] | None = None) -> Path:
    """benchmarks/<section>.json: the section's results and where they come from (machine, date,
    command, duration, waits, load). Written whole, then renamed: a reader never sees half a file."""
    results_dir.mkdir(parents=True, exist_ok=True)
    meta = {"section": section, "machine": machine(ctx.args.device),
            "date": time.strftime("%Y-%m-%d %H:%M", time.localtime(started)),
            "command": "python scripts/bench.py " + " ".join(sys.argv[1:]), "duration_s": duration_s,
            "waits": ctx.waits, "load": load}
    path = results_dir / f"{section}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({"meta": meta, "results": results}, indent=1) + "\n")
    os.replace(tmp, path)
    return path
