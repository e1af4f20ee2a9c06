"""Benchmark results for the renderers' tests: a section's JSON as ``scripts/bench.py`` saves it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_section(results: Path, name: str, payload: dict[str, Any], **meta: Any) -> None:
    """``results/<name>.json``: ``payload`` with a quiet test machine's metadata (``meta`` overrides it)."""
    results.mkdir(parents=True, exist_ok=True)
    meta = {"date": "2026-01-01 00:00", "command": "python scripts/bench.py", "duration_s": 60.0, "waits": [],
            "load": {"pytest_samples": 0, "samples": 4, "foreign_cpu_share": 0.01},
            "machine": {"cpu": "test", "cores": 2, "torch": "x"}, **meta}
    (results / f"{name}.json").write_text(json.dumps({"meta": meta, "results": payload}))
