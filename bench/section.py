"""What a benchmark section is: how it runs, how its part of BENCHMARKS.md is rendered, and how
many ranks it runs at once. Each ``bench/sections/<name>.py`` defines one ``SECTION``."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

from bench.runs import Context


@dataclass(frozen=True)
class Page:
    """Where the rendered file goes (links are relative to its folder) and the bubble plot."""

    out_dir: Path
    plot_path: Path


def _two_ranks(args: argparse.Namespace) -> int:
    return 2


@dataclass(frozen=True)
class Section:
    name: str
    run: Callable[[Context], dict[str, Any]]  # the raw results, saved as benchmarks/<name>.json
    render: Callable[[Mapping[str, Any], Page], list[str]]  # that file ({"meta", "results"}) as Markdown lines
    ranks: Callable[[argparse.Namespace], int] = _two_ranks  # at once; with --device cuda, a GPU each
    times_runs: bool = True  # False: it times nothing of its own, so it does not wait for a quiet machine first
    cuda_only: bool = False  # runs only with --device cuda, and is missing only from BENCHMARKS-cuda.md
