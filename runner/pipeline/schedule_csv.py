"""Write a built-in schedule's action order as a compute-only CSV, a starting point for a custom
schedule (``python -m runner schedule=csv schedule.csv=<file>``).

    runner-schedule-csv interleaved_1f1b --pp 2 --microbatches 4 > my_schedule.csv

(installed with the package; ``python -m runner.pipeline.schedule_csv`` is the same).

The order is the one that runs (``runner.pipeline.schedule.schedule_order``: torch's declared order with
overlapped F;B cells expanded and 1F1B's last rank renumbered as torch runs it; the test suite
compares it with what real runs recorded), and the file is linted exactly as a run lints it.
"""

from __future__ import annotations

import argparse
import sys
import tempfile

from runner.errors import ConfigError
from runner.pipeline.schedule import SCHEDULES, default_stages_per_rank, read_csv_schedule, schedule_order


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="runner-schedule-csv", description=__doc__.splitlines()[0])
    parser.add_argument("schedule", choices=sorted(SCHEDULES))
    parser.add_argument("--pp", type=int, default=2, help="pipeline ranks")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--stages-per-rank", type=int, default=None)
    args = parser.parse_args(argv)

    spr = args.stages_per_rank or default_stages_per_rank(args.schedule)
    try:  # torch's own checks of the layout, as before a run
        order = schedule_order(args.schedule, args.pp, args.microbatches, spr)
    except (ValueError, AssertionError, RuntimeError) as e:
        print(f"error: torch rejects {args.schedule} with --pp {args.pp} --microbatches {args.microbatches} "
              f"and {spr} stages per rank: {e}", file=sys.stderr)
        return 1
    text = "".join(",".join(op.name for op in order[rank]) + "\n" for rank in range(args.pp))
    with tempfile.NamedTemporaryFile("w", suffix=".csv") as f:
        f.write(text)
        f.flush()
        try:
            read_csv_schedule(f.name, pp=args.pp, stages_per_rank=None, microbatches=args.microbatches)
        except ConfigError as e:  # a bug in the order extraction: refuse rather than write it
            print(f"error: the order of {args.schedule} does not lint as a CSV:\n{e}", file=sys.stderr)
            return 1
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
