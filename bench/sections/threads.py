"""Threads on a loaded host: ``parallel.pp=1`` (one rank, in the launcher's process) with as many
threads as cores (what an idle or loaded host gets automatically) and with one, each with OpenMP's
threads spinning while they wait (GNU OpenMP's own default, ``GOMP_SPINCOUNT=300000``, which the
runner leaves as the user set it) and passive (the runner's default, ``OMP_WAIT_POLICY=PASSIVE``).
It runs on a host under load on purpose: where the last minute's load average is below the cores
+ 1, it starts busy processes until it is not, for as long as it runs."""

from __future__ import annotations

import os
import re
import resource
import subprocess
import sys
import time
from contextlib import contextmanager
from typing import Any, Iterator, Mapping

from bench.common import ROOT, median, steady
from bench.markdown import meta_line, num
from bench.runs import Context, read_run
from bench.section import Page, Section

STEPS = 10
COMMON = ["parallel.pp=1", f"train.steps={STEPS}", "profile.enabled=false"]
SPINNING = {"GOMP_SPINCOUNT": "300000"}  # GNU OpenMP's default where OMP_WAIT_POLICY is unset


def default(cores: int) -> str:
    """The variant a run gets without settings: as many threads as cores, waiting passively."""
    return f"{cores} threads, passive (the default)"


def variants(cores: int) -> dict[str, tuple[list[str], dict[str, str]]]:
    """Name -> (overrides, environment): ``cores`` threads (the count one rank gets automatically)
    or one, spinning or passive (the default: ``default(cores)``)."""
    every = [f"launch.threads_per_rank={cores}"]
    return {
        f"{cores} threads, spinning": (every, SPINNING),
        default(cores): (every, {}),
        "1 thread, spinning": (["launch.threads_per_rank=1"], SPINNING),
        "1 thread, passive": (["launch.threads_per_rank=1"], {}),
    }


_WAIT_SETTINGS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")


@contextmanager
def _loaded_host() -> Iterator[int]:
    """Busy processes (one core each) until the load average exceeds the cores; yields how many."""
    cores = os.cpu_count() or 1
    extra = max(0, cores + 1 - int(os.getloadavg()[0]))
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(extra)]
    try:
        if burners:
            time.sleep(5)  # the load average follows
        yield extra
    finally:
        for p in burners:
            p.kill()
            p.wait()


def _run(ctx: Context, name: str, repeat: int) -> dict[str, Any]:
    overrides, extra_env = variants(os.cpu_count() or 1)[name]
    run_dir = ctx.work / f"threads-{repeat}-{list(variants(os.cpu_count() or 1)).index(name)}"
    env = {k: v for k, v in os.environ.items() if k not in _WAIT_SETTINGS}
    env.update({"PYTHONPATH": str(ROOT), **extra_env})
    before, load, started = resource.getrusage(resource.RUSAGE_CHILDREN), os.getloadavg()[0], time.time()
    done = subprocess.run([sys.executable, "-m", "runner", *COMMON, *overrides, f"device={ctx.args.device}",
                           f"hydra.run.dir={run_dir}"], cwd=ctx.work, env=env, capture_output=True, text=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    run = read_run(run_dir, done)
    resolved = run_dir / "resolved_config.yaml"
    threads = re.search(r"threads_per_rank: (\d+)", resolved.read_text()) if resolved.is_file() else None
    run.update(variant=name, repeat=repeat, threads=int(threads.group(1)) if threads else None,
               wall_s=time.time() - started, load_before=load,
               cpu_s=(after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime),
               steady_s=steady(run.get("step_times") or [], skip=2))
    print(f"[bench] threads {name} #{repeat}: {run.get('steady_s') or run.get('error')}", flush=True)
    return ctx.mark(run)


def threads(ctx: Context) -> dict[str, Any]:
    """Every variant ``option_repeats`` times, forward then backward (a drifting load favours none)."""
    runs = []
    names = list(variants(os.cpu_count() or 1))
    with _loaded_host() as burners:
        for repeat in range(ctx.args.option_repeats):
            for name in names if repeat % 2 == 0 else reversed(names):
                runs.append(_run(ctx, name, repeat))
    return {"runs": runs, "burners": burners, "cores": os.cpu_count()}


def render(data: Mapping[str, Any], page: Page) -> list[str]:
    res = data["results"]
    runs = res.get("runs", [])
    lines = ["## Threads on a loaded host", "", meta_line(data["meta"], runs), "",
             f"`python -m runner {' '.join(COMMON)}` on a host whose load average exceeds its "
             f"{res.get('cores')} cores ({res.get('burners', 0)} busy processes added by the benchmark, the rest "
             "other work): OpenMP threads that spin while they wait (GNU OpenMP's default, `GOMP_SPINCOUNT=300000`) "
             "against passive ones (`OMP_WAIT_POLICY=PASSIVE`, the runner's default unless the environment sets "
             "`OMP_WAIT_POLICY`, `GOMP_SPINCOUNT` or `KMP_BLOCKTIME`), with as many threads as cores (what an idle "
             "host gets automatically, loaded or not) and one "
             "(`launch.threads_per_rank`). Median step after the first 2 (s), per run; the threads the run "
             "resolved; the run's CPU seconds (launcher and rank, the whole run):", "",
             "| variant | steady step (s), per run | median (s) | threads | CPU s, per run | load average before |",
             "|---|---|---|---|---|---|"]
    medians = {}
    for name in dict.fromkeys(r.get("variant") for r in runs):
        mine = [r for r in runs if r.get("variant") == name]
        medians[name] = median([r["steady_s"] for r in mine if r.get("steady_s") is not None])
        lines.append(f"| {name} | {', '.join(num(r.get('steady_s')) or 'failed' for r in mine)} | "
                     f"{num(medians[name])} | {', '.join(sorted({str(r.get('threads')) for r in mine}))} | "
                     f"{', '.join(num(r.get('cpu_s'), '.1f') for r in mine)} | "
                     f"{', '.join(num(r.get('load_before'), '.1f') for r in mine)} |")
    ours, one = medians.get(default(res.get("cores") or 1)), medians.get("1 thread, spinning")
    spin = medians.get(f"{res.get('cores')} threads, spinning")
    if ours and one:
        lines += ["", f"The default takes {ours / one:.2f}x the median step of `launch.threads_per_rank=1` as it "
                      f"ran before (spinning)" + (f"; {res.get('cores')} spinning threads, the earlier default, took "
                                                  f"{spin / one:.1f}x" if spin else "") + "."]
    return lines + [""]


SECTION = Section("threads", threads, render, times_runs=False)  # a loaded host is its condition
