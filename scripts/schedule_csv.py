"""Write a built-in schedule's compute-only action order as a CSV, a starting point for a custom
schedule (``python -m runner schedule=csv schedule.csv=<file>``).

    python scripts/schedule_csv.py interleaved_1f1b --pp 2 --microbatches 4 > my_schedule.csv

The order is the one the torch class declares; the file is linted exactly as a run would lint it,
and rejected if torch's declaration is not a runnable compute-only schedule (in torch 2.13 the
declared order of 1F1B's last rank is off by one microbatch).
"""

from __future__ import annotations

import argparse
import sys
import tempfile

from torch.distributed.pipelining.schedules import get_schedule_class

from runner import _torch_pp
from runner.errors import ConfigError
from runner.schedule import SCHEDULES, default_stages_per_rank, read_csv_schedule


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("schedule", choices=sorted(SCHEDULES))
    parser.add_argument("--pp", type=int, default=2, help="pipeline ranks")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--stages-per-rank", type=int, default=None)
    args = parser.parse_args()

    spr = args.stages_per_rank or default_stages_per_rank(args.schedule)
    stages = _torch_pp.stand_in_stages(args.pp, args.pp * spr, spr)
    cls = get_schedule_class(SCHEDULES[args.schedule])
    schedule = cls(stages[0] if spr == 1 else stages, args.microbatches)
    rows = [",".join(str(a) for a in schedule.pipeline_order[rank] if a is not None and a.is_compute_op)
            for rank in range(args.pp)]
    text = "\n".join(rows) + "\n"
    with tempfile.NamedTemporaryFile("w", suffix=".csv") as f:
        f.write(text)
        f.flush()
        try:
            read_csv_schedule(f.name, pp=args.pp, stages_per_rank=None, microbatches=args.microbatches)
        except ConfigError as e:
            print(f"error: torch's declared order for {args.schedule} is not runnable as a CSV:\n{e}",
                  file=sys.stderr)
            return 1
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
