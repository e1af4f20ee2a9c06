"""Shim (relayout: keep-file): moved to ``runner.outputs.loggers.wandb`` (issue #34); an older run's
``_target_: runner.loggers.wandb.WandbLogger`` still resolves here."""

from runner.outputs.loggers.wandb import WandbLogger

__all__ = ["WandbLogger"]
