"""Profiling a run: the torch profiler over a window of steady-state steps, the action recorder
over the same steps, and, at the end, the files that show the schedule as it ran (rank 0).

Steps outside the window pay nothing but a flag check per compute call and ``prof.step()``.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import sys
import tempfile
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch.profiler import ProfilerActivity

from runner.layout import Layout
from runner.outputs.collectives import Collective, tp_collectives
from runner.outputs.plot_timeline import draw as draw_timeline
from runner.outputs.timeline import (
    clock_offsets,
    executed_order,
    host_clock,
    mean_costs,
    measured_bubble,
    measured_slices,
    pipeline_spans,
    plot_schedule,
    shift,
    simulated_slices,
    steady_bubble,
    write_chrome_trace,
    write_schedule_csv,
)
from runner.pipeline.recorder import Recorder
from runner.pipeline.registry import theoretical_bubble
from runner.pipeline.simulate import UNIT_COSTS, bubble_fractions, compute_floor, simulate, steady_step
from runner.ranks.dist import DistEnv, gather_to_main

if TYPE_CHECKING:
    from runner.outputs.config import ProfileConfig

__all__ = ["Window", "plan_window", "RunProfiler"]

log = logging.getLogger("runner.profile")  # named as before runner/ became packages (runner.log)


@dataclass(frozen=True)
class Window:
    wait: int
    warmup: int
    active: int

    @property
    def first(self) -> int:
        return self.wait + self.warmup

    @property
    def last(self) -> int:
        return self.first + self.active - 1


def plan_window(wait: int, warmup: int, active: int, steps: int) -> tuple[Window, bool]:
    """The profiled steps, shrunk to fit a short run: ``active`` first (at least one step), then
    warm-up, then the steps skipped before it. Returns the window and whether it was clamped."""
    active_ = max(1, min(active, steps))
    warmup_ = min(warmup, steps - active_)
    wait_ = min(wait, steps - active_ - warmup_)
    window = Window(wait_, warmup_, active_)
    return window, window != Window(wait, warmup, active)


class _NativeLines:
    """What torch's profiler library (kineto) prints while the profiler starts, steps and stops,
    routed into the log: its ``USDT: ... profiler_start/stop`` and ``STAGE:`` markers at debug
    level (once per rank and run they are noise on the console), anything else, an error, as a
    warning. Kineto writes to file descriptor 2 from C++, past ``sys.stderr``; its own log level
    cannot drop the markers without dropping its errors (it ranks them above errors)."""

    def __init__(self) -> None:
        self._file = tempfile.TemporaryFile()

    @contextmanager
    def routed(self) -> Iterator[None]:
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(self._file.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            self._file.seek(0)
            text = self._file.read().decode(errors="replace")
            self._file.seek(0)
            self._file.truncate()
            for line in text.splitlines():
                (log.debug if line.startswith(("USDT:", "STAGE:")) else log.warning)("torch profiler: %s", line)

    def close(self) -> None:
        self._file.close()


def _steady(actions, spans, order, costs, num_stages: int, interrupted) -> dict:
    """The bubble over several steps, overlapping or not (``steady_bubble``; the gaps after
    ``interrupted`` steps left out), beside the simulator's steady step for the order as run without
    the barrier (``steady_step``) and its floor (``compute_floor``): ``{"steady": ...}``, or nothing
    with fewer than 2 consecutive recorded steps."""
    measured = steady_bubble(actions, spans, interrupted)
    if measured is None:
        return {}
    period_ns, per_rank, overlapped = measured
    simulated_s, _ = steady_step(order, costs, num_stages=num_stages)
    return {"steady": {"step_s": period_ns / 1e9, "per_rank": per_rank, "mean": sum(per_rank) / len(per_rank),
                       "overlapped_steps": overlapped, "simulated_step_s": simulated_s,
                       "floor_s": compute_floor(order, costs)}}


class RunProfiler:
    def __init__(self, profile_cfg: ProfileConfig, *, steps: int, env: DistEnv, run_dir: Path, first_step: int = 1,
                 tp: int = 1):
        """``steps`` this run trains, numbered from ``first_step`` (1, or N + 1 after resuming
        from step N); at ``tp`` > 1 the timeline gets each rank's tensor-parallel collectives. On
        a CUDA device the recorder times its spans by CUDA events (``runner.pipeline.recorder``)."""
        self.enabled = profile_cfg.enabled
        self.tp = tp
        self.collectives: list[Collective] = []
        self.env = env
        self.run_dir = run_dir
        self.window, clamped = plan_window(profile_cfg.wait, profile_cfg.warmup, profile_cfg.active, steps)
        if clamped and env.is_main:
            log.info("profile window clamped to %d steps: wait=%d warmup=%d active=%d", steps,
                     self.window.wait, self.window.warmup, self.window.active)
        self.recorder = Recorder(partial(torch.cuda.Event, enable_timing=True) if env.device.type == "cuda" else None)
        self._step = 0  # the step begin_step last saw
        self.clock = host_clock()  # to place this host's clock next to rank 0's
        self.torch_profiler = None
        if self.enabled:
            activities = [ProfilerActivity.CPU]
            if env.device.type == "cuda":
                activities.append(ProfilerActivity.CUDA)
            with warnings.catch_warnings():  # a short run's window has no warm-up: the log line above says so
                warnings.filterwarnings("ignore", message="Profiler won't be using warmup")
                schedule = torch.profiler.schedule(wait=self.window.wait, warmup=self.window.warmup,
                                                   active=self.window.active, repeat=1, skip_first=first_step)
            self.torch_profiler = torch.profiler.profile(activities=activities, schedule=schedule,
                                                         on_trace_ready=self._export)
            self.native = _NativeLines()
            with self.native.routed():
                self.torch_profiler.start()
                # The profiler counts its steps from 0; advanced to the run's first step (outside its
                # window: nothing recorded), its "ProfilerStep#N" is the run's step N.
                for _ in range(first_step):
                    self.torch_profiler.step()

    def _export(self, prof) -> None:
        traces = self.run_dir / "traces"
        traces.mkdir(exist_ok=True)
        unfinished = traces / f".rank{self.env.rank}.json.partial"
        prof.export_chrome_trace(str(unfinished))
        if self.tp > 1:  # the window's steps are recorded by now: the trace goes on the recorder's clock
            self.recorder.settle()  # (CUDA: its last steps read, one wait for the device as the window ends)
            self.collectives = tp_collectives(json.loads(unfinished.read_text()), self.recorder.actions,
                                              self.recorder.steps)
        os.replace(unfinished, traces / f"rank{self.env.rank}.json")  # a killed run leaves no half trace

    def begin_step(self, step: int) -> None:
        self.recorder.active = self.window.first <= step <= self.window.last
        self._step = step

    def end_step(self) -> None:
        if self.torch_profiler is None:
            return
        # kineto prints as its collection starts (entering warm-up) and ends (after the window):
        # only those steps are routed, so nothing else a rank writes to stderr is ever taken.
        if self.window.wait - 1 <= self._step <= self.window.last + 1:
            with self.native.routed():
                self.torch_profiler.step()
        else:
            self.torch_profiler.step()

    def stop(self, *, trace: bool = True) -> None:
        """Stop the torch profiler (its window's trace is written by then); again, nothing. ``trace``
        False (a failed run): a window still open is dropped, not written (no half trace). torch's
        profiler is the process's: left on by a run that failed in its window, it went on recording
        every op of the process (the caller's and the next runs', twice as slow, its memory growing)."""
        if self.torch_profiler is not None:
            if not trace:
                self.torch_profiler.on_trace_ready = None
            with self.native.routed():
                self.torch_profiler.stop()
            self.native.close()
            self.torch_profiler = None

    def finish(self, layout: Layout, pipeline_ranks: Sequence[int]) -> dict | None:
        """Stop profiling; rank 0 writes the schedule files and returns the bubble summary, from
        the first data-parallel replica (``pipeline_ranks``: its ranks, by pipeline rank)."""
        self.stop()
        self.recorder.settle()  # CUDA: the spans the device has not been seen to pass yet
        gathered = gather_to_main((self.recorder.actions, self.recorder.steps, self.clock, self.collectives), self.env)
        if gathered is None:  # not rank 0
            return None
        first = [gathered[r] for r in pipeline_ranks]  # indexed by pipeline rank
        offsets, clock_note = clock_offsets({rank: clock for rank, (_, _, clock, _) in enumerate(first)})
        actions = {rank: shift(acts, offsets[rank]) for rank, (acts, _, _, _) in enumerate(first)}
        spans = {rank: shift(steps, offsets[rank]) for rank, (_, steps, _, _) in enumerate(first)}
        collectives = {rank: shift(done, offsets[rank]) for rank, (_, _, _, done) in enumerate(first)}
        order = executed_order(actions)
        write_schedule_csv(self.run_dir / "schedule.csv", order)
        costs = mean_costs(actions)
        simulated = simulate(order, costs, num_stages=layout.num_stages)
        per_rank = measured_bubble(actions, spans)
        sim_bubble = bubble_fractions(simulated)
        formula = None if layout.csv else theoretical_bubble(layout.schedule, pp=layout.pp,
                                                             microbatches=layout.microbatches,
                                                             stages_per_rank=layout.stages_per_rank)
        if self.enabled:
            ranks = sorted(actions)
            write_chrome_trace(self.run_dir / "timeline.json", measured_slices(actions, spans, collectives),
                               ranks=ranks, clock=clock_note)
            write_chrome_trace(self.run_dir / "schedule_sim.json", simulated_slices(simulated), ranks=ranks)
            plot_schedule(self.run_dir / "schedule.png", simulate(order, UNIT_COSTS, num_stages=layout.num_stages),
                          title=f"{layout.schedule}: pp={layout.pp}, {layout.num_stages} stages, "
                                f"{layout.microbatches} microbatches (order as run)")
            # The measured step as a picture, what runner-timeline draws (matplotlib is loaded already).
            draw_timeline(self.run_dir, self.run_dir / "timeline.png", about={
                "schedule": layout.schedule, "pp": layout.pp, "microbatches": layout.microbatches})
        sim_mean = sum(sim_bubble.values()) / len(sim_bubble)
        return {
            "per_rank": per_rank,
            "mean": sum(per_rank) / len(per_rank),
            "theoretical": formula if formula is not None else sim_mean,
            "theoretical_source": "formula" if formula is not None else "simulated with measured costs",
            "simulated": sim_mean,
            # The executed order replayed with each action's mean time and nothing else: how much of
            # step_time_s the simulator (and so the planner) can account for.
            "simulated_step_s": max(a.end for a in simulated),
            # The pipeline call alone (median over the recorded steps, first rank in to last out):
            # step_time_s less this is the loss/norm all-reduce, the clip and the optimizer.
            "pipeline_step_s": statistics.median(hi - lo for lo, hi in pipeline_spans(spans).values()) / 1e9,
            "steps": [s.step for s in spans[0]],
            "mean_costs_s": {f"{stage}{kind}": c for (stage, kind), c in sorted(costs.items())},
            # Every rank evaluates and saves after the same steps: this rank's record of them is theirs.
            **_steady(actions, spans, order, costs, layout.num_stages, self.recorder.interrupted),
        }
