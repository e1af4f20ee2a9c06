"""What a run writes, as keys: ``profile.*`` (``ProfileConfig``) and ``logging.*`` (``LoggingConfig``:
the loggers' older spelling, refused with its fix; the loggers are the ``logger`` group). Imports nothing heavy."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from runner.options import WandbMode

__all__ = ["ProfileConfig", "LoggingConfig", "LOGGING_MOVED", "WANDB_MODES"]

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
    """The older spelling of the loggers, refused before launch (``runner.validate``): the loggers are
    the ``logger`` group (``logger=wandb``, ``'logger=[tensorboard,mlflow]'``) and their options are
    ``logger.<name>.*``. Null = not set; any value is refused with its fix (``LOGGING_MOVED``)."""

    tensorboard: Optional[bool] = None  # logger=tensorboard
    wandb: Optional[bool] = None  # logger=wandb
    wandb_project: Optional[str] = None  # logger.wandb.project
    wandb_mode: Optional[str] = None  # logger.wandb.mode
    mlflow: Optional[bool] = None  # logger=mlflow
    mlflow_tracking_uri: Optional[str] = None  # logger.mlflow.tracking_uri
    mlflow_experiment: Optional[str] = None  # logger.mlflow.experiment


# logging.<key> -> where it went: the logger group's option, or the key of its yaml (logger.<name>.<option>).
LOGGING_MOVED = {"tensorboard": ("tensorboard", None), "wandb": ("wandb", None),
                 "wandb_project": ("wandb", "project"), "wandb_mode": ("wandb", "mode"),
                 "mlflow": ("mlflow", None), "mlflow_tracking_uri": ("mlflow", "tracking_uri"),
                 "mlflow_experiment": ("mlflow", "experiment")}
