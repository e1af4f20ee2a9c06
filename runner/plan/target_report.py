"""What ``python -m runner.plan plan.target=<device>`` prints and writes: the device's figures
and the interconnect used, the ranked candidates in seconds and GiB per rank, the ties, and the
``python -m runner ...`` line of the recommended one; ``plan.json`` holds every candidate."""

from __future__ import annotations

import json
import shlex
from dataclasses import asdict
from pathlib import Path
from typing import Sequence

from omegaconf import DictConfig

from runner.errors import RunnerError
from runner.plan.planner import committed_steps
from runner.plan.report import candidate_table, commit_line, mark
from runner.plan.target import TargetCandidate, TargetPlan, plan_target

__all__ = ["header", "target_table", "tie_line", "run_target"]

GIB = 2**30
_STEPS_WITH_BARRIER = "steps: with the barrier (every rank waits for the step's all-reduce before its next step)"
_STEPS_WITHOUT = ("steps: barrier-free (plan.barrier=false): train.optimizer_sync=deferred's steady step, each rank's "
                  "dp sync and AdamW between its own steps, the loss/norm all-reduce waited for a step later; the "
                  "commands run deferred")


def label(c: TargetCandidate) -> str:
    return f"{c.schedule} pp={c.pp} dp={c.dp} {c.dp_mode} m={c.microbatches}"


def header(p: TargetPlan, cfg: DictConfig) -> list[str]:
    peaks = p.peaks
    flops = ", ".join(f"{v / 1e12:.1f} {k.removeprefix('torch.')}" for k, v in sorted(peaks.flops.items()))
    return [f"target: {p.world_size} x {peaks.name} (torch's datasheet table, dense): {flops} TFLOP/s, "
            f"{peaks.bandwidth / 1e9:.0f} GB/s, {peaks.memory_bytes / GIB:.0f} GiB"
            + (f" ({', '.join(peaks.corrected)} corrected to the vendor's datasheet)" if peaks.corrected else "")
            + f"; each op at "
            f"{cfg.plan.efficiency:.0%} (plan.efficiency) of its roofline; interconnect "
            f"{p.link.latency_s * 1e6:.0f} us + bytes / {p.link.bandwidth / 1e9:.1f} GB/s (plan.comm_latency_s, "
            f"plan.comm_bandwidth); train.precision={cfg.train.precision}, "
            f"train.activation_checkpointing={cfg.train.activation_checkpointing}",
            _STEPS_WITH_BARRIER if cfg.plan.barrier else _STEPS_WITHOUT]


def target_table(candidates: Sequence[TargetCandidate]) -> str:
    """One row per valid candidate: step time and its parts in seconds, the fullest rank's memory
    in GiB (its parts: parameters + gradients + AdamW, what FSDP gathers, activations)."""
    def row(c: TargetCandidate) -> str:
        assert c.step_time_s is not None and c.pipeline_s is not None and c.sync_s is not None
        top = max(c.memory_per_rank, key=lambda m: m["total"])
        state = top["params"] + top["grads"] + top["optimizer"]
        return (f"{mark(c)} {c.schedule:<16} {c.pp:>3} {c.dp:>3}  {c.dp_mode:<6} {c.microbatches:>3} "
                f"{c.stages_per_rank:>2}  {c.step_time_s:8.3f}  {c.pipeline_s:8.3f}  {c.sync_s:4.2f}  "
                f"{c.bubble or 0:6.3f}  {c.mfu or 0:4.0%}  {top['total'] / GIB:17.1f}  {state / GIB:7.1f}  "
                f"{top['gathered'] / GIB:8.1f}  {top['activations'] / GIB:11.1f}"
                f"{'' if c.fits_device else '  over device memory'}")

    return candidate_table("  schedule          pp  dp  dp mode   m  v  step (s)  pipeline  sync  bubble   MFU  "
                           "memory/rank (GiB)  p+g+opt  gathered  activations", candidates, row)


def tie_line(tied: Sequence[str], tolerance: float, error: str) -> str:
    """The ties, said with the error figure that makes them ties (``error``: where it comes from)."""
    return (f"tie: {len(tied)} candidates are predicted within {tolerance:.0%} (plan.tie_tolerance) of the fastest, "
            f"{error}: {', '.join(tied)}. Recommended of those: the least memory.")


def run_target(cfg: DictConfig, out: Path, overrides: Sequence[str]) -> str:
    """Plan for ``plan.target``, print it, write ``plan.json`` into ``out``, return the best
    candidate's command; a RunnerError (exit 3) when no valid candidate fits the device's memory
    (after the table and plan.json)."""
    p = plan_target(cfg)
    (out / "plan.json").write_text(json.dumps([asdict(c) for c in p.candidates], indent=2) + "\n")
    for line in header(p, cfg):
        print(line)
    print(target_table(p.candidates))
    tied = [label(c) for c in p.candidates if c.tie]
    if tied:
        print("\n" + tie_line(tied, cfg.plan.tie_tolerance, "closer than a plan from datasheet figures can tell "
                                                             "apart (its error on this device is not measured)"))
    best = next((c for c in p.candidates if c.recommended), None)
    commits = best and best.step_time_s and commit_line(label(best), best.step_time_s, best.commit_step_s,
                                                        best.amortized_step_s, *committed_steps(cfg))
    if commits:
        print(commits)
    if best is None:
        least = min((c for c in p.candidates if c.valid), key=lambda c: max(m["total"] for m in c.memory_per_rank))
        need = max(m["total"] for m in least.memory_per_rank)
        raise RunnerError(f"no candidate fits {p.peaks.name}'s {p.peaks.memory_bytes / GIB:.0f} GiB per rank: the "
                          f"least is {label(least)}'s, {need / GIB:.1f} GiB (table above; plan.json in {out}). Fix: "
                          "more ranks (plan.world_size), a smaller train.batch_size or more plan.microbatches, or "
                          "train.activation_checkpointing=full.")
    chosen = ("plan.", "schedule", "parallel.", *(() if cfg.plan.barrier else ("train.optimizer_sync=",)))
    kept = [o for o in overrides if not o.startswith(chosen)]
    command = f"python -m runner {shlex.join(kept + best.overrides)}"
    print(f"\n{'best (tied)' if best.tie else 'best'}: {command}")
    return command
