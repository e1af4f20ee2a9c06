"""Times measured at a shorter sequence, scaled to the run's (``rehearse.time_seq_len``): for shapes
whose full-length step takes hours on the host at hand (a 70B model on CPU). The rule
(``SCALING_RULE``): each action of a stage (F, B, I or W) measured at the short sequence, times the
ratio of that stage's FLOPs for that action at the run's sequence to its FLOPs at the short one,
both counted as the planner counts them (``runner.plan.target.count_units``: op by op on fake
tensors, the whole stage, attention's quadratic term included). What is assumed: an action's time
follows its FLOPs (the short sequence's efficiency holds at the long one; a short sequence is often
less efficient per FLOP, so the scaled times lean long)."""

from __future__ import annotations

import copy
from typing import Sequence

from omegaconf import DictConfig

from runner.layout import ResolvedRun

__all__ = ["SCALING_RULE", "flop_ratios", "scale_times"]

SCALING_RULE = ("each stage's F/B/I/W action time measured at rehearse.time_seq_len, times the ratio of the stage's "
                "FLOPs for that action at train.seq_len to its FLOPs at rehearse.time_seq_len (counted as the "
                "planner counts them: runner.plan.target.count_units); the optimizer step is measured (it does not "
                "depend on the sequence), the collectives are measured at train.seq_len")


def _stage_flops(cfg: DictConfig, resolved: ResolvedRun, seq_len: int) -> dict[str, int]:
    """``{"<stage><kind>": FLOPs}`` of one microbatch of ``seq_len`` tokens (kind B = I + W)."""
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
    return out


def flop_ratios(cfg: DictConfig, resolved: ResolvedRun, short_seq_len: int) -> dict[str, float]:
    """``{"<stage><kind>": FLOPs at train.seq_len / FLOPs at short_seq_len}`` for every stage and kind."""
    long, short = _stage_flops(cfg, resolved, resolved.seq_len), _stage_flops(cfg, resolved, short_seq_len)
    return {k: long[k] / short[k] for k in long if short[k] > 0}


def scale_times(actions: Sequence[dict], ratios: dict[str, float]) -> list[dict]:
    """The measured actions with ``seconds`` scaled by ``ratios`` and the measured value kept as
    ``measured_seconds``."""
    return [{**a, "measured_seconds": a["seconds"], "seconds": a["seconds"] * ratios[f"{a['stage']}{a['kind']}"]}
            for a in actions]
