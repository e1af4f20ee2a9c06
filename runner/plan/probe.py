"""The planner's cost model, and the probes it is fitted to: a few steps of real runs of the model.

Children timed one by one in the planner's process are not what a pipeline's actions cost: in
the runs of the planner section of BENCHMARKS.md, actions took x1.1-1.3 their child timings
(two ranks sharing a host's caches and memory bandwidth, colder caches between actions), and
each run spent time between its actions that the replay of its own action costs does not show
(x0.63-0.85 of the step replayed), growing with the model: predictions from the child timings
alone were 15-27% low at every size. So before it predicts, the planner runs probes: one per
placement its candidates use (a stage per rank: 1F1B; looped stages: interleaved 1F1B; V stages:
ZBV) at the smallest microbatch count, and 1F1B at the largest, on the run's split, and fits four
numbers to them (``Fit``): how much slower forwards and backwards run than timed
(``forward_scale``, ``backward_scale``), what each action costs beyond that and the calibrated
overhead (``gap_s``), and how much longer the step's rest (all-reduce, clip, optimizer) is than
predicted (``rest_scale``). Every candidate is then predicted with them (``layout_costs``,
``rest_s``). ``plan.costs`` (a previous run's directory or ``summary.json``) is fitted instead of
probing.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import statistics
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Mapping, Sequence

from omegaconf import DictConfig, OmegaConf

from runner.errors import ConfigError
from runner.models.split import build_meta_model
from runner.pipeline.ops import Op
from runner.pipeline.schedule import csv_order, schedule_order
from runner.pipeline.simulate import deferred_step, expected_ends, simulate
from runner.plan.calibrate import Calibration
from runner.plan.costs import ChildCost, stage_costs
from runner.plan.link import tied_meetings
from runner.validate import tied_spans, validate

__all__ = ["PROBED", "Fit", "Measured", "Observation", "deferred_steps", "fit", "fitted_model", "layout_costs",
           "predicted_pipelines", "probe_config", "probe_layouts", "probe_steps", "rank_updates", "read_run", "rest_s",
           "run_probe", "sent_bytes"]

log = logging.getLogger(__name__)

# runner.launch.launch: given by the command line, which runs the probes (the planner's own
# modules stay clear of the training stack).
Launch = Callable[..., object]

# One per placement the candidates use, at the smallest microbatch count (its actions, messages
# and runtime path differ), and 1F1B again at the largest: more, smaller actions cost more than
# the smallest count's scale and gap say (in BENCHMARKS.md, without it, predictions at the largest
# count read 10-25% low).
PROBED = (("1f1b", 1), ("interleaved_1f1b", 2), ("zbv", 2))
_MIN_STEPS, _MAX_STEPS = 8, 60  # recorded steps per probe


@dataclass(frozen=True)
class Fit:
    """The cost model: an action costs the calibrated overhead, plus ``gap_s``, plus its child
    timings times the scale of its kind; the step's rest is ``rest_scale`` times predicted.
    Unfitted (no probes): the calibrated co-running slowdown and nothing else."""

    forward_scale: float
    backward_scale: float  # B, I and W
    gap_s: float = 0.0
    rest_scale: float = 1.0
    probes: list[dict] = field(default_factory=list)  # each probe: measured and, fitted, predicted

    @classmethod
    def unfitted(cls, calibration: Calibration) -> Fit:
        return cls(calibration.corunning_slowdown, calibration.corunning_slowdown)

    def scaled_updates(self, updates: Mapping[int, float]) -> dict[int, float]:
        """Each rank's update between its steps (``rank_updates``) as fitted."""
        return {r: self.rest_scale * u for r, u in updates.items()}

    def action_costs(self, compute: Mapping[tuple[int, str], float], overhead_s: float) -> dict[tuple[int, str], float]:
        """Seconds per (stage, kind) action from the child timings' ``compute`` seconds."""
        scale = {"F": self.forward_scale, "B": self.backward_scale, "I": self.backward_scale, "W": self.backward_scale}
        return {(s, k): max(0.0, overhead_s + self.gap_s + v * scale[k]) for (s, k), v in compute.items()}


@dataclass(frozen=True)
class Measured:
    """What a run measured over its recorded (steady) steps."""

    label: str
    stages: list[list[str]]
    microbatches: int
    order: dict[int, list[Op]]  # as executed
    costs_s: dict[tuple[int, str], float]  # mean per (stage, kind)
    pipeline_s: float  # median pipeline call
    step_s: float  # median step
    steady_s: float | None = None  # bubble.steady's step: the ends of the recorded steps, per step
    deferred: bool = False  # it ran train.optimizer_sync=deferred: its steps overlap (steady_s is its step)


@dataclass(frozen=True)
class Observation:
    """A measured run next to what the planner knows of its layout."""

    measured: Measured
    compute: dict[tuple[int, str], float]  # the child timings of its stages (``stage_costs``)
    sent_bytes: int  # the largest message between its stages
    rest_s: float  # the predicted rest of its step, unscaled
    updates_s: dict[int, float] = field(default_factory=dict)  # deferred: each rank's update, unscaled
    meetings: list[tuple[tuple[int, ...], float]] = field(default_factory=list)  # ``tied_meetings``: both modes


def read_run(path: str | Path, label: str | None = None) -> Measured:
    """A run's measurements from its directory (or its ``summary.json``): the recorded window's
    action costs, pipeline span and step times, and the order it executed (``schedule.csv``)."""
    run_dir = Path(path).parent if Path(path).name == "summary.json" else Path(path)
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
        bubble = summary["bubble"]
        order = csv_order(str(run_dir / "schedule.csv"))
        recorded = set(bubble["steps"])
        metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
        steps = [m["step_time_s"] for m in metrics if m["step"] in recorded] or [summary["step_time_s"]]
        return Measured(label or str(run_dir), [list(v) for v in summary["stages"].values()], summary["microbatches"],
                        order, {(int(k[:-1]), k[-1]): v for k, v in bubble["mean_costs_s"].items()},
                        bubble["pipeline_step_s"], statistics.median(steps),
                        (bubble.get("steady") or {}).get("step_s"), _ran_deferred(run_dir))
    except (OSError, KeyError, TypeError, ValueError, RecursionError) as e:  # (a summary nested past Python's limit)
        raise ConfigError(f"plan.costs={str(path)!r} is not a finished run's directory or summary.json ({e}). Fix: "
                          "point it at a run directory (outputs/<date>/<time>) with summary.json, schedule.csv and "
                          "metrics.jsonl, or leave it null to probe.") from e


def _ran_deferred(run_dir: Path) -> bool:
    """Whether the run in ``run_dir`` ran ``train.optimizer_sync=deferred`` (its resolved_config.yaml)."""
    try:
        return OmegaConf.load(run_dir / "resolved_config.yaml").train.optimizer_sync == "deferred"
    except (OSError, AttributeError, ValueError, KeyError):  # an older run's files, or hand-made ones
        return False


def probe_config(cfg: DictConfig, schedule: str, microbatches: int, stages_per_rank: int) -> DictConfig:
    """The run's config as a probe of this placement: its model, split and batch; nothing saved
    or logged; the bubble recorded (profiler off). ``run_probe`` sets the steps. A plan without
    the barrier (``plan.barrier=false``) probes ``train.optimizer_sync=deferred``: what it scores."""
    trial = copy.deepcopy(cfg)
    if not cfg.plan.barrier:
        trial.train.optimizer_sync = "deferred"
    trial.schedule.name, trial.parallel.microbatches, trial.parallel.stages_per_rank = (schedule, microbatches,
                                                                                         stages_per_rank)
    trial.profile.enabled = False
    trial.checkpoint.every, trial.checkpoint.resume, trial.eval.every = 0, None, 0
    trial.logger = {}
    return trial


def probe_layouts(counts: Sequence[int]) -> list[tuple[str, int, int]]:
    """(schedule, stages per rank, microbatches) of each probe, for these microbatch counts."""
    low, high = min(counts), max(counts)
    return [(name, spr, low) for name, spr in PROBED] + ([("1f1b", 1, high)] if high != low else [])


def probe_steps(predicted_step_s: float, seconds: float) -> tuple[int, int]:
    """(steps, recorded): ``seconds`` of recorded steps as predicted (at least 8, at most 60),
    after a third as many skipped (the first steps of a run are slower)."""
    recorded = min(_MAX_STEPS, max(_MIN_STEPS, math.ceil(seconds / max(predicted_step_s, 1e-6))))
    return recorded + max(1, recorded // 3), recorded


def run_probe(launch: Launch, trial: DictConfig, steps: int, recorded: int, run_dir: Path, label: str) -> Measured:
    """Train ``steps`` steps of ``trial`` in ``run_dir`` with ``launch`` (``runner.launch.launch``)
    and read the last ``recorded``."""
    trial = copy.deepcopy(trial)
    trial.train.steps = steps
    trial.profile.wait, trial.profile.warmup, trial.profile.active = steps - recorded, 0, recorded
    run_dir.mkdir(parents=True, exist_ok=True)
    launcher = logging.getLogger("runner.launch")
    level = launcher.level
    launcher.setLevel(logging.WARNING)  # the plan's output is the plan; the probe's lines are in its directory
    try:
        with open(run_dir / "console.log", "w") as console:
            launch(trial, run_dir, console=console)
    finally:
        launcher.setLevel(level)
    return read_run(run_dir, label)


def predicted_pipelines(observations: Sequence[Observation], model: Fit, calibration: Calibration) -> list[float]:
    """Each observation's pipeline as ``model`` predicts it (as the planner predicts candidates)."""
    return [pipeline for pipeline, _ in _predicted_ends(observations, model, calibration)]


def _predicted_ends(observations: Sequence[Observation], model: Fit,
                    calibration: Calibration) -> list[tuple[float, float]]:
    """Each observation's pipeline as ``model`` predicts it, and the end of its tied weights'
    gradient sums after it (``Observation.meetings``; the pipeline's where there are none)."""
    out = []
    for o in observations:
        costs = model.action_costs(o.compute, calibration.action_overhead_s)
        comm = calibration.message_s(o.sent_bytes, min(v for (_, k), v in costs.items() if k == "F"))
        out.append(expected_ends(o.measured.order, costs, num_stages=len(o.measured.stages), comm_s=comm,
                                 jitter=calibration.action_jitter, meetings=o.meetings))
    return out


def fit(observations: Sequence[Observation], calibration: Calibration) -> Fit:
    """The scales from the recorded action costs (beyond the calibrated overhead), pooled over the
    observations; then the per-action gap that makes the predicted pipelines add up to the
    measured ones (the simulated step grows piecewise linearly with it: secant steps); then the
    rest of the step, pooled (with the barrier, less what the tied weights' sums add: modelled)."""
    overhead = calibration.action_overhead_s

    def scale(kinds: str) -> float:
        pairs = [(o.measured.costs_s[key], v) for o in observations for key, v in o.compute.items()
                 if key[1] in kinds and v > 0 and key in o.measured.costs_s]
        planned = sum(v for _, v in pairs)
        if not planned:
            return calibration.corunning_slowdown
        return sum(max(0.0, ran - overhead) for ran, _ in pairs) / planned

    model = Fit(scale("F"), scale("BIW"))
    target = sum(o.measured.pipeline_s for o in observations)
    mean_cost = statistics.fmean(v for o in observations for v in model.action_costs(o.compute, overhead).values())
    gaps, errors = [0.0, 0.1 * mean_cost], []
    for gap in gaps[:2]:
        errors.append(sum(predicted_pipelines(observations, replace(model, gap_s=gap), calibration)) - target)
    for _ in range(3):
        (g0, g1), (e0, e1) = gaps[-2:], errors[-2:]
        if e1 == e0 or abs(e1) <= 1e-4 * target:
            break
        gaps.append(g1 - e1 * (g1 - g0) / (e1 - e0))
        errors.append(sum(predicted_pipelines(observations, replace(model, gap_s=gaps[-1]), calibration)) - target)
    gap = gaps[min(range(len(gaps)), key=lambda i: abs(errors[i]))]
    model = replace(model, gap_s=gap)
    ends = _predicted_ends(observations, model, calibration)
    predicted = [pipeline for pipeline, _ in ends]
    # With the barrier the tied weights' sums follow the measured pipeline: not the rest's to scale.
    met = [end - pipeline for pipeline, end in ends]
    steady: list[tuple[float, float]] = []  # deferred runs: (measured, fitted) steady step
    if all(o.measured.deferred and o.measured.steady_s for o in observations):
        model = replace(model, rest_scale=_deferred_rest_scale(observations, model, calibration))
        steady = [(o.measured.steady_s or 0.0, deferred_steps(o, model, calibration)) for o in observations]
    else:
        rest_run = sum(max(0.0, o.measured.step_s - o.measured.pipeline_s - t) for o, t in zip(observations, met))
        rest_planned = sum(o.rest_s for o in observations)
        model = replace(model, rest_scale=rest_run / rest_planned if rest_run > 0 and rest_planned > 0 else 1.0)
    probes: list[dict] = [{"label": o.measured.label, "microbatches": o.measured.microbatches,
                           "measured_pipeline_s": o.measured.pipeline_s, "measured_step_s": o.measured.step_s,
                           "fitted_pipeline_s": p, "fitted_step_s": p + t + o.rest_s * model.rest_scale}
                          for o, p, t in zip(observations, predicted, met)]
    for probe, (measured, fitted) in zip(probes, steady):  # the steady step, as summary.json's bubble.steady has it
        probe.update(measured_step_s=measured, fitted_step_s=fitted, step="bubble.steady")
    return replace(model, probes=probes)


def deferred_steps(o: Observation, model: Fit, calibration: Calibration) -> float:
    """A deferred run's steady step as ``model`` predicts it (as the planner predicts candidates
    without the barrier: ``runner.pipeline.simulate.deferred_step``)."""
    costs = model.action_costs(o.compute, calibration.action_overhead_s)
    comm = calibration.message_s(o.sent_bytes, min(v for (_, k), v in costs.items() if k == "F"))
    return deferred_step(o.measured.order, costs, num_stages=len(o.measured.stages), comm_s=comm,
                         update_s=model.scaled_updates(o.updates_s), reduce_s=calibration.latency_s,
                         meetings=o.meetings, jitter=calibration.action_jitter)


def _deferred_rest_scale(observations: Sequence[Observation], model: Fit, calibration: Calibration) -> float:
    """The ``rest_scale`` that makes the deferred runs' predicted steady steps add up to their
    measured ones (``bubble.steady``): the updates run between a rank's steps, so the steady step
    grows with them, piecewise linearly (secant steps from 0 and 1; at least 0)."""
    target = sum(o.measured.steady_s or 0.0 for o in observations)

    def error(scale: float) -> float:
        return sum(deferred_steps(o, replace(model, rest_scale=scale), calibration) for o in observations) - target

    scales, errors = [0.0, 1.0], [error(0.0), error(1.0)]
    if errors[0] >= 0:  # the steps need no update time at all: what is left is the model's error elsewhere
        return 0.0
    for _ in range(4):
        (x0, x1), (e0, e1) = scales[-2:], errors[-2:]
        if e1 == e0 or abs(e1) <= 1e-4 * target:
            break
        scales.append(max(0.0, x1 - e1 * (x1 - x0) / (e1 - e0)))
        errors.append(error(scales[-1]))
    return scales[min(range(len(scales)), key=lambda i: abs(errors[i]))]


def sent_bytes(stages: Sequence[Sequence[str]], child: Mapping[str, ChildCost]) -> int:
    return max(sum(child[n].output_bytes for n in names) for names in stages)


def layout_costs(stages: Sequence[Sequence[str]], child: Mapping[str, ChildCost], calibration: Calibration,
                 model: Fit) -> tuple[dict[tuple[int, str], float], float]:
    """Seconds per (stage, F/B/I/W) action of these stages, as ``model`` has it, and per message."""
    costs = model.action_costs(stage_costs(stages, child), calibration.action_overhead_s)
    # A busy sender holds its core for one action at a time: its shortest bounds the delay.
    return costs, calibration.message_s(sent_bytes(stages, child),
                                        min(v for (_, k), v in costs.items() if k == "F"))


def rest_s(rank_stages: Mapping[int, Sequence[int]], stages: Sequence[Sequence[str]],
           child: Mapping[str, ChildCost], calibration: Calibration) -> float:
    """The step after the pipeline, unfitted: the loss/norm all-reduce (one message) and the
    slowest rank's clip and optimizer update."""
    return calibration.latency_s + max(calibration.corunning_slowdown * sum(child[n].update_s for s in on
                                                                             for n in stages[s])
                                       for on in rank_stages.values())


def rank_updates(rank_stages: Mapping[int, Sequence[int]], stages: Sequence[Sequence[str]],
                 child: Mapping[str, ChildCost], calibration: Calibration) -> dict[int, float]:
    """Under ``train.optimizer_sync=deferred``, unfitted: what each rank does between its own steps
    (``runner.train.Trainer._speculate``): its parameters' share of the norm, the snapshot and AdamW."""
    return {r: calibration.corunning_slowdown * sum(child[n].update_s + child[n].snapshot_s
                                                    for s in on for n in stages[s])
            for r, on in rank_stages.items()}


def fitted_model(cfg: DictConfig, calibration: Calibration, child_at: Callable[[int], Mapping[str, ChildCost]],
                 out: Path | None, launch: Launch | None) -> Fit:
    """The cost model: fitted to ``plan.costs`` (a previous run), else to probes of this model
    (``plan.probe_seconds`` > 0), else the calibration alone. ``child_at(m)``: the child timings
    at the microbatch size of m microbatches; ``launch`` runs the probes in ``out`` (without
    both: no probes)."""
    unfitted = Fit.unfitted(calibration)
    if cfg.plan.costs:
        runs = [read_run(cfg.plan.costs)]
    elif cfg.plan.probe_seconds > 0 and launch is not None and out is not None:
        runs = _probe(cfg, calibration, unfitted, child_at, out, launch)
    else:
        return unfitted
    if not runs:
        log.warning("no probe layout is valid for this run: predicting from the calibration alone")
        return unfitted
    observations = []
    meta = build_meta_model(cfg.model, cfg.parallel.get("stage_modules"))  # its tied weights
    for run in runs:
        child = child_at(run.microbatches)
        unknown = sorted({n for names in run.stages for n in names} - set(child))
        if unknown:
            raise ConfigError(f"plan.costs={cfg.plan.costs!r} ran units {unknown} that this model does not have. "
                              "Fix: plan with the run's model overrides, or leave plan.costs null to probe.")
        rank_stages = {r: sorted({op.stage for op in ops}) for r, ops in run.order.items()}
        placed = {s: r for r, on in rank_stages.items() for s in on}
        observations.append(Observation(run, stage_costs(run.stages, child), sent_bytes(run.stages, child),
                                        rest_s(rank_stages, run.stages, child, calibration),
                                        rank_updates(rank_stages, run.stages, child, calibration),
                                        tied_meetings(tied_spans(meta, run.stages, placed, cfg.parallel),
                                                      calibration.all_reduce_link())))
    return fit(observations, calibration)


def _probe(cfg: DictConfig, calibration: Calibration, unfitted: Fit, child_at: Callable[[int], Mapping[str, ChildCost]],
           out: Path, launch: Launch) -> list[Measured]:
    """The probe runs (``probe_layouts``) for the counts of ``plan.microbatches`` that divide the
    batch, each ``plan.probe_seconds`` of steps long as predicted unfitted."""
    replica_batch = cfg.train.batch_size // cfg.parallel.dp
    counts = [m for m in cfg.plan.microbatches if replica_batch % m == 0]
    runs: list[Measured] = []
    for name, spr, m in probe_layouts(counts) if counts else []:
        trial = probe_config(cfg, name, m, spr)
        try:
            layout = validate(trial).layout
        except ConfigError as e:
            log.info("no %s probe: %s", name, str(e).splitlines()[0])
            continue
        child = child_at(m)
        order = schedule_order(name, layout.pp, m, spr)
        costs, comm_s = layout_costs(layout.stages, child, calibration, unfitted)
        predicted = max(a.end for a in simulate(order, costs, num_stages=layout.num_stages, comm_s=comm_s))
        steps, recorded = probe_steps(predicted, cfg.plan.probe_seconds)
        run = run_probe(launch, trial, steps, recorded, out / "probes" / f"{name}_m{m}", f"{name} m={m}")
        step = run.steady_s if run.deferred and run.steady_s else run.step_s  # deferred: bubble.steady's
        print(f"probe: {run.label}, {steps} steps{', deferred' if run.deferred else ''}: {step * 1e3:.2f} ms per "
              f"step (predicted unfitted: "
              f"{predicted * 1e3:.2f} ms of pipeline)", flush=True)
        runs.append(run)
    return runs
