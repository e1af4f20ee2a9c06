"""The schemas of the run-wide keys no package owns: ``train.*`` (``TrainConfig``), ``eval.*``
(``EvalConfig``) and ``plan.*`` (``PlanConfig``, with ``plan.target``'s keys in ``TargetPlanConfig``),
and memory sizes as users type them (``parse_bytes``). Each package's own group is in its
``config.py``; ``runner.compose`` assembles the tree and registers it. Imports nothing heavy.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, List, Optional

from runner.errors import ConfigError, shown
from runner.options import ActivationCheckpointing, LRSchedule, NoDecay, OptimizerSync, Precision, choices
from runner.pipeline.registry import SCHEDULES

__all__ = ["TrainConfig", "EvalConfig", "PlanConfig", "TargetPlanConfig", "parse_bytes"]

# A string option's accepted values are its field's choices (runner.options, or a registry):
# the checks before launch (runner.validate) refuse any other value, naming key, value and fix.

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(key: str, value: Any) -> int | None:
    """A memory size as users type it: ``2000000000``, ``2e9``, ``2GB``, ``1.5GiB`` (KB/MB/GB/TB
    are powers of 10, KiB/MiB/GiB/TiB powers of 2); None stays None."""
    if value is None:
        return None
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*", str(value))
    unit = match and match.group(2).lower()
    number = float(match.group(1)) * _UNITS[unit] if match and unit in _UNITS else math.inf
    if not math.isfinite(number):  # (1e999 reads as inf, which no int holds)
        raise ConfigError(f"{key}={shown(value)} is not a memory size. Fix: bytes as a number (2000000000, 2e9) "
                          "or with a unit (2GB, 1.5GiB, 512MiB).")
    return int(number)


@dataclass
class TrainConfig:
    steps: int = 30
    batch_size: int = 16  # global samples per optimizer step
    seq_len: int = 32  # tokens per sample
    lr: float = 3e-3  # peak learning rate (AdamW)
    # After warmup: cosine or linear decay to lr * min_lr_ratio at the last step, or constant.
    lr_schedule: str = field(default="cosine", metadata=choices(LRSchedule))
    min_lr_ratio: float = 0.1
    warmup_steps: int = 3  # linear warmup from lr / warmup_steps
    weight_decay: float = 0.1
    # Parameter kinds AdamW does not decay: bias, norm (LayerNorm/RMSNorm/... weights), embedding.
    # Decaying them pulls gains and lookup rows towards zero for no regularisation benefit.
    no_decay: List[str] = field(default_factory=lambda: ["bias", "norm", "embedding"], metadata=choices(NoDecay))
    betas: List[float] = field(default_factory=lambda: [0.9, 0.95])
    grad_clip: float = 1.0  # max global gradient norm across all stages; 0 = off
    # barrier | post_validate. barrier: every rank waits for the step's loss and global gradient
    # norm (one all-reduce), then clips and steps AdamW. post_validate: each rank steps AdamW as
    # soon as its own backward is done, unclipped, while that all-reduce runs; the step is then
    # validated, and one that needed clipping is undone from a snapshot taken before it (+12 bytes
    # per parameter) and redone clipped; a non-finite one is undone and stops the run as under
    # barrier. Both train bit-identically (docs/optimizer-sync.md).
    optimizer_sync: str = field(default="barrier", metadata=choices(OptimizerSync))
    seed: int = 0
    # fp32 | bf16. bf16 autocasts each stage's forward (parameters, gradients and the optimizer
    # stay fp32); with parallel.dp_mode=fsdp it is FSDP's mixed-precision policy instead.
    precision: str = field(default="fp32", metadata=choices(Precision))
    # Recompute activations in backward instead of keeping them: none | full (every block) |
    # every_n (every ac_every-th block). Blocks are the model's children between the first and
    # the last (the embedding and the head are never recomputed).
    activation_checkpointing: str = field(default="none", metadata=choices(ActivationCheckpointing))
    ac_every: int = 2
    # torch.compile each child of every stage (in place: parameter names do not change).
    # Schedules that split backward into input and weight parts (interleaved_zb, zbv, dualpipev,
    # F/I/W CSVs) cannot run compiled stages and are rejected before launch.
    compile: bool = False


@dataclass
class EvalConfig:
    every: int = 0  # forward-only evaluation on held-out data every K optimizer steps (and after the last); 0 = off
    steps: int = 2  # held-out batches (of train.batch_size) per evaluation


@dataclass
class TargetPlanConfig:
    # A device of torch's datasheet table (torch._inductor.analysis.device_info: "NVIDIA H100",
    # "NVIDIA A100", "AMD MI300X", ...): plan for it from FLOP and byte counts of the model built
    # from its config alone (no weights, no GPU, no ranks: runner.plan.target); null = plan here.
    target: Optional[str] = None
    world_size: Optional[int] = None  # ranks to plan for (pp x dp); null = the config's parallel degrees
    # The fraction of the device's peak FLOP/s and memory bandwidth its ops reach (one factor for
    # both: a roofline of each op at the peaks, divided by it). Stated in every target plan.
    efficiency: float = 0.5
    # The interconnect between ranks is plan.comm_latency_s and plan.comm_bandwidth (null: 10 us and
    # 50 GB/s, a 400 Gbit/s link per device).


@dataclass
class PlanConfig(TargetPlanConfig):
    """``python -m runner.plan``: candidates, costs and limits (ignored by training runs)."""

    microbatches: List[int] = field(default_factory=lambda: [2, 4, 8, 16])  # counts to try
    # The built-in schedules to try (names as schedule=<name>: gpipe, 1f1b, ...); null = every one.
    # Fewer schedules, fewer candidates: e.g. a plan.rehearse=true plan of one schedule. The run's
    # own CSV schedule (schedule=csv) is tried whatever this holds. Names outside the registry
    # (runner.pipeline.registry) are refused before anything runs.
    schedules: Optional[List[str]] = field(default=None, metadata=choices(SCHEDULES))
    # Before predicting, a few steps of real runs of this model (1F1B, interleaved 1F1B and ZBV
    # at the smallest microbatch count, 1F1B at the largest: runner.plan.probe), each this many
    # seconds of steps as predicted (8-60 steps), fit the cost model to how its actions run in a
    # pipeline; 0 = no probes (the child timings and the calibration alone: 15-27% low in
    # BENCHMARKS.md).
    probe_seconds: float = 4.0
    # A previous run's directory (or its summary.json) to fit to instead of probing; or a .yaml/.json of costs.
    costs: Optional[str] = None
    # Activations per rank: bytes (2e9, 2GB, 1.5GiB), 1f1b (p microbatches') or 2x1f1b; null = no limit.
    memory_limit: Optional[str] = None
    weight_grad_fraction: Optional[float] = None  # M_W / M_B, what an I keeps for its W; null: measured
    # Message and runtime costs; null = measured on two ranks of this host before planning.
    comm_latency_s: Optional[float] = None  # per message between ranks
    comm_bandwidth: Optional[float] = None  # bytes/s between ranks
    action_overhead_s: Optional[float] = None  # the pipelining runtime's cost per F/B/I/W action
    corunning_slowdown: Optional[float] = None  # compute time with every rank busy / alone
    comm_busy_delay_s: Optional[float] = None  # added to a message whose sender is computing
    action_jitter: Optional[float] = None  # coefficient of variation of an action's time
    repeats: int = 5  # timings per child; the median is used
    # Candidates predicted within this fraction of the fastest tie (the prediction's own error:
    # BENCHMARKS.md, planner section); the recommended one is then the one with least memory.
    tie_tolerance: float = 0.05
    # Also search action orders for the measured costs under memory_limit: one per microbatch
    # count, placement (1 or 2 stages per rank, looped or V) and split, written as CSV files
    # into the plan directory and listed beside the built-in schedules.
    synthesize: bool = False
    search_budget: int = 200  # orders evaluated per searched layout: bounds the search, not the clock
    # false: score steps that overlap (the Zero Bubble paper's post-validation), which runs get with
    # train.optimizer_sync=deferred: every candidate's command then carries it. A plan of this host
    # or of plan.target scores deferred's steady step (each rank's update between its own steps, a
    # tied weight's gradient sum where its ranks meet, the loss/norm all-reduce waited for a step
    # later; probes run deferred, their bubble.steady fitted); a costs file's the same steady step
    # without updates (floor m(F+B+W)). Each plan also reports the step validated at its own end
    # (evaluations, checkpoints, verify, the last: commit_step_s) and the step over the run.
    barrier: bool = True
    search_seed: int = 0
    # Also plan every other parallel.pp x parallel.dp x parallel.tp of the same number of ranks
    # (tp's collectives costed from a calibrated all-reduce: runner.plan.tp_cost).
    search_degrees: bool = False
    # Cost each candidate whose layout involves tp or FSDP from a rehearsal of it (python -m runner
    # rehearse=on, one process per layout: runner.plan.rehearsed) instead of the tp cost model.
    rehearse: bool = False
