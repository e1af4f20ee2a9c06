"""``python -m runner``: compose the config with Hydra, launch the ranks, print the summary.

Only this outermost entry turns a ``RunnerError`` into an exit code; inside, errors are raised.
"""
# ruff: noqa: E402  (the launch clock starts before the heavy imports)

from __future__ import annotations

import time

_START = time.time()  # "launch": before importing torch, so startup_s counts that too

import os
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.errors import HydraException
from omegaconf import DictConfig
from omegaconf.errors import OmegaConfBaseException

import runner.config  # noqa: F401  (registers the config schemas)
from runner.errors import RunnerError
from runner.launch import launch, under_torchrun
from runner.outputs import format_table


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> float | None:
    summary = launch(cfg, Path(HydraConfig.get().runtime.output_dir), launch_time=_START)
    if summary is None:
        return None
    print(format_table(summary))
    return summary["tokens_per_s"]


def cli() -> None:
    if under_torchrun() and os.environ["RANK"] != "0":
        # Every torchrun rank composes the config, but only rank 0 keeps a run directory.
        sys.argv += ["hydra.run.dir=.", "hydra.output_subdir=null", "hydra/job_logging=stdout"]
    # Let our errors reach the handler below instead of Hydra's traceback printer; Hydra's own
    # config errors stay compact.
    os.environ.setdefault("HYDRA_FULL_ERROR", "1")
    try:
        main()
    except RunnerError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except (HydraException, OmegaConfBaseException) as e:  # a typo or a wrong type
        cause = f"\n{e.__cause__}" if isinstance(e.__cause__, OmegaConfBaseException) else ""
        print(f"{e}{cause}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    cli()
