"""The ``schedule`` group's schemas: a schedule of the registry (``runner.pipeline.registry``) by name,
or a CSV file of actions (``schedule=csv``). Imports nothing heavy."""

from __future__ import annotations

from dataclasses import dataclass, field

from omegaconf import MISSING

from runner.options import choices
from runner.pipeline.registry import schedule_names

__all__ = ["ScheduleConfig", "CsvScheduleConfig"]


@dataclass
class ScheduleConfig:
    # A schedule of the registry runner.pipeline.registry (gpipe, 1f1b, interleaved_1f1b, looped_bfs,
    # interleaved_zb, zbv, dualpipev), or csv.
    name: str = field(default=MISSING, metadata=choices(schedule_names, set_as="schedule"))


@dataclass
class CsvScheduleConfig(ScheduleConfig):
    name: str = field(default="csv", metadata=choices(schedule_names, set_as="schedule"))
    # Path to a compute-only action CSV (one row per pipeline rank, e.g. "0F0,0F1,2F0,...").
    csv: str = MISSING
