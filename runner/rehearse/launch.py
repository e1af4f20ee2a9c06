"""``python -m runner rehearse=on ...``: the run's ranks rehearsed one at a time on this host.

1. ``check_rehearsal``: the ``rehearse`` keys against the layout and this host, then the run's own
   ``validate`` (as for one rank on this host: each rehearsed rank runs alone), before anything is
   built;
2. each rehearsed rank in a spawned process of its own, in turn (``runner.rehearse.rank``), at the
   run's full world size over the rehearsal process group;
3. ``runner.rehearse.compose``: the whole step predicted from them (its MFU where the device's peak is
   known), and each rank's memory against ``rehearse.capacity``; ``rehearsal.json`` in the run
   directory, the composed step's simulated timeline beside it (``rehearsal_timeline.json``, a chrome
   trace, and ``rehearsal_timeline.png``), each rank's chrome trace under ``rehearsal/rank<r>/``, and a
   table."""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from omegaconf import DictConfig

from runner.config import parse_bytes
from runner.errors import ConfigError, DoesNotFitError, RankFailedError
from runner.layout import ResolvedRun
from runner.parallel.dims import Coords, ParallelDims

__all__ = ["check_rehearsal", "default_ranks", "rehearse", "format_rehearsal", "raise_if_over_capacity", "SYMMETRY"]

SYMMETRY = ("tp shards and dp replicas are assumed to do what the rehearsed rank of their pipeline rank does "
            "(same shapes, same collectives); only the ranks listed were run")
RANK_TIMEOUT_S = 3600


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


def check_rehearsal(cfg: DictConfig, run_dir: Path | None) -> tuple[ResolvedRun, list[int], int | None]:
    """The resolved run, the ranks to rehearse and the capacity (bytes), or a ``ConfigError`` naming the
    key, the value and the fix; nothing is built before these pass."""
    import torch

    from runner.validate import validate

    r = cfg.rehearse
    dims = ParallelDims.from_config(cfg.parallel)
    if r.steps < 1:
        raise ConfigError(f"rehearse.steps={r.steps}: a rehearsal needs at least one step. Fix: rehearse.steps=3.")
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device=cuda: a rehearsal runs each rank on this host's device, and this host has no GPU. "
                          "Fix: device=cpu (or device=auto), or rehearse on a host with a GPU.")
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
    return resolved, ranks, capacity


def _run_one(resolved: ResolvedRun, cfg: DictConfig, rank: int, steps: int, run_dir: Path) -> dict:
    out = run_dir / "rehearsal" / f"rank{rank}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    from runner.rehearse.rank import rank_main  # the training code: only when a rank is rehearsed

    process = multiprocessing.get_context("spawn").Process(
        target=rank_main, args=(resolved, cfg, rank, steps, run_dir / "rehearsal" / f"rank{rank}", out),
        name=f"rehearse-rank{rank}")
    process.start()
    process.join(RANK_TIMEOUT_S)
    if process.is_alive():
        process.kill()
        process.join()
    if process.exitcode != 0 or not out.is_file():
        raise RankFailedError(f"the rehearsal of rank {rank} failed (exit code {process.exitcode}); its traceback "
                              f"is above. Fix: run it alone with rehearse.ranks=[{rank}] to see it.")
    return json.loads(out.read_text())


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


def rehearse(cfg: DictConfig, run_dir: Path) -> dict[str, Any]:
    """Rehearse the run of ``cfg`` (see the module's docstring); returns what ``rehearsal.json`` holds."""
    from runner.rehearse.compose import compose_step, memory_verdicts, step_mfu

    resolved, ranks, capacity = check_rehearsal(cfg, run_dir)
    results = [_run_one(resolved, cfg, rank, cfg.rehearse.steps, run_dir) for rank in ranks]
    for r in results:
        r["trace"] = r["trace"] and os.path.relpath(r["trace"], run_dir)
    pipeline_ranks = {r["coords"]["pp"] for r in results}
    report: dict[str, Any] = {
        "layout": resolved.dims.describe(), "world_size": resolved.world_size, "device": resolved.device,
        "schedule": resolved.layout.schedule, "microbatches": resolved.layout.microbatches, "ranks": results,
        "assumption": SYMMETRY, "capacity_bytes": capacity,
        "memory": memory_verdicts(results, capacity, resolved.dims),
    }
    report["fits"] = None if capacity is None else report["memory"] == ["fits"]
    if pipeline_ranks == set(range(resolved.pp)):
        step, timeline = compose_step(resolved, results, latency_s=cfg.plan.comm_latency_s,
                                      bandwidth=cfg.plan.comm_bandwidth)
        step.update(step_mfu(cfg, resolved, step["step_s"], _device_name(resolved)))
        _write_timeline(run_dir, resolved, timeline, step)
        report["step"], report["timeline"] = step, ["rehearsal_timeline.json", "rehearsal_timeline.png"]
    else:
        report["step"] = None
        missing = sorted(set(range(resolved.pp)) - pipeline_ranks)
        report["step_missing"] = (f"pipeline ranks {missing} were not rehearsed: "
                                  "no composed step (rehearse.ranks=null rehearses one of each)")
    (run_dir / "rehearsal.json").write_text(json.dumps(report, indent=1))
    return report


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
                     f"{sum(a['seconds'] for a in r['actions']):>10.3f} {r['optimizer_s']:>8.3f} {n_coll:>12}")
    step = report.get("step")
    if step:
        lines.append(f"composed step: {step['step_s']:.3f} s (pipeline {step['pipeline_s']:.3f} s, collectives "
                     f"{step['collectives_s']:.3f} s, optimizer {step['optimizer_s']:.3f} s), bubble "
                     f"{step['bubble']:.1%}, {step['tokens_per_s']:.0f} tokens/s, "
                     + (f"MFU {step['mfu']:.1%} of {step['peak_of']}" if step.get("mfu") is not None
                        else f"MFU unknown ({step.get('mfu_unknown')})"))
    else:
        lines.append(f"composed step: none ({report.get('step_missing')})")
    lines.append("memory: " + "; ".join(report["memory"]))
    lines.append(f"assumed: {report['assumption']}")
    return "\n".join(lines)


def raise_if_over_capacity(report: dict[str, Any]) -> None:
    """A ``DoesNotFitError`` (exit 3) naming every rank over ``rehearse.capacity``, after the table
    and ``rehearsal.json`` are written; nothing where every rank fits or no capacity was given."""
    if report["fits"] is False:
        raise DoesNotFitError(f"the layout {report['layout']} does not fit rehearse.capacity: "
                              + "; ".join(report["memory"]) + " (rehearsal.json holds every rank's peak)")
