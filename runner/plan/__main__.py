"""``python -m runner.plan``: the planner's command line (see ``runner.plan.planner``).

    python -m runner.plan parallel.pp=4 model.n_layers=16          # the same overrides as a run
    python -m runner.plan plan.costs=outputs/<date>/<time> plan.memory_limit=2GB
    python -m runner.plan plan.costs=costs.yaml                    # costs measured elsewhere: no model

Prints the calibration, the ranked table and the ``python -m runner ...`` line of the
recommended candidate; writes ``plan.json`` (every candidate, fastest first),
``calibration.json``, ``fit.json`` (the cost model fitted to the probe runs, which are kept under
``probes/``) and ``plan_timeline.json`` (the recommended candidate's predicted timeline) into the
Hydra run directory.

Exit codes as ``python -m runner``'s (``runner.errors``): 2 a configuration no candidate can run
(reported once, before anything is timed), 3 no valid candidate fits ``plan.memory_limit``,
130/143 stopped; Hydra's own config errors (a misspelt key) are 2 as well.
"""

from __future__ import annotations

import json
import logging
import shlex
import signal
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Sequence

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from runner.compose import config_dir  # also registers the schemas
from runner.errors import ConfigError, RunnerError, interrupted_exit_code
from runner.exits import expand_home, run_entry
from runner.launch import launch  # runs the probes
from runner.outputs.timeline import simulated_slices, write_chrome_trace
from runner.plan.from_costs import plan_from_costs
from runner.plan.given import GivenCosts, is_costs_file, read_costs
from runner.plan.link import Link, configured_link, tied_meetings
from runner.plan.planner import Candidate, check_barrier_free, check_schedules, committed_steps, plan
from runner.plan.rehearsed import rehearse_by_cli
from runner.plan.report import commit_line, fit_line, label, rehearsal_report, search_report, table, within_error
from runner.plan.target_report import run_target
from runner.ranks.console import quiet_libraries
from runner.validate import check_config

_STARTED: list[bool] = []


@hydra.main(config_path=str(config_dir()), config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    _STARTED.append(True)  # past Hydra's run directory: an OSError from here on is no config error
    check_config(cfg)  # as runner.plan() and python -m runner check it: a wrong value fails at once
    plan_in(cfg, Path(HydraConfig.get().runtime.output_dir), list(HydraConfig.get().overrides.task))


def plan_in(cfg: DictConfig, out: Path, overrides: Sequence[str]) -> dict:
    """Plan the composed config ``cfg`` (given as ``overrides``), printing what the command line
    prints and writing its files into ``out``; returns ``plan_dir`` (``out``), ``candidates`` (as
    ``plan.json`` holds them, fastest first), ``recommended`` (the chosen one, of those) and
    ``command`` (the ``python -m runner ...`` line that runs it). Raises ``ConfigError`` when no
    candidate can run, ``RunnerError`` when none fits the memory limit."""
    check_schedules(cfg)
    check_barrier_free(cfg, overrides)  # plan.barrier=false: commands that run deferred
    from_file = bool(cfg.plan.costs) and is_costs_file(cfg.plan.costs)
    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.launch.threads_per_rank or 1)  # as one rank of the run would
    quiet = [logging.getLogger(name) for name in ("runner.validate", "runner.parallel.tied", "runner.startup")]
    levels = [logger.level for logger in quiet]
    for logger in quiet:  # one line per candidate otherwise
        logger.setLevel(logging.WARNING)
    try:
        with torch.random.fork_rng(devices=[]):  # the caller's generator as it was (the costs draw inputs)
            if cfg.plan.target:  # for a device this host does not have: FLOP and byte counts, no ranks
                command = run_target(cfg, out, overrides)
            elif from_file:  # costs a user measured: no model, no ranks
                command = main_from_costs(cfg, out)
            else:
                command = _plan_here(cfg, out, overrides)
    finally:
        torch.set_num_threads(threads)
        for logger, level in zip(quiet, levels):
            logger.setLevel(level)
    candidates = json.loads((out / "plan.json").read_text())
    print(where_plan(out))
    return {"plan_dir": str(out), "candidates": candidates,
            "recommended": next((c for c in candidates if c.get("recommended")), None), "command": command}


def where_plan(out: Path) -> str:
    """Where the planner's outputs are: its directory, then its files present (the searched
    schedules' CSVs, the probes' runs)."""
    names = [n for n in ("plan.json", "plan_timeline.json", "calibration.json", "fit.json", "probes/")
             if (out / n).exists()]
    searched = sorted(p.name for p in out.glob("synthesized_*.csv"))
    names[1:1] = [f"synthesized_*.csv ({len(searched)})"] if len(searched) > 1 else searched
    return f"\nplan dir  {out}\nfiles     {', '.join(names)}"


def _plan_here(cfg: DictConfig, out: Path, overrides: Sequence[str]) -> str:
    """Plan with this host's measured costs (probe runs); returns the best candidate's command."""
    # The user's overrides, less the planner's own and the ones each candidate sets itself.
    chosen = ("plan.", "schedule", "parallel.microbatches=", "parallel.stages_per_rank=", "parallel.split_points=",
              *(() if cfg.plan.barrier else ("train.optimizer_sync=",)))  # plan.barrier=false: each one's own
    kept = [o for o in overrides if not o.startswith(chosen)]
    candidates, timelines, calibration, model = plan(cfg, out, launch,
                                                     rehearse_by_cli(kept) if cfg.plan.rehearse else None)
    if not any(c.valid for c in candidates):
        raise ConfigError(_no_valid_candidate(candidates))
    close = within_error(candidates)
    (out / "plan.json").write_text(json.dumps([asdict(c) for c in candidates], indent=2) + "\n")
    if calibration is not None:
        (out / "calibration.json").write_text(json.dumps(asdict(calibration), indent=2) + "\n")
        c = calibration
        print(f"message: {c.latency_s * 1e6:.0f} us + bytes / {c.bandwidth / 1e9:.2f} GB/s, "
              f"+{c.busy_delay_s * 1e6:.0f} us while its sender computes; runtime overhead per action: "
              f"{c.action_overhead_s * 1e6:.0f} us; compute x{c.corunning_slowdown:.2f} with both ranks busy, "
              f"varying by {c.action_jitter:.0%}")
    if model is not None and model.probes:
        (out / "fit.json").write_text(json.dumps(asdict(model), indent=2) + "\n")
        print(fit_line(model))
    if not cfg.plan.barrier:
        print("steps without the barrier (plan.barrier=false): train.optimizer_sync=deferred's steady step, each "
              "rank's update between its own steps, a tied weight's gradient sum where its ranks meet, and the "
              "loss/norm all-reduce waited for a step later, action times varying as calibrated (docs/planner.md)")
    print(table(candidates))
    for line in search_report(candidates):
        print(line)
    best = next((c for c in candidates if c.recommended), None)
    _print_commits(cfg, best)
    if best is None:
        least = min((c for c in candidates if c.valid), key=lambda c: max(c.peak_activation_bytes))
        raise RunnerError(f"no valid candidate keeps its in-flight activations within plan.memory_limit="
                          f"{cfg.plan.memory_limit}: the least is {label(least)}'s, "
                          f"{max(least.peak_activation_bytes) / 2**20:.2f} MiB on one rank (table above; "
                          f"plan.json in {out}). Fix: a larger plan.memory_limit, or a smaller train.batch_size.")
    timeline = timelines[id(best)]
    write_chrome_trace(out / "plan_timeline.json", simulated_slices(timeline), ranks=sorted({a.rank for a in timeline}))
    tied = [c for c in candidates if c.tie]
    if tied:
        print(f"\ntie: {len(tied)} candidates are predicted within {cfg.plan.tie_tolerance:.0%} "
              f"(plan.tie_tolerance) of the fastest, closer than the prediction can tell apart: "
              f"{', '.join(label(c) for c in tied)}. Recommended of those: the least activation memory.")
    for line in close:
        print(line)
    for line in rehearsal_report(candidates, out):
        print(line)
    searched = next((c for c in candidates if c.schedule == "synthesized" and c.valid and c.fits_memory), None)
    if searched is not None:
        print(f"\nfastest synthesized: python -m runner {shlex.join(kept + searched.overrides)}")
    # Quoted: a split is a [list].
    command = f"python -m runner {shlex.join(kept + best.overrides)}"
    print(f"\n{'best (tied)' if best.tie else 'best'}: {command}")
    return command


def _print_commits(cfg: DictConfig, best: Candidate | None) -> None:
    """``plan.barrier=false``: what the recommended candidate's steps validated at their own end cost."""
    if best is not None and best.predicted_step_time_s is not None:
        line = commit_line(label(best), best.predicted_step_time_s, best.commit_step_s, best.amortized_step_s,
                           *committed_steps(cfg))
        if line:
            print(line)


def main_from_costs(cfg: DictConfig, out: Path) -> str:
    """``python -m runner.plan plan.costs=<file>``: read and check the file (``ConfigError``:
    exit 2), plan it, print the table and the search, write ``plan.json``, the synthesized CSV
    and ``plan_timeline.json`` (the recommended candidate's) into ``out``; ``RunnerError`` (exit
    3) when nothing fits the file's memory_limit. Returns the best candidate's command."""
    given = read_costs(cfg.plan.costs, cfg.plan.memory_limit)  # plan.memory_limit, if given, replaces the file's
    link = configured_link(cfg.plan.comm_latency_s, cfg.plan.comm_bandwidth)  # what a tied weight's sum is priced on
    candidates, timelines = plan_from_costs(given, out, budget=cfg.plan.search_budget, seed=cfg.plan.search_seed,
                                            tie_tolerance=cfg.plan.tie_tolerance, barrier=cfg.plan.barrier, link=link)
    committed, steps = committed_steps(cfg)
    for c in candidates:  # plan.barrier=false: the steps validated at their own end, over the run's
        c.amortize(committed, steps)
    (out / "plan.json").write_text(json.dumps([asdict(c) for c in candidates], indent=2) + "\n")
    print(f"costs from {given.path}: pp={given.pp}, m={given.microbatches}, messages {given.comm_s * 1e3:.3f} ms, "
          f"M_W/M_B {given.weight_grad_fraction}, memory limit {given.memory_limit} (steps: the pipeline"
          f"{' and its tied sum' if given.tied else ' alone'}"
          f"{'' if cfg.plan.barrier else ', overlapping: the steady step of steps back to back, plan.barrier=false'})")
    print(_tied_line(given, link))
    print(table(candidates))
    for line in search_report(candidates):
        print(line)
    best = next((c for c in candidates if c.recommended), None)
    _print_commits(cfg, best)
    if best is None:
        raise RunnerError(f"no candidate keeps its activations within memory_limit={given.memory_limit} of "
                          f"{given.path} (table above; plan.json in {out}). Fix: a larger memory_limit, or more "
                          "microbatches of fewer samples each.")
    timeline = timelines[id(best)]
    write_chrome_trace(out / "plan_timeline.json", simulated_slices(timeline), ranks=sorted({a.rank for a in timeline}))
    command = f"python -m runner {shlex.join(best.overrides)}"
    print(f"\n{'best (tied)' if best.tie else 'best'}: {command}")
    return command


def _tied_line(given: GivenCosts, link: Link) -> str:
    """What a costs file's plan says of a tied weight: the sum it models, or that it models none."""
    if not given.tied:
        return ("tied weights: none modelled (the file has no tied key; a model whose embedding and head share "
                "a weight across stages sums its gradient every step: tied: {stages: [...], bytes: ...})")
    on = f"{link.latency_s * 1e6:.0f} us + bytes / {link.bandwidth / 1e9:.1f} GB/s"
    return "; ".join(f"tied weight: stages {'/'.join(map(str, ranks))} meet to sum its gradient, "
                     f"{seconds * 1e3:.3f} ms (a ring all-reduce on {on}: plan.comm_latency_s, plan.comm_bandwidth)"
                     for ranks, seconds in tied_meetings(given.tied, link))


def _no_valid_candidate(candidates: list[Candidate]) -> str:
    """Why no candidate can run: the reason that rejected most of them (a config error rejects
    every layout alike), once, then how many were rejected for their own layout instead."""
    reasons: dict[str, int] = {}
    for c in candidates:
        reasons[c.reason] = reasons.get(c.reason, 0) + 1
    [(common, n), *others] = sorted(reasons.items(), key=lambda item: -item[1])
    text = f"no candidate layout can run: {common} ({n} of {len(candidates)} candidates)"
    if others:
        text += (f"\nThe other {len(candidates) - n} are layouts with reasons of their own, e.g. "
                 f"{others[0][0]}")
    return text


def cli() -> None:
    # SIGTERM ends the planner as SIGINT does (KeyboardInterrupt: 130): through the cleanup of
    # whatever it runs (calibration ranks, probe runs), with the shell's 143.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(interrupted_exit_code(signum)))
    sys.argv[1:] = expand_home(sys.argv[1:])
    quiet_libraries()  # the probe runs' libraries: progress bars and INFO lines off
    run_entry(main, started=lambda: bool(_STARTED))


if __name__ == "__main__":
    cli()
