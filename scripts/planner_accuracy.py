"""The planner's error on single plans, from a planner benchmark's JSON (``benchmarks/planner.json``):

    python scripts/planner_accuracy.py [benchmarks/planner.json] [--json]

Per model size and over all sizes: median and 90th percentile of |predicted / measured - 1| over
every (round, configuration), for the configurations each round's plan probed and the others."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # bench/ from a checkout

from bench.accuracy import accuracy  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", nargs="?", type=Path, default=Path("benchmarks/planner.json"))
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args(argv)
    figures = accuracy(json.loads(args.path.read_text()))
    if args.json:
        print(json.dumps(figures, indent=2))
        return 0
    for size, groups in figures.items():
        for group, f in groups.items():
            if f:
                print(f"{size:9} {group:10} n={f['n']:3d}  median {f['median']:6.1%}  p90 {f['p90']:6.1%}  "
                      f"signed median {f['signed_median']:+6.1%}  within 10%: {f['within_10']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
