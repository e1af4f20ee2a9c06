"""``python scripts/bench.py``: run the chosen sections, save each one's JSON, render BENCHMARKS.md."""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Sequence

import bench
from bench.common import ROOT
from bench.document import render
from bench.machine import LoadMonitor
from bench.runs import Context, save
from bench.sections import SECTIONS
from bench.sections.planner import PLANNER_SIZES


def ranks_needed(section: str, args: argparse.Namespace) -> int:
    """Ranks a section runs at once: with --device cuda, one GPU each."""
    return SECTIONS[section].ranks(args)


def run_section(section: str, ctx: Context) -> None:
    """Run one section (after waiting for a quiet machine, if it times runs of its own) while
    watching the load, and save its JSON; on GPUs, skip it where the host has too few."""
    if SECTIONS[section].cuda_only and ctx.args.device != "cuda":
        print(f"[bench] {section}: skipped, it runs on a GPU only (--device cuda)", flush=True)
        return
    if ctx.args.device == "cuda":
        import torch

        need, have = ranks_needed(section, ctx.args), torch.cuda.device_count()
        if have < need:  # its JSON (an earlier run on more GPUs) stays as it is
            print(f"[bench] {section}: skipped, it needs {need} GPUs (NCCL puts one rank on each) and this host "
                  f"has {have}", flush=True)
            return
    ctx.waits = []
    if SECTIONS[section].times_runs:  # scaling waits only if it has to run the efficiency sweep itself
        ctx.quiet(section)
    started = time.time()
    print(f"[bench] {section}: started {time.strftime('%H:%M:%S')}", flush=True)
    with LoadMonitor() as monitor:
        ctx.monitor = monitor
        try:
            results = SECTIONS[section].run(ctx)
        finally:
            ctx.monitor = None
    duration = time.time() - started
    path = save(ctx.args.results, section, results, ctx, started=started, duration_s=round(duration, 1),
                load=monitor.report)
    print(f"[bench] {section}: {duration:.0f} s -> {path}", flush=True)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=bench.__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", choices=list(SECTIONS), default=list(SECTIONS), metavar="SECTION",
                        help=f"sections to run (default: all): {', '.join(SECTIONS)}")
    parser.add_argument("--render", action="store_true", help="run nothing; re-render from the JSON files")
    parser.add_argument("--pp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--microbatches", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--steps", type=int, default=4, help="steps per efficiency run (bubble over steps 1..)")
    parser.add_argument("--option-steps", type=int, default=8)
    parser.add_argument("--option-repeats", type=int, default=2)
    parser.add_argument("--profile-steps", type=int, default=10)
    parser.add_argument("--overhead-steps", type=int, default=8)
    parser.add_argument("--checkpoint-steps", type=int, default=12, help="steps per run of the checkpoint section")
    parser.add_argument("--repeats", type=int, default=3, help="repeats of profiling, startup and overhead")
    parser.add_argument("--planner-rounds", type=int, default=5, help="rounds of plan + every (schedule, m) run")
    parser.add_argument("--planner-sizes", nargs="+", choices=list(PLANNER_SIZES), default=list(PLANNER_SIZES))
    parser.add_argument("--planner-steps", type=int, default=None, help="steps per run (default: per size)")
    parser.add_argument("--planner-microbatches", type=int, nargs="+", default=None,
                        help="m values of the benchmark size (default 4 8)")
    parser.add_argument("--synthesis-rounds", type=int, default=4, help="alternating rounds of every configuration")
    parser.add_argument("--synthesis-steps", type=int, default=16)
    parser.add_argument("--sync-steps", type=int, default=12, help="steps per run of the optimizer_sync section")
    parser.add_argument("--sync-repeats", type=int, default=2,
                        help="alternating rounds of zbh2 in three modes and the synthesized order in two")
    parser.add_argument("--quick", action="store_true",
                        help="planner and synthesis on tiny models, one round of 3 steps, results into the work "
                             "directory: checks that the sections run, measures nothing worth keeping")
    parser.add_argument("--max-wait", type=float, default=1200.0,
                        help="seconds to wait for a quiet machine before each long run (0: do not wait)")
    parser.add_argument("--rerun-loaded", action=argparse.BooleanOptionalAction, default=True,
                        help="re-run (once, after waiting) efficiency and options runs that shared the machine")
    parser.add_argument("--baseline-root", type=Path, default=None,
                        help="ending: also run the runner of this checkout (an earlier commit), alternating")
    parser.add_argument("--work", type=Path, default=None, help="where the runs go (default: a temp dir)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="cuda: every section whose ranks fit this host's GPUs (one GPU: only `device`)")
    parser.add_argument("--results", type=Path, default=None,
                        help="default: benchmarks/ (cpu), benchmarks/cuda/ (cuda)")
    parser.add_argument("--output", type=Path, default=None, help="default: BENCHMARKS.md (cpu), BENCHMARKS-cuda.md")
    args = parser.parse_args(argv)
    if args.quick:
        args.planner_rounds, args.planner_steps, args.synthesis_rounds, args.synthesis_steps = 1, 3, 1, 3
        args.work = args.work or Path(tempfile.mkdtemp(prefix="runner-bench-quick-"))
        args.results = args.results or args.work / "results"
        args.output = args.output or args.work / "BENCHMARKS.md"
    cuda = args.device == "cuda"  # GPU numbers never mix with the CPU ones
    args.results = args.results or ROOT / "benchmarks" / ("cuda" if cuda else "")
    args.output = args.output or ROOT / ("BENCHMARKS-cuda.md" if cuda else "BENCHMARKS.md")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if not args.render:
        work = args.work or Path(tempfile.mkdtemp(prefix="runner-bench-"))
        work.mkdir(parents=True, exist_ok=True)
        ctx = Context(args, work)
        for section in [s for s in SECTIONS if s in args.only]:
            run_section(section, ctx)
            render(args.results, args.output)  # after each section: an interrupted run keeps what it has
    print(render(args.results, args.output))
