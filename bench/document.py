"""BENCHMARKS.md from every benchmarks/<section>.json present: a header (how it is made, the
machine), each section's part as its module renders it, and what has not been measured. Nothing
in it is written by hand: re-rendering reproduces it from the JSON."""

from __future__ import annotations

import json
import os
from pathlib import Path

from bench.section import Page
from bench.sections import SECTIONS


def render(results_dir: Path, output: Path, plot_path: Path | None = None) -> str:
    """BENCHMARKS.md from every benchmarks/<section>.json present; sections without one are listed."""
    found = {}
    for section in SECTIONS:
        path = results_dir / f"{section}.json"
        if path.is_file():
            found[section] = json.loads(path.read_text())
    plot_path = plot_path or results_dir / "bubble.png"
    out_dir = output.parent
    rel_results = os.path.relpath(results_dir, out_dir)
    lines = ["# Benchmarks", "",
             "Rendered by `scripts/bench.py` from the raw results in `" + rel_results + "/<section>.json` (machine, "
             "torch version, date, command and every run's numbers). Re-run a section with `python scripts/bench.py "
             "--only <section>` to refresh only its part; `--render` rebuilds this file from the JSON. Ratios, not "
             "absolute times, carry over between machines; each section says how long it took and whether it ran "
             "under load (another process using the cores). The observations under each table are computed from "
             "the same JSON: nothing here is written by hand.", ""]
    machines = {json.dumps(d["meta"].get("machine"), sort_keys=True) for d in found.values()}
    if len(machines) == 1 and found:
        m = next(iter(found.values()))["meta"]["machine"]
        on = f"{m['device_name']}, NCCL" if m.get("device") == "cuda" else "CPU, gloo"
        lines += [f"Machine: {m.get('cpu')}, {m.get('arch')}, {m.get('cores')} cores, {m.get('platform')}; "
                  f"Python {m.get('python')}, torch {m.get('torch')}; {on}.", ""]
    elif found:
        lines += ["Sections ran on different machines or torch versions: see each section's line.", ""]
    page = Page(out_dir, plot_path)
    for name, section in SECTIONS.items():
        if name in found:
            try:
                lines += section.render(found[name], page)
            except Exception as e:  # a results file from an older layout: say so, keep the rest
                lines += [f"## {name}", "", f"Could not render `{name}.json`: {type(e).__name__}: {e}", ""]
    cuda_page = any((d["meta"].get("machine") or {}).get("device") == "cuda" for d in found.values())
    missing = [s for s, section in SECTIONS.items() if s not in found and (cuda_page or not section.cuda_only)]
    todo = []
    if missing:
        todo.append("- No results yet for: " + ", ".join(missing) + " (`python scripts/bench.py --only "
                    + " ".join(missing) + "`).")
    if not cuda_page:
        todo.append("- GPU runs: `python scripts/bench.py --device cuda` writes `BENCHMARKS-cuda.md` (on one GPU "
                    "only the `device` section runs; the others need a GPU per rank).")
    if todo:
        lines += ["## Not measured", "", *todo, ""]
    text = "\n".join(lines)
    output.write_text(text)
    return text
