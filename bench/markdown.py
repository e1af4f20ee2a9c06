"""Formatting for the renderers: numbers, the line saying when and under what load a section ran,
the mark of a run that shared the machine, and ratio lists and tables."""

from __future__ import annotations

import statistics
from typing import Any, Mapping, Sequence


def num(x: Any, fmt: str = ".3f") -> str:
    return "" if x is None else format(x, fmt)


def meta_line(meta: Mapping[str, Any], runs: Sequence[Mapping[str, Any]] | None = None) -> str:
    """When, how long, the command, and how loaded the machine was: over the whole section, and
    (``runs`` with ``under_load``/``rerun`` flags) for the runs whose numbers are kept."""
    dur = meta.get("duration_s")
    waits = meta.get("waits") or []
    waited = sum(w.get("waited_s", 0) for w in waits)
    load = meta.get("load") or {}
    parts = [f"Ran {meta.get('date', '?')}"
             + (f", {dur / 60:.1f} min" if dur is not None else "")
             + (f" (waits for a quiet machine before and within it: {waited / 60:.1f} min)" if waited >= 60 else ""),
             f"`{meta.get('command', '')}`"]
    m = meta.get("machine") or {}
    if m:
        parts.append(f"torch {m.get('torch')}, {m.get('cores')} cores")
    share = load.get("foreign_cpu_share")
    section = ", ".join(filter(None, [
        f"other processes used {share:.0%} of the CPU over the section" if share is not None else "",
        f"pytest seen in {load['pytest_samples']} of {load.get('samples')} samples" if load.get("pytest_samples")
        else "",
        "the machine was still busy when a wait ran out" if any(not w.get("quiet", True) for w in waits) else ""]))
    flagged = [r for r in runs or [] if "under_load" in r]
    if flagged:
        reran = sum(bool(r.get("rerun")) for r in flagged)
        still = sum(bool(r.get("under_load")) for r in flagged)
        kept = (f"**{still} of {len(flagged)} kept results ran under load** (marked *)" if still
                else f"none of the {len(flagged)} kept results shared the machine")
        parts.append(kept + (f", after re-running {reran} that had" if reran else "") + (f"; {section}" if section
                                                                                          else ""))
    elif section:
        heavy = bool(load.get("pytest_samples")) or (share or 0) > 0.1 or any(not w.get("quiet", True) for w in waits)
        parts.append(("**ran under load**: " if heavy else "quiet machine: ") + section)
    return "_" + "; ".join(parts) + "._"


def star(run: Mapping[str, Any]) -> str:
    return "*" if run.get("under_load") else ""


def ratios_line(pairs: Sequence[Mapping[str, Any]]) -> str:
    vals = [p["ratio"] for p in pairs if p.get("ratio") is not None]
    errors = [p["error"] for p in pairs if p.get("error")]
    text = ", ".join(f"{p['ratio']:.3f}{star(p)}" for p in pairs if p.get("ratio") is not None)
    if vals:
        text += f" (median {statistics.median(vals):.3f}, min {min(vals):.3f}, max {max(vals):.3f})"
    if errors:
        text += f"; {len(errors)} failed: {errors[0]}"
    return text or "no result"


def ratio_table(ratios: Mapping[str, list[float]], specs: Sequence[tuple[str, str, str]]) -> list[str]:
    lines = ["| ratio | per repeat | median |", "|---|---|---|"]
    for label, _, _ in specs:
        vals = ratios.get(label)
        lines.append(f"| {label} | {', '.join(f'{v:.3f}' for v in vals) if vals else 'n/a'} | "
                     f"{num(statistics.median(vals)) if vals else ''} |")
    return lines


def against_one(pairs: Sequence[Mapping[str, Any]], what: str) -> str:
    """Whether repeated ratios against a baseline tell ``what`` apart from it: all above 1, all
    below, or on both sides (within the run-to-run spread)."""
    vals = [p["ratio"] for p in pairs if p.get("ratio") is not None]
    if len(vals) < 2:
        return ""
    if min(vals) <= 1 <= max(vals):
        return f" The ratios fall on both sides of 1: {what} is within the run-to-run spread of its baseline."
    if min(vals) > 1:
        return f" {what[0].upper()}{what[1:]} is slower in every repeat, by {min(vals) - 1:.1%} to {max(vals) - 1:.1%}."
    return f" {what[0].upper()}{what[1:]} is faster in every repeat, by {1 - max(vals):.1%} to {1 - min(vals):.1%}."
