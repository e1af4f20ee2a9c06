"""``plan.rehearse=true``: candidates whose layout involves tensor parallelism or FSDP are costed
from a rehearsal of that layout (``python -m runner rehearse=on``, docs/rehearsal.md) instead of
the tp cost model (``runner.plan.tp_cost``).

The planner sits below ``runner.rehearse`` (which imports the planner's device table and FLOP
counts), so it runs each rehearsal as a separate process: ``python -m runner rehearse=on`` with the
run's overrides, the candidate's and the planner's link (``plan.comm_latency_s``/``plan.comm_bandwidth``
from its calibration), into a directory of the plan's, then reads its ``rehearsal.json``. The
candidate's step is then the rehearsal's composed step, recomposed here with the planner's own
message cost: the median measured time of each (stage, F/B/I/W) action, times the calibrated
co-running slowdown (a rehearsed rank runs alone; the run's ranks share the host), replayed by the
simulator in the candidate's order with the planner's message cost per send, the tied weights'
gradient sums where the ranks holding a copy meet after the pipeline (``Layout.tied``, priced by
the calibration as without the barrier), plus the rehearsal's tp/dp collectives on the planner's
link and its slowest rank's optimizer step.

With ``plan.barrier=false`` each rehearsal runs ``train.optimizer_sync=deferred`` (the candidates'
commands do), and a candidate is scored by that mode's steady step instead
(``runner.pipeline.simulate.deferred_step``): the same action costs in its order, each pipeline
rank's update as its rehearsed rank measured it on the deferred path (times the slowdown) with its
tp/dp collectives as the rehearsal put them on the planner's link, the tied weights' gradient sums
where the ranks holding a copy meet (``Layout.tied``, priced by the calibration), and the loss/norm
all-reduce (one message) waited for a step later, as ``runner.plan.planner`` scores the model's
candidates.

Rehearsals are shared by candidates of the same degrees, microbatches, stages per rank and split
whose schedules use the same action kinds (F/B, or F/I/W): the per-action costs depend on the
layout, not on the order."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from omegaconf import DictConfig

from runner.layout import Layout
from runner.pipeline.ops import Op
from runner.pipeline.simulate import simulate
from runner.plan.calibrate import Calibration
from runner.plan.link import tied_meetings
from runner.plan.problem import Problem, lower_bound

__all__ = ["Rehearse", "needs_rehearsal", "rehearsal_key", "link_overrides", "rehearse_by_cli",
           "cost_from_rehearsal", "REHEARSAL_TIMEOUT_S"]

log = logging.getLogger(__name__)

# (the candidate's overrides, the directory to rehearse into) -> the parsed rehearsal.json
Rehearse = Callable[[Sequence[str], Path], dict]
REHEARSAL_TIMEOUT_S = 3600


def needs_rehearsal(cfg: DictConfig) -> bool:
    """A layout the tp cost model would guess at: tp > 1, or FSDP."""
    return int(cfg.parallel.get("tp", 1)) > 1 or cfg.parallel.get("dp_mode") == "fsdp"


def rehearsal_key(overrides: Sequence[str], order: Mapping[int, Sequence[Op]]) -> tuple:
    """Candidates with the same key share a rehearsal: the same layout (their overrides less the
    schedule's name) and the same action kinds."""
    layout = tuple(o for o in overrides if not o.startswith(("schedule=", "schedule.csv=")))
    return layout, "".join(sorted({op.kind for ops in order.values() for op in ops}))


def link_overrides(calibration: Calibration) -> list[str]:
    """The planner's link, for the rehearsal's tp/dp collectives and its own composed step."""
    return [f"plan.comm_latency_s={calibration.latency_s!r}", f"plan.comm_bandwidth={calibration.bandwidth!r}"]


def rehearse_by_cli(run_overrides: Sequence[str]) -> Rehearse:
    """A ``Rehearse`` that runs ``python -m runner rehearse=on`` with ``run_overrides`` (the user's,
    less the planner's own) and the candidate's, and reads the ``rehearsal.json`` it writes."""
    def run(overrides: Sequence[str], run_dir: Path) -> dict:
        command = [sys.executable, "-m", "runner", "rehearse=on", *run_overrides, *overrides,
                   f"hydra.run.dir={run_dir}"]
        log.info("rehearsing: %s", " ".join(command[1:]))
        done = subprocess.run(command, capture_output=True, text=True, timeout=REHEARSAL_TIMEOUT_S, check=False)
        report = run_dir / "rehearsal.json"
        if done.returncode != 0 or not report.is_file():
            lines = (done.stderr or done.stdout).strip().splitlines() or [""]
            said = next((line for line in reversed(lines) if line.startswith("error:")), lines[-1])
            raise RuntimeError(f"exit code {done.returncode}: {said} (its log: {run_dir / 'runner.log'})")
        return json.loads(report.read_text())
    return run


def _stage_costs(step: Mapping[str, Any], slowdown: float) -> dict[tuple[int, str], float]:
    """``rehearsal.json``'s ``step.stage_costs_s`` ("<stage><kind>": seconds) as the simulator's keys."""
    return {(int(key[:-1]), key[-1]): float(v) * slowdown for key, v in step["stage_costs_s"].items()}


def _deferred_updates(step: Mapping[str, Any], slowdown: float) -> dict[int, float]:
    """Each pipeline rank's update between its steps from ``rehearsal.json``'s ``step.deferred``: its
    measured update times the slowdown, and its collectives on the planner's link."""
    deferred = step.get("deferred")
    if not deferred:
        raise ValueError("rehearsal.json has no deferred step (rehearsed without train.optimizer_sync=deferred)")
    return {int(p): float(v) * slowdown + float(deferred["update_collectives_s"][p])
            for p, v in deferred["update_s"].items()}


def cost_from_rehearsal(candidate: Any, layout: Layout, order: dict[int, list[Op]], report: Mapping[str, Any],
                        calibration: Calibration, comm_s: float, saved_bytes: Mapping[int, float],
                        run_dir: Path | None, *, barrier: bool = True) -> list:
    """Replace ``candidate``'s predicted step (``runner.plan.planner.Candidate``, predicted by the
    model first) with the rehearsal's: its per-action costs in the candidate's order with the
    planner's message cost ``comm_s``, plus its collectives and optimizer step; without the
    ``barrier``, ``deferred``'s steady step (the module's docstring). Returns the timeline."""
    step = report.get("step")
    if not step:
        raise ValueError("rehearsal.json has no composed step (not every pipeline rank was rehearsed)")
    costs = _stage_costs(step, calibration.corunning_slowdown)
    missing = sorted({(op.stage, op.kind) for ops in order.values() for op in ops} - set(costs))
    if missing:
        raise ValueError(f"the rehearsal measured no {', '.join(f'{s}{k}' for s, k in missing)} action")
    timeline = simulate(order, costs, num_stages=layout.num_stages, comm_s=comm_s)
    busy = sum(a.end - a.start for a in timeline)
    model_step, meetings = candidate.predicted_step_time_s, tied_meetings(layout.tied, calibration.all_reduce_link())
    if barrier:  # as a modelled candidate (Candidate.score_barrier), with the rehearsed collectives and update
        candidate.score_barrier(order, costs, num_stages=layout.num_stages, pp=layout.pp, comm_s=comm_s,
                                calibration=calibration, busy_s=busy, pipeline_s=max(a.end for a in timeline),
                                rest_s=float(step["collectives_s"]) + float(step["optimizer_s"]), meetings=meetings)
    else:  # as a modelled candidate (Candidate.score_deferred), with the rehearsed updates
        candidate.score_deferred(order, costs, num_stages=layout.num_stages, pp=layout.pp, comm_s=comm_s,
                                 updates=_deferred_updates(step, calibration.corunning_slowdown),
                                 calibration=calibration, busy_s=busy, meetings=meetings)
    candidate.stage_costs_s = {f"{s}{k}": v for (s, k), v in sorted(costs.items())}
    candidate.lower_bound_s = lower_bound(Problem(layout.microbatches, layout.stage_to_rank, costs, comm_s,
                                                  dict(saved_bytes), barrier=barrier))
    candidate.costed_by = "rehearsal"
    candidate.rehearsal = {"dir": str(run_dir) if run_dir else None, "model_step_s": model_step,
                           "rehearsed_step_s": step["step_s"], "collectives_s": step["collectives_s"],
                           "optimizer_s": step["optimizer_s"], "corunning_slowdown": calibration.corunning_slowdown,
                           "scored_by": "barrier" if barrier else "deferred steady step",
                           "message_s": comm_s, "ranks": [r["rank"] for r in report.get("ranks", [])]}
    return timeline
