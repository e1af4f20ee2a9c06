"""What a run writes, as keys: ``profile.*`` (``ProfileConfig``) and ``logging.*`` (``LoggingConfig``:
the loggers' options; the loggers themselves are the ``logger`` group). Imports nothing heavy."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from runner.options import WandbMode, choices

__all__ = ["ProfileConfig", "LoggingConfig", "WANDB_MODES"]

WANDB_MODES = WandbMode.values()


@dataclass
class ProfileConfig:
    # torch.profiler chrome traces per rank, the merged timeline, schedule.png and the simulated
    # schedule. The executed schedule.csv and the bubble are recorded either way.
    enabled: bool = True
    wait: int = 1  # steps skipped before profiling (the first step includes shape inference)
    warmup: int = 1  # profiler warm-up steps, not recorded
    active: int = 3  # steps recorded


@dataclass
class LoggingConfig:
    tensorboard: bool = False  # rank 0 writes scalars under <run dir>/tensorboard (needs tensorboard)
    # Weights & Biases (needs runner[wandb]). Offline by default so a run needs no network or
    # account; `wandb sync <run dir>/wandb/offline-run-*` uploads it later.
    wandb: bool = False
    wandb_project: str = "runner"  # groups runs in the W&B UI
    # offline | online (needs `wandb login`) | disabled (keep config, log nothing)
    wandb_mode: str = field(default="offline", metadata=choices(WandbMode))
    # MLflow (needs runner[mlflow]): a per-run database, or a shared store to compare runs in one UI.
    mlflow: bool = False
    # null = sqlite:///<run dir>/mlflow.db (no server); or a shared store, e.g. http://host:5000.
    mlflow_tracking_uri: Optional[str] = None
    mlflow_experiment: str = "runner"  # groups runs in the MLflow UI
