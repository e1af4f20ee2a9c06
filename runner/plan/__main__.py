"""``python -m runner.plan``: the planner's command line (see ``runner.plan.planner``).

    python -m runner.plan parallel.pp=4 model.n_layers=16          # the same overrides as a run
    python -m runner.plan plan.costs=outputs/<date>/<time> plan.memory_limit=2GB

Prints the calibration, the ranked table and the ``python -m runner ...`` line of the
recommended candidate; writes ``plan.json`` (every candidate, fastest first),
``calibration.json``, ``fit.json`` (the cost model fitted to the probe runs, which are kept under
``probes/``) and ``plan_timeline.json`` (the recommended candidate's predicted timeline) into the
Hydra run directory.
"""

from __future__ import annotations

import json
import logging
import shlex
from dataclasses import asdict
from pathlib import Path

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from runner.config import config_dir  # also registers the schemas
from runner.launch import launch  # runs the probes
from runner.plan.planner import plan
from runner.plan.report import fit_line, label, search_report, table
from runner.timeline import simulated_slices, write_chrome_trace


@hydra.main(config_path=str(config_dir()), config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    torch.set_num_threads(cfg.launch.threads_per_rank or 1)  # as one rank of the run would
    logging.getLogger("runner.validate").setLevel(logging.WARNING)  # one line per candidate otherwise
    out = Path(HydraConfig.get().runtime.output_dir)
    candidates, timelines, calibration, model = plan(cfg, out, launch)
    (out / "plan.json").write_text(json.dumps([asdict(c) for c in candidates], indent=2) + "\n")
    if calibration is not None:
        (out / "calibration.json").write_text(json.dumps(asdict(calibration), indent=2) + "\n")
        c = calibration
        print(f"message: {c.latency_s * 1e6:.0f} us + bytes / {c.bandwidth / 1e9:.2f} GB/s, "
              f"+{c.busy_delay_s * 1e6:.0f} us while its sender computes; runtime overhead per action: "
              f"{c.action_overhead_s * 1e6:.0f} us; compute x{c.corunning_slowdown:.2f} with both ranks busy, "
              f"varying by {c.action_jitter:.0%}")
    if model is not None and model.probes:
        (out / "fit.json").write_text(json.dumps(asdict(model), indent=2) + "\n")
        print(fit_line(model))
    print(table(candidates))
    for line in search_report(candidates):
        print(line)
    best = next((c for c in candidates if c.recommended), None)
    if best is None:
        print("no valid candidate fits; see the reasons above")
        return
    timeline = timelines[id(best)]
    write_chrome_trace(out / "plan_timeline.json", simulated_slices(timeline), ranks=sorted({a.rank for a in timeline}))
    tied = [c for c in candidates if c.tie]
    if tied:
        print(f"\ntie: {len(tied)} candidates are predicted within {cfg.plan.tie_tolerance:.0%} "
              f"(plan.tie_tolerance) of the fastest, closer than the prediction can tell apart: "
              f"{', '.join(label(c) for c in tied)}. Recommended of those: the least activation memory.")
    # The user's overrides, less the planner's own and the ones each candidate sets itself.
    chosen = ("plan.", "schedule", "parallel.microbatches=", "parallel.stages_per_rank=", "parallel.split_points=")
    overrides = [o for o in HydraConfig.get().overrides.task if not o.startswith(chosen)]
    searched = next((c for c in candidates if c.schedule == "synthesized" and c.valid and c.fits_memory), None)
    if searched is not None:
        print(f"\nfastest synthesized: python -m runner {shlex.join(overrides + searched.overrides)}")
    # Quoted: a split is a [list].
    print(f"\n{'best (tied)' if best.tie else 'best'}: python -m runner {shlex.join(overrides + best.overrides)}")


if __name__ == "__main__":
    main()
