"""Shim (relayout: keep-file): moved to ``runner.outputs.loggers.tensorboard`` (issue #34); an older run's
``_target_: runner.loggers.tensorboard.TensorBoardLogger`` still resolves here."""

from runner.outputs.loggers.tensorboard import TensorBoardLogger

__all__ = ["TensorBoardLogger"]
