"""Benchmarks: ``python scripts/bench.py [--only SECTION ...] [--render] [--device cuda] ...``

The sections live in the ``bench`` package at the repository root (``bench/sections/<name>.py``:
each runs and renders its part of BENCHMARKS.md); ``--help`` lists the options.
"""

import sys
from pathlib import Path

# The repository root instead of scripts/: ``bench`` is the package there, not this file.
sys.path[0] = str(Path(__file__).resolve().parents[1])

from bench.cli import main  # noqa: E402

if __name__ == "__main__":
    main()
