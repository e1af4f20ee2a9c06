"""Shim (relayout: keep-file): the experiment loggers moved to ``runner.outputs.loggers`` (issue #34).

Kept so that ``_target_: runner.loggers.<name>.<Class>`` in an older run's ``.hydra/config.yaml`` or
Optuna sweep directory still resolves. New code imports ``runner.outputs.loggers``.
"""

from runner.outputs.loggers import Logger, build_loggers, check_loggers, enabled_loggers

__all__ = ["Logger", "enabled_loggers", "check_loggers", "build_loggers"]
