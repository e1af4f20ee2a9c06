"""The end of a run: CPU seconds of ``experiment=smoke`` (launcher and ranks together) after its
last metrics line, with profiling off and on. CPU seconds, not wall time: they hardly change with
the host's load. ``--baseline-root DIR`` also runs another checkout's runner (an earlier commit),
alternating with this one."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Mapping

import psutil

from bench.common import ROOT, median
from bench.markdown import meta_line, num
from bench.runs import Context
from bench.section import Page, Section

STEPS = 4  # experiment=smoke's


def _tree_cpu_s(root: psutil.Process, seen: dict[int, float]) -> None:
    """Each live process's CPU seconds in ``seen``, by pid (a rank's own; the launcher's with the
    children it already waited for)."""
    try:
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for p in procs:
        try:
            t = p.cpu_times()
        except psutil.NoSuchProcess:
            continue
        seen[p.pid] = t.user + t.system + ((t.children_user + t.children_system) if p is root else 0.0)


def tail_cpu(ctx: Context, root: Path, run_dir: Path, profile: bool) -> dict[str, Any]:
    """One run of ``root``'s runner: its CPU seconds in all and after its last metrics line (the
    processes' CPU sampled every 5 ms until that line shows)."""
    env = {**os.environ, "PYTHONPATH": str(root)}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.Popen([sys.executable, "-m", "runner", "experiment=smoke", f"profile.enabled={profile}",
                             f"device={ctx.args.device}", f"hydra.run.dir={run_dir}"], cwd=ctx.work, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    launcher, seen = psutil.Process(proc.pid), {}
    at_line = line_at = None
    metrics = run_dir / "metrics.jsonl"
    while proc.poll() is None:
        _tree_cpu_s(launcher, seen)
        if at_line is None and metrics.is_file() and len(metrics.read_text().splitlines()) >= STEPS:
            at_line, line_at = sum(seen.values()), time.time()
        time.sleep(0.005)
    err = proc.communicate()[1]
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    total = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    if proc.returncode != 0 or at_line is None or line_at is None:
        return {"status": "failed", "error": (err.strip().splitlines() or [f"exit {proc.returncode}"])[-1][:300]}
    summary = json.loads((run_dir / "summary.json").read_text())
    return {"status": "ok", "cpu_s": total, "after_last_line_cpu_s": total - at_line,
            "after_last_line_wall_s": time.time() - line_at, "started_at": summary.get("started_at"),
            "finished_at": summary.get("finished_at")}


def ending(ctx: Context) -> dict[str, Any]:
    trees = {"this checkout": ROOT}
    if ctx.args.baseline_root:
        trees["baseline"] = ctx.args.baseline_root.resolve()
    runs = []
    for repeat in range(ctx.args.repeats):
        for profile in (False, True):
            for name in trees if repeat % 2 == 0 else reversed(list(trees)):
                run_dir = ctx.work / f"ending-{repeat}-{profile}-{list(trees).index(name)}"
                run = {"tree": name, "profile": profile, "repeat": repeat,
                       **tail_cpu(ctx, trees[name], run_dir, profile)}
                runs.append(ctx.mark(run))
                print(f"[bench] ending {name} profile={profile} #{repeat}: "
                      f"{run.get('after_last_line_cpu_s') or run.get('error')}", flush=True)
    return {"runs": runs, "trees": {k: str(v) for k, v in trees.items()}}


def render(data: Mapping[str, Any], page: Page) -> list[str]:
    runs = data["results"].get("runs", [])
    lines = ["## The end of a run", "", meta_line(data["meta"], runs), "",
             f"`experiment=smoke` ({STEPS} steps, 2 ranks): the CPU seconds of the launcher and its ranks together "
             "after the last metrics line (the summary, leaving the process groups, the processes' exits), and of "
             "the whole run; per run, then the median. `baseline`: another checkout's runner "
             "(`--baseline-root`), alternating with this one.", "",
             "| runner | profiling | CPU s after the last line | median | wall s after it | CPU s, whole run |",
             "|---|---|---|---|---|---|"]
    for tree in dict.fromkeys(r["tree"] for r in runs):
        for profile in (False, True):
            mine = [r for r in runs if r["tree"] == tree and r["profile"] == profile]
            ok = [r for r in mine if r.get("status") == "ok"]
            if not mine:
                continue
            lines.append(f"| {tree} | {'on' if profile else 'off'} | "
                         f"{', '.join(num(r.get('after_last_line_cpu_s'), '.2f') or 'failed' for r in mine)} | "
                         f"{num(median([r['after_last_line_cpu_s'] for r in ok]), '.2f')} | "
                         f"{', '.join(num(r.get('after_last_line_wall_s'), '.1f') for r in ok)} | "
                         f"{', '.join(num(r.get('cpu_s'), '.1f') for r in ok)} |")
    return lines + [""]


SECTION = Section("ending", ending, render, times_runs=False)  # CPU seconds: no need to wait for a quiet host
