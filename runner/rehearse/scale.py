"""Times measured at a shorter sequence, scaled to the run's (``rehearse.time_seq_len``): for shapes
whose full-length step takes hours on the host at hand (a 70B model on CPU). The rule
(``SCALING_RULE``): each action of a stage (F, B, I or W) measured at the short sequence, times the
ratio of that stage's FLOPs for that action at the run's sequence to its FLOPs at the short one,
both counted as the planner counts them (``runner.plan.target.count_units``: op by op on fake
tensors, the whole stage, attention's quadratic term included), each action's FLOPs being what torch
runs in it: the first stage's W is its whole backward (torch's ``backward_weight_one_chunk`` runs a
full backward for stage 0, whose input needs no gradient, and its I nothing), so it scales by the
stage's I + W FLOPs, attention's quadratic backward included, not by its weights' gradients alone.
What is assumed: an action's time follows its FLOPs (the short sequence's efficiency holds at the
long one; a short sequence is often less efficient per FLOP, so the scaled times lean long).
``BENCHMARKS.md`` ("times scaled from a shorter sequence") holds it against full-length rehearsals.

With ``rehearse.time_fit_seq_len`` (``FIT_RULE``) the times are also measured at a second, shorter
sequence, and each stage action's time at the run's sequence is read off the line a + b * FLOPs
through its median times at the two: a is what the action costs whatever the length (on CPU, the W
that adds a vocabulary-sized weight's gradient: tens of milliseconds at any length), which the FLOP
ratio multiplies with the rest, so that times scaled from 1/8 of the sequence read up to 1.7x long."""

from __future__ import annotations

import copy
import statistics
from typing import Sequence

from omegaconf import DictConfig

from runner.layout import ResolvedRun

__all__ = ["SCALING_RULE", "FIT_RULE", "flop_ratios", "fit_ratios", "scale_times"]

SCALING_RULE = ("each stage's F/B/I/W action time measured at rehearse.time_seq_len, times the ratio of the stage's "
                "FLOPs for that action at train.seq_len to its FLOPs at rehearse.time_seq_len (counted as the "
                "planner counts them: runner.plan.target.count_units; the first stage's W, which runs its whole "
                "backward, by its I + W FLOPs; an action with no FLOPs counted, such as an embedding-only stage's, "
                "kept as measured); the optimizer step is measured (it does not depend on the "
                "sequence), the collectives are measured at train.seq_len")
FIT_RULE = ("each stage's F/B/I/W action time measured at rehearse.time_fit_seq_len and at rehearse.time_seq_len (the "
            "median over microbatches), read off the line a + b * FLOPs through the two at the stage's FLOPs for that "
            "action at train.seq_len (counted as the planner counts them: runner.plan.target.count_units; the first "
            "stage's W, which runs its whole backward, by its I + W FLOPs); each action measured at "
            "rehearse.time_seq_len scaled by the fitted time over its median there; where the two do not grow with "
            "the FLOPs (b <= 0: no work, or the load), by the FLOP ratio from rehearse.time_seq_len; the optimizer "
            "step is measured, the collectives at train.seq_len")


def _stage_flops(cfg: DictConfig, resolved: ResolvedRun, seq_len: int) -> dict[str, int]:
    """``{"<stage><kind>": FLOPs}`` of one microbatch of ``seq_len`` tokens (kind B = I + W), each
    action's as torch runs it: the first stage's W is its whole backward (its I runs nothing)."""
    from runner.plan.roofline import DevicePeaks
    from runner.plan.target import count_units

    at = copy.deepcopy(cfg)
    at.train.seq_len = seq_len
    units = count_units(at, resolved.microbatch_size, DevicePeaks("FLOPs only", {"torch.float32": 1.0}, 1.0, 0),
                        cast_params=resolved.dp_mode == "fsdp" and resolved.train.precision == "bf16")
    out: dict[str, int] = {}
    for stage, names in enumerate(resolved.layout.stages):
        for kind in "FIW":
            out[f"{stage}{kind}"] = sum(units[n].flops[kind] for n in names)
        out[f"{stage}B"] = out[f"{stage}I"] + out[f"{stage}W"]
    out["0W"] = out["0B"]  # torch: stage 0's backward_weight_one_chunk runs the full backward
    return out


def flop_ratios(cfg: DictConfig, resolved: ResolvedRun, short_seq_len: int) -> dict[str, float]:
    """``{"<stage><kind>": FLOPs at train.seq_len / FLOPs at short_seq_len}`` for every stage and
    kind; 1 where none are counted at either (a stage of the embedding alone: its time, the dense
    gradient of its table, does not follow the sequence, and is kept as measured)."""
    long, short = _stage_flops(cfg, resolved, resolved.seq_len), _stage_flops(cfg, resolved, short_seq_len)
    return {k: long[k] / short[k] if short[k] > 0 else 1.0 for k in long if short[k] > 0 or long[k] == 0}


def scale_times(actions: Sequence[dict], ratios: dict[str, float]) -> list[dict]:
    """The measured actions with ``seconds`` scaled by ``ratios`` and the measured value kept as
    ``measured_seconds``."""
    return [{**a, "measured_seconds": a["seconds"], "seconds": a["seconds"] * ratios[f"{a['stage']}{a['kind']}"]}
            for a in actions]


def _median_seconds(actions: Sequence[dict], key: str) -> float:
    return statistics.median(a["seconds"] for a in actions if f"{a['stage']}{a['kind']}" == key)


def fit_ratios(short: Sequence[dict], shorter: Sequence[dict], ratios: dict[str, float],
               shorter_ratios: dict[str, float]) -> dict[str, dict]:
    """Per ``"<stage><kind>"`` of the actions measured at the short length (``short``; ``shorter``:
    the same actions at the shorter one; the FLOP ratios of each to ``train.seq_len``): the line
    ``a + b * FLOPs`` (FLOPs as a fraction of ``train.seq_len``'s) through the two median times, its
    value at ``train.seq_len`` (``fitted_s``), and ``ratio``, the fitted time over the short length's
    median (``scale_times``'s ``ratios``); where ``b <= 0`` (or no FLOPs are counted), the FLOP ratio
    (``by_flops``)."""
    out: dict[str, dict] = {}
    for key in sorted({f"{a['stage']}{a['kind']}" for a in short}):
        (x1, y1), (x2, y2) = ((1 / shorter_ratios[key], _median_seconds(shorter, key)),
                              (1 / ratios[key], _median_seconds(short, key)))
        slope = (y2 - y1) / (x2 - x1) if x2 > x1 else 0.0  # x2 == x1: no FLOPs counted at either
        if slope <= 0 or y2 <= 0:
            out[key] = {"ratio": ratios[key], "by_flops": True}
            continue
        fitted = y1 + slope * (1 - x1)
        out[key] = {"ratio": fitted / y2, "by_flops": False, "fitted_s": fitted, "a_s": y1 - slope * x1, "b_s": slope}
    return out
