"""Weights & Biases (``logger=wandb``). Offline by default, so a run needs no network or account:
``wandb sync <run dir>/wandb/offline-run-*`` uploads it later; ``mode=online`` logs live.

Everything wandb writes for the run stays in the run directory: its run files (``dir=``) and the
debug log of the service it starts (``core-debug-*.log``), which wandb puts under its cache directory
(``WANDB_CACHE_DIR``, by default ``~/.cache/wandb``): that variable points at ``<run dir>/wandb/cache``
while the service starts, unless the user set it."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Iterator, Literal

from runner.errors import ConfigError
from runner.outputs.config import WANDB_MODES
from runner.outputs.loggers import Logger


class WandbLogger(Logger):
    EXTRA = "wandb"

    @staticmethod
    def requires(options) -> list[str]:
        return ["wandb"]

    @staticmethod
    def check(options, key_of) -> None:
        mode = options.get("mode", "offline")
        if mode not in WANDB_MODES:
            raise ConfigError(f"{key_of('mode')}={mode!r} is not one of {', '.join(WANDB_MODES)}.")

    def __init__(self, *, run_dir: Path, hparams: dict, name: str, group: str | None, project: str = "runner",
                 mode: Literal["offline", "online", "disabled"] = "offline"):  # WANDB_MODES: check() refuses others
        import wandb  # optional extra: runner[wandb]

        # The process-wide settings must carry the mode too: with only the run's mode offline,
        # wandb 0.31's telemetry still contacts the server (a DNS lookup and a POST at exit).
        with _default_env("WANDB_CACHE_DIR", str(run_dir / "wandb" / "cache")):  # the service's debug log
            wandb.setup(settings=wandb.Settings(mode=mode))
            self.run = wandb.init(project=project, mode=mode, dir=str(run_dir), config=hparams, name=name,
                                  group=group)

    def log(self, numbers: dict[str, float], step: int) -> None:
        self.run.log(numbers, step=step)

    def finish(self, final: dict[str, float], step: int, *, failed: bool, artifacts: list[Path]) -> None:
        self.run.summary.update(final)  # one number per run: the summary, not a time series
        self.run.finish(exit_code=1 if failed else 0)


@contextlib.contextmanager
def _default_env(name: str, value: str) -> Iterator[None]:
    """``name`` set to ``value`` in this process's environment for the block, unless already set;
    as it was afterwards (what a process started in the block inherits keeps it)."""
    if name in os.environ:
        yield
        return
    os.environ[name] = value
    try:
        yield
    finally:
        os.environ.pop(name, None)
