"""The unit every schedule is made of: one compute action of one stage on one microbatch.

A light module of its own, so that the modules that read, record, draw or simulate orders
(``schedule``, ``schedule_file``, ``record``, ``timeline``, ``plan.simulate``) depend on the type
and nothing else.
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["Op"]


class Op(NamedTuple):
    stage: int
    kind: str  # F (forward), B (full backward), I (input gradient) or W (weight gradient)
    microbatch: int

    @property
    def name(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"
