"""The planner's keys for plans on hardware this host does not have (``plan.target``): a schema
of their own, which ``runner.config.PlanConfig`` extends (its fields sit beside the other
``plan.*`` keys). Imports nothing heavy: every command line composes the config."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

__all__ = ["TargetPlanConfig"]


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
