"""Benchmarks: how close each schedule runs to its theoretical bubble, what profiling and startup
cost. Writes BENCHMARKS.md (and the sweep directories it ran) and never fails on a number.

    python scripts/bench.py                 # pp=2, m in {4, 8}, all 7 schedules (about 10 minutes on 2 cores)
    python scripts/bench.py --pp 2 4 --microbatches 4 8 16

Every number in one table comes from one invocation on one machine; ratios, not absolute times,
are what carry over between machines.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
SCHEDULES = ["gpipe", "1f1b", "interleaved_1f1b", "looped_bfs", "interleaved_zb", "zbv", "dualpipev"]
# Big enough that a stage's compute dominates messages on CPU (tens of ms per microbatch forward).
MODEL = ["model.dim=256", "model.n_layers=8", "train.seq_len=128", "train.batch_size=32", "device=cpu"]


def _runner(*args: str, cwd: Path, module: str = "runner") -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, env=env, capture_output=True, text=True)


def efficiency(work: Path, pps: list[int], microbatches: list[int], steps: int) -> list[dict]:
    """One Hydra sweep per pipeline width; rows from its sweep.csv."""
    rows = []
    for pp in pps:
        sweep = work / f"sweep-pp{pp}"
        sweep_m = ",".join(map(str, microbatches))
        done = _runner("-m", f"schedule={','.join(SCHEDULES)}", f"parallel.microbatches={sweep_m}",
                       f"parallel.pp={pp}", f"train.steps={steps}", "profile.enabled=false", *MODEL,
                       f"hydra.sweep.dir={sweep}", cwd=work)
        if done.returncode not in (0, 2):
            raise RuntimeError(done.stderr[-2000:])
        with open(sweep / "sweep.csv") as f:
            for row in csv.DictReader(f):
                overrides = dict(o.split("=", 1) for o in row["overrides"].split())
                rows.append({"pp": pp, "schedule": overrides["schedule"], "m": int(overrides["parallel.microbatches"]),
                             **row})
    return rows


def _step_times(run_dir: Path, skip: set[int]) -> list[float]:
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [m["step_time_s"] for m in lines if m["step"] not in skip and m["step"] > 0]


def profiling_cost(work: Path, steps: int, repeats: int) -> list[float]:
    """Steady-state step time with profiling on (steps outside the window) / off, alternating."""
    ratios = []
    common = ["schedule=1f1b", "parallel.microbatches=8", f"train.steps={steps}", *MODEL]
    for i in range(repeats):
        on, off = work / f"prof-on-{i}", work / f"prof-off-{i}"
        _runner(*common, "profile.enabled=true", f"hydra.run.dir={on}", cwd=work)
        _runner(*common, "profile.enabled=false", f"hydra.run.dir={off}", cwd=work)
        window = set(json.loads((on / "summary.json").read_text())["bubble"]["steps"])
        window |= {min(window) - 1}  # the profiler's warm-up step
        ratios.append(statistics.median(_step_times(on, window)) / statistics.median(_step_times(off, set())))
    return ratios


_BARE = """
import os, sys, time, torch, torch.distributed as dist, torch.multiprocessing as mp
def rank(r, store, start, out):
    dist.init_process_group("gloo", store=dist.FileStore(store, 2), rank=r, world_size=2)
    dist.barrier()
    if r == 0:
        open(out, "w").write(str(time.time() - start))
    dist.destroy_process_group()
if __name__ == "__main__":
    mp.spawn(rank, args=(sys.argv[1], float(sys.argv[2]), sys.argv[3]), nprocs=2)
"""


def startup(work: Path, repeats: int) -> list[tuple[float, float]]:
    """(runner launch → first step of experiment=smoke, bare spawn of 2 ranks → process group up)."""
    script = work / "bare_spawn.py"
    script.write_text(_BARE)
    pairs = []
    for i in range(repeats):
        run = work / f"smoke-{i}"
        _runner("experiment=smoke", "profile.enabled=false", f"hydra.run.dir={run}", cwd=work)
        runner_s = json.loads((run / "summary.json").read_text())["startup_s"]
        out = work / f"bare-{i}.txt"
        start = time.time()
        subprocess.run([sys.executable, str(script), str(work / f"store-{i}"), str(start), str(out)], check=True)
        pairs.append((runner_s, float(out.read_text())))
    return pairs


_BARE_LOOP = """
import json, os, sys, time, torch, torch.distributed as dist, torch.multiprocessing as mp
from omegaconf import OmegaConf
from torch.distributed.pipelining import PipelineStage, Schedule1F1B
from runner.data import SyntheticData
from runner.losses import cross_entropy
from runner.split import build_meta_model, materialize, plan_split

def rank(r, cfg, store, out):
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, 2), rank=r, world_size=2)
    cfg = OmegaConf.create(cfg)
    t, m = cfg.train, cfg.parallel.microbatches
    meta = build_meta_model(cfg.model)
    module = materialize(meta, plan_split(meta, 2, None)[r], seed=t.seed, device=torch.device("cpu"))
    schedule = Schedule1F1B(PipelineStage(module, r, 2, torch.device("cpu")), m, loss_fn=cross_entropy)
    optimizer = torch.optim.AdamW(module.parameters(), lr=t.lr)
    data = SyntheticData(vocab_size=cfg.data.vocab_size, signal=cfg.data.signal, seed=t.seed)
    times = []
    for step in range(t.steps):
        x, y = data.batch(step, t.batch_size, t.seq_len)
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        schedule.step(x) if r == 0 else schedule.step(target=y)
        optimizer.step()
        times.append(time.perf_counter() - start)
    if r == 0:
        open(out, "w").write(json.dumps(times))
    dist.destroy_process_group()

if __name__ == "__main__":
    mp.spawn(rank, args=(json.loads(sys.argv[1]), sys.argv[2], sys.argv[3]), nprocs=2)
"""


def overhead(work: Path, steps: int, repeats: int) -> list[float]:
    """The runner's median steady-state step time over a bare loop's (same model, stages, data,
    schedule, 2 spawned ranks), alternating A/B."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    import runner.config  # noqa: F401

    overrides = ["schedule=1f1b", "parallel.microbatches=8", f"train.steps={steps}", *MODEL]
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = OmegaConf.to_container(compose("config", overrides=overrides), resolve=True)
    script = work / "bare_loop.py"
    script.write_text(_BARE_LOOP)
    ratios = []
    for i in range(repeats):
        run = work / f"overhead-runner-{i}"
        _runner(*overrides, "profile.enabled=false", "launch.threads_per_rank=1", f"hydra.run.dir={run}", cwd=work)
        runner_s = statistics.median(_step_times(run, set()))
        out = work / f"overhead-bare-{i}.json"
        subprocess.run([sys.executable, str(script), json.dumps(cfg), str(work / f"loop-store-{i}"), str(out)],
                       check=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
        bare_s = statistics.median(json.loads(out.read_text())[1:])
        ratios.append(runner_s / bare_s)
    return ratios


def write_markdown(path: Path, *, rows: list[dict], prof: list[float], starts: list[tuple[float, float]],
                   over: list[float], command: str) -> None:
    lines = ["# Benchmarks", "",
             f"Machine: {platform.machine()}, {os.cpu_count()} cores, {platform.platform()}; "
             f"torch {torch.__version__}; CPU, gloo. Produced by `{command}` on {time.strftime('%Y-%m-%d')}; "
             "re-run it to refresh.", "",
             "Model: transformer, `" + " ".join(MODEL) + "`.", "",
             "## Pipeline efficiency: measured vs theoretical bubble", "",
             "Bubble = 1 - (time in the stage's own compute calls) / (pipeline-step wall time), mean over ranks; "
             "theoretical: the closed form for GPipe/1F1B/interleaved/looped BFS, else the simulator with the "
             "measured costs. pp=4 on 2 cores oversubscribes them: judge bubbles at pp=2.", "",
             "| pp | schedule | m | tokens/s | step time (s) | bubble measured | theoretical | measured - theory "
             "| peak MiB |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['pp']} | {r['schedule']} | {r['m']} | failed: {r['error']} | | | | | |")
            continue
        gap = float(r["bubble"]) - float(r["bubble_theoretical"])
        lines.append(f"| {r['pp']} | {r['schedule']} | {r['m']} | {float(r['tokens_per_s']):,.0f} | "
                     f"{r['step_time_s']} | {r['bubble']} | {r['bubble_theoretical']} | {gap:+.3f} | "
                     f"{r['peak_mem_mib']} |")
    lines += ["", "## Profiling cost", "",
              "Median steady-state step time with `profile.enabled=true`, outside the profiled window, over the same "
              "with profiling off (1F1B, pp=2, m=8), alternating runs: "
              + ", ".join(f"{r:.3f}" for r in prof)
              + (f" (median {statistics.median(prof):.3f})" if prof else ""), "",
              "## Startup", "",
              "`experiment=smoke` launch to first step (compose, validate, spawn 2 ranks, process group, build, "
              "shape inference) against a bare spawn of 2 ranks that import torch and initialise a gloo group:", "",
              "| runner (s) | bare spawn (s) | ratio |", "|---|---|---|"]
    lines += [f"| {a:.2f} | {b:.2f} | {a / b:.2f} |" for a, b in starts]
    lines += ["", "## Runner overhead", "",
              "Median steady-state step time of the runner (1F1B, pp=2, m=8, profiling off; its step adds the "
              "global-norm clip and the loss all-reduce) over a minimal hand-written loop that builds the same "
              "stages and calls `Schedule1F1B.step()` and AdamW, alternating runs: "
              + ", ".join(f"{r:.3f}" for r in over)
              + (f" (median {statistics.median(over):.3f}, min {min(over):.3f}, max {max(over):.3f})" if over else ""),
              "", "## Not measured yet", "",
              "- Step time and peak memory scaling tables over pp in {2, 4} and m in {4, 8, 16}; GPU runs.", ""]
    path.write_text("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, nargs="+", default=[2])
    parser.add_argument("--microbatches", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--work", type=Path, default=None, help="where the runs go (default: a temp dir)")
    parser.add_argument("--output", type=Path, default=ROOT / "BENCHMARKS.md")
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="runner-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    rows = efficiency(work, args.pp, args.microbatches, args.steps)
    prof = profiling_cost(work, steps=12, repeats=args.repeats)
    starts = startup(work, args.repeats)
    over = overhead(work, steps=10, repeats=args.repeats)
    command = "python scripts/bench.py " + " ".join(sys.argv[1:])
    write_markdown(args.output, rows=rows, prof=prof, starts=starts, over=over, command=command.strip())
    print(args.output.read_text())


if __name__ == "__main__":
    main()
