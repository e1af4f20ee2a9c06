"""Shim (relayout: keep-file): moved to ``runner.outputs.loggers.mlflow`` (issue #34); an older run's
``_target_: runner.loggers.mlflow.MLflowLogger`` still resolves here."""

from runner.outputs.loggers.mlflow import MLflowLogger

__all__ = ["MLflowLogger"]
