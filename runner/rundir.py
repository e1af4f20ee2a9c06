"""A run directory that belongs to a run in progress is refused before Hydra writes into it.

Hydra creates the run directory, saves ``.hydra/`` (config, overrides) and opens the job's log
before the task function runs, so the run's own lock check (``runner.checkpoint.files.hold_run_lock``,
taken by the launcher) comes too late to keep a rejected command out of a live run's directory.
``RunDirGuard`` (a Hydra callback, registered in ``conf/config.yaml``) checks the lock in
``on_run_start``, before any of that. Hydra turns an exception a callback raises into a warning,
so the refusal travels as ``Rejected``, which ``runner.exits.run_entry`` unwraps."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from runner.checkpoint.files import in_use_error, run_in_progress
from runner.errors import Rejected
from runner.ranks.env import under_torchrun

__all__ = ["RunDirGuard"]


class RunDirGuard(Callback):
    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        if under_torchrun() and os.environ.get("RANK") != "0":  # these ranks keep no run directory
            return
        try:
            run_dir = OmegaConf.select(config, "hydra.run.dir")
        except OmegaConfBaseException:  # an interpolation only the job can resolve: Hydra will say so
            return
        if run_dir is not None and run_in_progress(Path(str(run_dir)).expanduser().resolve()):
            raise Rejected(in_use_error(Path(str(run_dir))))
