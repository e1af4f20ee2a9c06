"""``python -m runner rehearse=on ...``: the run's ranks rehearsed one at a time on this host.

1. ``check_rehearsal``: the ``rehearse`` keys against the layout and this host, then the run's own
   ``validate`` (as for one rank on this host: each rehearsed rank runs alone), before anything is
   built;
2. the rehearsed ranks in turn, alone, in one spawned process (``runner.rehearse.rank``: the imports
   paid once), each at the run's full world size over the rehearsal process group: memory and time
   at the run's sequence; or memory only (``rehearse.memory_only``); or memory at the run's sequence
   and times at ``rehearse.time_seq_len``, scaled (``runner.rehearse.scale``), or fitted with times at
   ``rehearse.time_fit_seq_len`` too;
3. ``runner.rehearse.compose``: the whole step predicted from them (its MFU where the device's peak is
   known), and each rank's memory against ``rehearse.capacity``; ``rehearsal.json`` in the run
   directory, the composed step's simulated timeline beside it (``rehearsal_timeline.json``, a chrome
   trace, and ``rehearsal_timeline.png``), each rank's chrome trace under ``rehearsal/rank<r>/``, and a
   table."""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import multiprocessing
import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from omegaconf import DictConfig

from runner.config import parse_bytes
from runner.errors import ConfigError, DoesNotFitError, RankFailedError
from runner.layout import ResolvedRun
from runner.parallel.dims import Coords, ParallelDims
from runner.plan.link import configured_link
from runner.rehearse.config import RehearseConfig

__all__ = ["check_rehearsal", "default_ranks", "rehearse", "rehearse_ranks", "format_rehearsal",
           "raise_if_over_capacity", "RehearsalPlan", "SYMMETRY", "TIMES"]

log = logging.getLogger(__name__)

SYMMETRY = ("tp shards and dp replicas are assumed to do what the rehearsed rank of their pipeline rank does "
            "(same shapes, same collectives); only the ranks listed were run")
RANK_TIMEOUT_S = 3600
RunJobs = Callable[[list[tuple]], list[dict]]  # rank_main's jobs -> their results
# What the report's times are, by RehearsalPlan.times (rehearsal.json's "times", the table's "times:" line).
TIMES = {"measured": "measured: each rank's timed step at train.seq_len",
         "scaled": "estimated: measured at rehearse.time_seq_len={short} and scaled to train.seq_len={long} ({rule})",
         "fitted": "estimated: measured at rehearse.time_fit_seq_len={fit} and rehearse.time_seq_len={short}, "
                   "fitted to train.seq_len={long} ({rule})",
         "none": "not measured (rehearse.memory_only=true): memory, held bytes and collectives only, no composed step"}


def default_ranks(dims: ParallelDims) -> list[int]:
    """One rank per pipeline rank: its dp=0, tp=0 rank."""
    return [dims.rank_of(Coords(pp=p, dp=0, tp=0)) for p in range(dims.pp)]


@contextmanager
def _one_rank_on_host() -> Iterator[None]:
    """``validate`` sizes the host's share (threads, GPUs) by the ranks on it: one, here."""
    before = os.environ.get("LOCAL_WORLD_SIZE")
    os.environ["LOCAL_WORLD_SIZE"] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("LOCAL_WORLD_SIZE", None)
        else:
            os.environ["LOCAL_WORLD_SIZE"] = before


@dataclass(frozen=True)
class RehearsalPlan:
    """What ``check_rehearsal`` resolved: the run, the ranks, the capacity (bytes, or None), and each
    rank's passes (``runner.rehearse.rank.RankPass``): one at the run's length, or with
    ``rehearse.time_seq_len`` a memory pass at it and a time pass at ``short`` (the run resolved at
    the short sequence, with its config; ``fit``: the same at ``rehearse.time_fit_seq_len``)."""

    resolved: ResolvedRun
    ranks: list[int]
    capacity: int | None
    short: tuple[ResolvedRun, DictConfig] | None = None
    memory_only: bool = False
    fit: tuple[ResolvedRun, DictConfig] | None = None

    @property
    def times(self) -> str:
        """How the times were had: ``measured``, ``scaled`` or ``none``."""
        return "none" if self.memory_only else "scaled" if self.short else "measured"


def _check_keys(cfg: DictConfig) -> None:
    """The ``rehearse`` keys alone, and against the device; the link the step is composed on."""
    import torch

    configured_link(cfg.plan.comm_latency_s, cfg.plan.comm_bandwidth)  # compose_step's, read after the ranks
    r = cfg.rehearse
    if r.memory_only and r.time_seq_len is not None:
        raise ConfigError(f"rehearse.memory_only=true with rehearse.time_seq_len={r.time_seq_len}: a memory-only "
                          "rehearsal times nothing. Fix: one of them (rehearse.time_seq_len=null, or "
                          "rehearse.memory_only=false).")
    if not r.memory_only and r.steps < 2:
        raise ConfigError(f"rehearse.steps={r.steps}: a rehearsal tracks memory over all its steps but the last and "
                          "times the last, so it needs two. Fix: rehearse.steps=2, or rehearse.memory_only=true "
                          "(one step, memory only).")
    if r.memory_only and r.steps != RehearseConfig.steps:
        log.warning("rehearse.steps=%s is not used by rehearse.memory_only=true (one tracked step per rank)", r.steps)
    if r.time_seq_len is not None and not 0 < r.time_seq_len < cfg.train.seq_len:
        raise ConfigError(f"rehearse.time_seq_len={r.time_seq_len}: times are measured at a sequence shorter than "
                          f"the run's (train.seq_len={cfg.train.seq_len}) and scaled to it. Fix: a length from 1 "
                          f"to {cfg.train.seq_len - 1} (e.g. {max(1, cfg.train.seq_len // 8)}), or "
                          "rehearse.time_seq_len=null (times at train.seq_len).")
    _check_fit_key(cfg)
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device=cuda: a rehearsal runs each rank on this host's device, and this host has no GPU. "
                          "Fix: device=cpu (or device=auto), or rehearse on a host with a GPU.")


def _check_fit_key(cfg: DictConfig) -> None:
    """``rehearse.time_fit_seq_len``: with ``rehearse.time_seq_len``, and shorter than it."""
    r = cfg.rehearse
    if r.time_fit_seq_len is None:
        return
    if r.time_seq_len is None:
        raise ConfigError(f"rehearse.time_fit_seq_len={r.time_fit_seq_len} without rehearse.time_seq_len: the fit "
                          "is drawn through the times at both. Fix: rehearse.time_seq_len=<a longer length> (e.g. "
                          f"{2 * r.time_fit_seq_len}), or rehearse.time_fit_seq_len=null.")
    if not 0 < r.time_fit_seq_len < r.time_seq_len:
        raise ConfigError(f"rehearse.time_fit_seq_len={r.time_fit_seq_len}: the fit's second length must be shorter "
                          f"than rehearse.time_seq_len={r.time_seq_len}. Fix: a length from 1 to {r.time_seq_len - 1} "
                          f"(e.g. {max(1, r.time_seq_len // 2)}), or rehearse.time_fit_seq_len=null.")


def _short_run(cfg: DictConfig, run_dir: Path | None, key: str = "time_seq_len") -> tuple[ResolvedRun, DictConfig]:
    """The run resolved at ``rehearse.<key>``: the run's own checks, the error naming the key."""
    from runner.validate import validate

    short = copy.deepcopy(cfg)
    short.train.seq_len = cfg.rehearse[key]
    try:
        with _one_rank_on_host():
            return validate(short, run_dir), short
    except ConfigError as e:
        said, _, fix = str(e).partition(" Fix: ")
        raise ConfigError(f"rehearse.{key}={cfg.rehearse[key]}: the run's checks refuse that sequence "
                          f"(times are measured at it as train.seq_len): {said} Fix: a rehearse.{key} they take "
                          f"(what they ask of train.seq_len: {fix.rstrip('.') or 'see above'}), or "
                          f"rehearse.{key}=null.") from e


def check_rehearsal(cfg: DictConfig, run_dir: Path | None) -> RehearsalPlan:
    """The resolved run, the ranks to rehearse, the capacity (bytes) and the passes, or a
    ``ConfigError`` naming the key, the value and the fix; nothing is built before these pass."""
    import torch

    from runner.validate import validate

    r = cfg.rehearse
    dims = ParallelDims.from_config(cfg.parallel)
    _check_keys(cfg)
    ranks = list(r.ranks) if r.ranks is not None else default_ranks(dims)
    outside = [x for x in ranks if not 0 <= x < dims.world_size]
    if outside or not ranks:
        raise ConfigError(f"rehearse.ranks={list(ranks)}: {outside or 'no rank'} outside this run's ranks "
                          f"0..{dims.world_size - 1} ({dims.describe()}). Fix: ranks from 0 to {dims.world_size - 1}, "
                          "or rehearse.ranks=null (one per pipeline rank).")
    try:
        capacity = parse_bytes("rehearse.capacity", r.capacity)
    except ConfigError as e:
        raise ConfigError(f"{str(e).split(' Fix:')[0]} Fix: rehearse.capacity=<bytes> as a number (80e9) or with a "
                          "unit (80GB, 80GiB), or null (no verdict).") from e
    if capacity is None and cfg.device != "cpu" and torch.cuda.is_available():
        capacity = torch.cuda.get_device_properties(0).total_memory
    with _one_rank_on_host():
        resolved = validate(cfg, run_dir)
    short = _short_run(cfg, run_dir) if r.time_seq_len is not None else None
    fit = _short_run(cfg, run_dir, "time_fit_seq_len") if r.time_fit_seq_len is not None else None
    return RehearsalPlan(resolved, ranks, capacity, short, bool(r.memory_only), fit)


def _jobs(plan: RehearsalPlan, cfg: DictConfig, run_dir: Path) -> list[tuple]:
    """``rank_main``'s jobs: per rank, its pass at the run's length, then where times are scaled its
    time pass at the short length (into ``rank<r>-time``), and where they are fitted one at the
    shorter length (``rank<r>-fit``)."""
    from runner.rehearse.rank import RankPass

    profiled = bool(cfg.profile.enabled)
    steps = cfg.rehearse.steps
    jobs = []
    for rank in plan.ranks:
        at = run_dir / "rehearsal" / f"rank{rank}"
        if plan.times == "measured":
            jobs.append((plan.resolved, cfg, rank, RankPass(tracked=steps - 1, timed=True, profiled=profiled),
                         at, at.with_suffix(".json")))
            continue
        jobs.append((plan.resolved, cfg, rank, RankPass(tracked=1, timed=False, profiled=False), at,
                     at.with_suffix(".json")))
        for suffix, run in (("time", plan.short), ("fit", plan.fit)):
            if run is not None:
                time_at = at.with_name(f"rank{rank}-{suffix}")
                jobs.append((*run, rank, RankPass(tracked=0, warmup=steps - 1, timed=True,
                                                  profiled=profiled and suffix == "time"),
                             time_at, time_at.with_suffix(".json")))
    return jobs


def _run_ranks(jobs: list[tuple]) -> list[dict]:
    """The jobs in turn in one spawned process (``runner.rehearse.rank.rank_main``); their results."""
    from runner.rehearse.rank import rank_main  # the training code: only when a rank is rehearsed

    for job in jobs:
        job[-1].parent.mkdir(parents=True, exist_ok=True)
        job[-1].unlink(missing_ok=True)
    process = multiprocessing.get_context("spawn").Process(target=rank_main, args=(jobs,), name="rehearse-ranks")
    process.start()
    process.join(RANK_TIMEOUT_S * len(jobs))
    if process.is_alive():
        process.kill()
        process.join()
    missing = [job for job in jobs if not job[-1].is_file()]
    if missing or process.exitcode != 0:
        rank = missing[0][2] if missing else jobs[-1][2]
        raise RankFailedError(f"the rehearsal of rank {rank} failed (exit code {process.exitcode}); its traceback "
                              f"is above. Fix: run it alone with rehearse.ranks=[{rank}] to see it.")
    return [json.loads(job[-1].read_text()) for job in jobs]


def _merge_times(memory: dict, timed: dict, ratios: dict[str, float], short_seq_len: int) -> dict:
    """A rank's memory pass (at the run's length) with its time pass's times (at ``short_seq_len``),
    scaled (``runner.rehearse.scale``)."""
    from runner.rehearse.scale import SCALING_RULE, scale_times

    return {**memory, "actions": scale_times(timed["actions"], ratios), "optimizer_s": timed["optimizer_s"],
            "update_s": timed["update_s"], "snapshot_s": timed["snapshot_s"], "trace": timed["trace"],
            "profiled_step": timed["profiled_step"],
            "times": {"measured_at_seq_len": short_seq_len, "scaled_to_seq_len": memory["seq_len"],
                      "measured_step_s": timed["step_s"], "rule": SCALING_RULE,
                      "ratios": {k: ratios[k] for k in sorted({f"{a['stage']}{a['kind']}" for a in timed["actions"]})},
                      "wall_s": timed["wall_s"]}}


def _merge_fitted(memory: dict, timed: dict, shorter: dict, ratios: dict[str, float],
                  shorter_ratios: dict[str, float], short_seq_len: int, shorter_seq_len: int) -> dict:
    """A rank's memory pass with its time pass's times scaled by the fit through them and the
    shorter time pass's (``runner.rehearse.scale.fit_ratios``); ``times`` says both lengths, the
    rule, each stage and kind's fit and FLOP ratio."""
    from runner.rehearse.scale import FIT_RULE, fit_ratios

    fit = fit_ratios(timed["actions"], shorter["actions"], ratios, shorter_ratios)
    merged = _merge_times(memory, timed, {k: v["ratio"] for k, v in fit.items()}, short_seq_len)
    merged["times"].update(rule=FIT_RULE, fit_seq_len=shorter_seq_len, fit=fit,
                           flop_ratios={k: ratios[k] for k in fit}, fit_measured_step_s=shorter["step_s"])
    return merged


def rehearse_ranks(plan: RehearsalPlan, cfg: DictConfig, run_dir: Path, run_jobs: RunJobs | None = None) -> list[dict]:
    """Every rank's result: measured, or with scaled (or fitted) times merged in. ``run_jobs`` runs
    ``rank_main``'s jobs and returns their results (default: in one spawned process)."""
    results = (run_jobs or _run_ranks)(_jobs(plan, cfg, run_dir))
    if plan.short is None:
        return results
    from runner.rehearse.scale import flop_ratios

    ratios = flop_ratios(cfg, plan.resolved, plan.short[0].seq_len)
    if plan.fit is None:
        return [_merge_times(m, t, ratios, plan.short[0].seq_len) for m, t in zip(results[::2], results[1::2])]
    shorter_ratios = flop_ratios(cfg, plan.resolved, plan.fit[0].seq_len)
    return [_merge_fitted(m, t, f, ratios, shorter_ratios, plan.short[0].seq_len, plan.fit[0].seq_len)
            for m, t, f in zip(results[::3], results[1::3], results[2::3])]


def _device_name(resolved: ResolvedRun) -> str | None:
    import torch

    return torch.cuda.get_device_name(0) if resolved.device == "cuda" else None


def _write_timeline(run_dir: Path, resolved: ResolvedRun, timeline: list, step: dict[str, Any]) -> None:
    """The composed step's simulated pipeline beside ``rehearsal.json``: a chrome trace and a picture."""
    from runner.outputs.timeline import plot_schedule, simulated_slices, write_chrome_trace

    ranks = sorted({a.rank for a in timeline})
    write_chrome_trace(run_dir / "rehearsal_timeline.json", simulated_slices(timeline), ranks=ranks)
    layout = resolved.layout
    ms = [dataclasses.replace(a, start=a.start * 1e3, end=a.end * 1e3) for a in timeline]
    plot_schedule(run_dir / "rehearsal_timeline.png", ms, xlabel="time (ms), rehearsed costs simulated",
                  title=f"rehearsal, pp={resolved.pp} x dp={resolved.dp} x tp={resolved.dims.tp}: {layout.schedule}, "
                        f"{layout.microbatches} microbatches, composed pipeline {step['pipeline_s'] * 1e3:.1f} ms")


def _times(plan: RehearsalPlan) -> str:
    from runner.rehearse.scale import FIT_RULE, SCALING_RULE

    short = plan.short[0].seq_len if plan.short else None
    if plan.fit is not None:
        return TIMES["fitted"].format(fit=plan.fit[0].seq_len, short=short, long=plan.resolved.seq_len, rule=FIT_RULE)
    return TIMES[plan.times].format(short=short, long=plan.resolved.seq_len, rule=SCALING_RULE)


def _composed(report: dict[str, Any], plan: RehearsalPlan, cfg: DictConfig, run_dir: Path) -> None:
    """The composed step into ``report`` (and its timeline beside it), or why there is none."""
    from runner.rehearse.compose import compose_step, step_mfu

    resolved, results = plan.resolved, report["ranks"]
    missing = sorted(set(range(resolved.pp)) - {r["coords"]["pp"] for r in results})
    report["step"] = None
    if plan.memory_only:
        report["step_missing"] = "rehearse.memory_only=true: nothing was timed"
    elif missing:
        report["step_missing"] = (f"pipeline ranks {missing} were not rehearsed: "
                                  "no composed step (rehearse.ranks=null rehearses one of each)")
    else:
        step, timeline = compose_step(resolved, results, latency_s=cfg.plan.comm_latency_s,
                                      bandwidth=cfg.plan.comm_bandwidth)
        step.update(step_mfu(cfg, resolved, step["step_s"], _device_name(resolved)))
        step["times"] = plan.times
        _write_timeline(run_dir, resolved, timeline, step)
        report["step"], report["timeline"] = step, ["rehearsal_timeline.json", "rehearsal_timeline.png"]


def rehearse(cfg: DictConfig, run_dir: Path, run_jobs: RunJobs | None = None) -> dict[str, Any]:
    """Rehearse the run of ``cfg`` (see the module's docstring); returns what ``rehearsal.json``
    holds. ``run_jobs``: as ``rehearse_ranks`` takes it (the tests' in-process ranks)."""
    from runner.rehearse.compose import memory_verdicts

    plan = check_rehearsal(cfg, run_dir)
    resolved = plan.resolved
    results = rehearse_ranks(plan, cfg, run_dir, run_jobs)
    for r in results:
        r["trace"] = r["trace"] and os.path.relpath(r["trace"], run_dir)
    report: dict[str, Any] = {
        "layout": resolved.dims.describe(), "world_size": resolved.world_size, "device": resolved.device,
        "schedule": resolved.layout.schedule, "microbatches": resolved.layout.microbatches,
        "seq_len": resolved.seq_len, "times": plan.times, "times_are": _times(plan), "ranks": results,
        "assumption": SYMMETRY, "capacity_bytes": plan.capacity,
        "memory": memory_verdicts(results, plan.capacity, resolved.dims),
    }
    report["fits"] = None if plan.capacity is None else report["memory"] == ["fits"]
    _composed(report, plan, cfg, run_dir)
    (run_dir / "rehearsal.json").write_text(json.dumps(report, indent=1))
    return report


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def format_rehearsal(report: dict[str, Any]) -> str:
    """The terminal's table: one row per rehearsed rank, then the composed step and the verdict."""
    mib = 2**20
    lines = [f"rehearsal of {report['layout']} ({report['world_size']} ranks, {report['device']}, "
             f"schedule={report['schedule']}, {report['microbatches']} microbatches)",
             f"{'rank':>5} {'pp,dp,tp':>9} {'params MiB':>11} {'grads MiB':>10} {'optim MiB':>10} "
             f"{'act+rest MiB':>13} {'peak MiB':>9} {'F+B+I+W s':>10} {'optim s':>8} {'collectives':>12}"]
    for r in report["ranks"]:
        p, c = r["peak_bytes"], r["coords"]
        held = r["held_bytes"]
        n_coll = sum(k["count"] for kinds in r["collectives"].values() for k in kinds.values())
        lines.append(f"{r['rank']:>5} {c['pp']:>3},{c['dp']},{c['tp']:<3} {held['params'] / mib:>11.2f} "
                     f"{held['grads'] / mib:>10.2f} {held['optimizer_state'] / mib:>10.2f} "
                     f"{p['activations_and_rest'] / mib:>13.2f} {p['total'] / mib:>9.2f} "
                     f"{_seconds(r['actions'] and sum(a['seconds'] for a in r['actions'])):>10} "
                     f"{_seconds(r['optimizer_s']):>8} {n_coll:>12}")
    step = report.get("step")
    if step:
        lines.extend(_step_lines(step))
    else:
        lines.append(f"composed step: none ({report.get('step_missing')})")
    lines.append(f"times: {report['times_are']}")
    lines.append("memory: " + "; ".join(report["memory"]) + " (measured at train.seq_len)")
    lines.append(f"assumed: {report['assumption']}")
    return "\n".join(lines)


def _step_lines(step: dict[str, Any]) -> list[str]:
    """The composed step the run's ``train.optimizer_sync`` takes, with tokens/s and MFU from it;
    under ``deferred`` the barrier's step above it, each labelled."""
    scaled = " (from scaled times: an estimate)" if step.get("times") == "scaled" else ""
    sync = step.get("optimizer_sync", "barrier")
    rate = (f"{step['tokens_per_s']:.0f} tokens/s, "
            + (f"MFU {step['mfu']:.1%} of {step['peak_of']}" if step.get("mfu") is not None
               else f"MFU unknown ({step.get('mfu_unknown')})"))
    meet = "; ".join("/".join(map(str, m["ranks"])) for m in step.get("tied_meetings", []))
    tied = f", tied weights' gradient sums {step['tied_s'] * 1e3:.2f} ms (pipeline ranks {meet} meet)" if meet else ""
    parts = (f"pipeline {step['pipeline_s']:.3f} s{tied}, collectives {step['collectives_s']:.3f} s, optimizer "
             f"{step['optimizer_s']:.3f} s), bubble {step['bubble']:.1%}")
    deferred = step.get("deferred")
    if deferred is None:
        label = "" if sync == "barrier" else f", train.optimizer_sync={sync}: each rank's update with its snapshot"
        return [f"composed step{scaled}: {step['step_s']:.3f} s ({parts}{label}, {rate}"]
    updates = ", ".join(f"{p}: {v * 1e3:.1f} ms" for p, v in deferred["update_s"].items())
    tied = "".join(f"; pipeline ranks {'/'.join(map(str, m['ranks']))} meet to sum a tied weight's gradient: "
                   f"{m['seconds'] * 1e3:.2f} ms" for m in deferred.get("tied_meetings", []))
    return [f"composed barrier step{scaled} (train.optimizer_sync=barrier): {step['barrier_step_s']:.3f} s ({parts}",
            f"composed deferred steady step{scaled} (train.optimizer_sync=deferred, the run's): "
            f"{deferred['step_s']:.3f} s (pipeline {deferred['pipeline_s']:.3f} s with steps overlapping, then each "
            f"pipeline rank's update between its own steps, by pipeline rank: {updates}{tied}; the all-reduce waited a "
            f"step later), bubble {deferred['bubble']:.1%}, {rate}"]


def raise_if_over_capacity(report: dict[str, Any]) -> None:
    """A ``DoesNotFitError`` (exit 3) naming every rank over ``rehearse.capacity``, after the table
    and ``rehearsal.json`` are written; nothing where every rank fits or no capacity was given."""
    if report["fits"] is False:
        raise DoesNotFitError(f"the layout {report['layout']} does not fit rehearse.capacity: "
                              + "; ".join(report["memory"]) + " (rehearsal.json holds every rank's peak)")
