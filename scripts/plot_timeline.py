"""Draw one pipeline step of a run's measured ``timeline.json`` as a PNG (what Perfetto shows,
as a picture: compute per rank, arrows for the activations and gradients sent between ranks).

    python scripts/plot_timeline.py outputs/<date>/<time> [--step N] [-o timeline.png]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from runner.simulate import Op, SimAction
from runner.timeline import plot_schedule


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--step", type=int, default=None, help="recorded step to draw (default: the last)")
    parser.add_argument("-o", "--output", type=Path, default=None)
    args = parser.parse_args()

    events = json.loads((args.run_dir / "timeline.json").read_text())["traceEvents"]
    computes = [e for e in events if e["ph"] == "X" and e["name"].startswith("compute:")]
    step = args.step if args.step is not None else max(e["args"]["step"] for e in computes)
    chosen = [e for e in computes if e["args"]["step"] == step]
    origin = min(e["ts"] for e in chosen)
    actions = [SimAction(e["pid"], Op(e["args"]["stage"], e["args"]["kind"], e["args"]["microbatch"]),
                         (e["ts"] - origin) / 1e3, (e["ts"] + e["dur"] - origin) / 1e3) for e in chosen]
    window = (min(e["ts"] for e in chosen), max(e["ts"] + e["dur"] for e in chosen))
    starts = {e["id"]: e for e in events if e["ph"] == "s" and window[0] <= e["ts"] <= window[1]}
    arrows = [((starts[e["id"]]["ts"] - origin) / 1e3, starts[e["id"]]["pid"], (e["ts"] - origin) / 1e3, e["pid"])
              for e in events if e["ph"] == "f" and e["id"] in starts]
    summary = json.loads((args.run_dir / "summary.json").read_text())
    output = args.output or args.run_dir / "timeline.png"
    plot_schedule(output, actions, xlabel="time (ms), measured", arrows=arrows,
                  title=f"{summary['schedule']}: step {step} as measured, pp={summary['pp']}, "
                        f"{summary['microbatches']} microbatches")
    print(output)


if __name__ == "__main__":
    main()
