"""Every benchmark section, in the order they run and appear in BENCHMARKS.md. A new section is a
module here defining ``SECTION`` (how it runs, how it renders) and one line below."""

from __future__ import annotations

from bench.section import Section
from bench.sections import (
    checkpointing,
    device,
    efficiency,
    ending,
    gpu_checks,
    hf,
    optimizer_sync,
    options,
    overhead,
    planner,
    profiling,
    rehearsal,
    rehearsal_scale,
    scaling,
    startup,
    synthesis,
    target,
    threads,
    tp,
    zb_overlap,
    zb_paper,
)

SECTIONS: dict[str, Section] = {s.name: s for s in (
    efficiency.SECTION,
    scaling.SECTION,
    options.SECTION,
    overhead.SECTION,
    startup.SECTION,
    profiling.SECTION,
    checkpointing.SECTION,
    planner.SECTION,
    synthesis.SECTION,
    target.SECTION,
    zb_paper.SECTION,
    zb_overlap.SECTION,
    optimizer_sync.SECTION,
    device.SECTION,
    gpu_checks.SECTION,
    hf.SECTION,
    tp.SECTION,
    rehearsal.SECTION,
    rehearsal_scale.SECTION,
    threads.SECTION,
    ending.SECTION,
)}

__all__ = ["SECTIONS", "Section"]
