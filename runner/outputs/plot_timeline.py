"""Draw one pipeline step of a run's measured ``timeline.json`` as a PNG (what Perfetto shows,
as a picture: compute per rank, arrows for the activations and gradients sent between ranks).

    runner-timeline outputs/<date>/<time> [--step N] [--first K] [--actions N] [-o timeline.png]

(installed with the package; ``python -m runner.outputs.plot_timeline`` is the same). A run with
profiling on draws its last step's first 32 actions as ``timeline.png`` itself; this draws others.

A long step (many stages and microbatches) is drawn as a window: from the busiest rank's K-th
action (0 = the step's start) over its next N actions (default 32), every rank's actions in that
time span, each labelled with its stage, kind and microbatch.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from runner.outputs.timeline import plot_schedule
from runner.pipeline.ops import Op
from runner.pipeline.simulate import SimAction


def window(actions: list[SimAction], first: int, count: int) -> tuple[float, float]:
    """The time span from the busiest rank's ``first``-th action to the end of its
    ``first + count - 1``-th: a window of about ``count`` actions on every rank."""
    busiest = max({a.rank for a in actions}, key=lambda r: sum(a.rank == r for a in actions))
    own = sorted((a for a in actions if a.rank == busiest), key=lambda a: a.start)
    first = min(first, len(own) - 1)
    return own[first].start, own[min(first + count, len(own)) - 1].end


def draw(run_dir: Path, output: Path, *, step: int | None = None, first: int = 0,
         count: int = 32, about: dict | None = None) -> tuple[int, int]:
    """Draw the window; returns (actions drawn, how many carry their full label). ``about``: the
    run's ``schedule``, ``pp`` and ``microbatches`` for the title (else read from its summary.json:
    a run draws its own picture before the summary is written)."""
    events = json.loads((run_dir / "timeline.json").read_text())["traceEvents"]
    computes = [e for e in events if e["ph"] == "X" and e["name"].startswith("compute:")]
    step = step if step is not None else max(e["args"]["step"] for e in computes)
    chosen = [e for e in computes if e["args"]["step"] == step]
    origin = min(e["ts"] for e in chosen)
    every = [SimAction(e["pid"], Op(e["args"]["stage"], e["args"]["kind"], e["args"]["microbatch"]),
                       (e["ts"] - origin) / 1e3, (e["ts"] + e["dur"] - origin) / 1e3) for e in chosen]
    lo, hi = window(every, first, count)
    shown = [a for a in every if a.end > lo and a.start < hi]  # what overlaps the window
    span = (min(a.start for a in shown) * 1e3 + origin, max(a.end for a in shown) * 1e3 + origin)
    starts = {e["id"]: e for e in events if e["ph"] == "s" and span[0] <= e["ts"] <= span[1]}
    arrows = [((starts[e["id"]]["ts"] - origin) / 1e3, starts[e["id"]]["pid"], (e["ts"] - origin) / 1e3, e["pid"])
              for e in events if e["ph"] == "f" and e["id"] in starts and span[0] <= e["ts"] <= span[1]]
    summary = about or json.loads((run_dir / "summary.json").read_text())
    part = "" if len(shown) == len(every) else f", {len(shown)} of its {len(every)} actions"
    labelled = plot_schedule(output, shown, xlabel="time (ms), measured", arrows=arrows,
                         title=f"{summary['schedule']}: step {step} as measured{part}, pp={summary['pp']}, "
                               f"{summary['microbatches']} microbatches")
    return len(shown), labelled


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="runner-timeline", description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--step", type=int, default=None, help="recorded step to draw (default: the last)")
    parser.add_argument("--first", type=int, default=0, help="window start: the busiest rank's K-th action")
    parser.add_argument("--actions", type=int, default=32, help="window length: actions of the busiest rank")
    parser.add_argument("-o", "--output", type=Path, default=None)
    args = parser.parse_args(argv)
    output = args.output or args.run_dir / "timeline.png"
    draw(args.run_dir, output, step=args.step, first=args.first, count=args.actions)
    print(output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
