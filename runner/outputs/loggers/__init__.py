"""Experiment loggers, one module each, composed as Hydra's ``logger`` group:
``logger=wandb``, ``'logger=[tensorboard,mlflow]'``; each option is ``conf/logger/<name>.yaml``
holding the ``_target_`` of its class and its options. The older spelling ``logging.<name>=true``
selects the same class, with its options from ``logging.*``.

A logger is a class built with ``(run_dir=, hparams=, name=, group=, **options)`` that offers
``log(numbers, step)`` and ``finish(final, step, failed, artifacts)``, and says before launch what
it needs: ``requires(options)`` (packages), ``EXTRA`` (the pip extra that installs them) and
``check(options, key_of)`` (its option values). Adding one is a module here and its yaml.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any, Callable, Mapping, cast

from runner.errors import ConfigError

__all__ = ["Logger", "enabled_loggers", "check_loggers", "build_loggers"]


class Logger:
    """The interface (and its defaults): see the module docstring."""

    EXTRA = ""

    def __init__(self, *, run_dir: Path, hparams: dict, name: str, group: str | None, **options: Any) -> None:
        """Start the logger's run: in ``run_dir`` (its files), with the run's config as ``hparams``,
        named and grouped as ``runner.outputs.metrics.run_identity`` says; ``options`` from its yaml."""

    @staticmethod
    def requires(options: Mapping[str, Any]) -> list[str]:
        return []

    @staticmethod
    def check(options: Mapping[str, Any], key_of: Callable[[str], str]) -> None:
        """Raise ``ConfigError`` for an option value the logger cannot take (``key_of(option)``
        is how the user spelt its key)."""

    def log(self, numbers: dict[str, float], step: int) -> None:
        raise NotImplementedError

    def finish(self, final: dict[str, float], step: int, *, failed: bool, artifacts: list[Path]) -> None:
        raise NotImplementedError


# logging.<name>=true (the older spelling): the class of conf/logger/<name>.yaml, options from logging.*.
_LEGACY: dict[str, Callable[[Any], dict[str, Any]]] = {
    "tensorboard": lambda o: {"_target_": "runner.outputs.loggers.tensorboard.TensorBoardLogger"},
    "wandb": lambda o: {"_target_": "runner.outputs.loggers.wandb.WandbLogger", "project": o.wandb_project,
                        "mode": o.wandb_mode},
    "mlflow": lambda o: {"_target_": "runner.outputs.loggers.mlflow.MLflowLogger",
                         "tracking_uri": o.mlflow_tracking_uri, "experiment": o.mlflow_experiment},
}


def enabled_loggers(logging_options: Any, group: Mapping[str, Any] | None) -> dict[str, tuple[dict, bool]]:
    """name -> (its config with ``_target_``, whether the older ``logging.<name>`` enabled it)."""
    out = {name: (dict(conf), False) for name, conf in (group or {}).items() if conf}
    for name, make in _LEGACY.items():
        if logging_options is not None and getattr(logging_options, name, False) and name not in out:
            out[name] = (make(logging_options), True)
    return out


def _split(conf: Mapping[str, Any]) -> tuple[type[Logger], dict[str, Any]]:
    from hydra.utils import get_class

    # A _target_ names a class with Logger's interface (subclassing it is how it gets the defaults).
    return cast("type[Logger]", get_class(conf["_target_"])), {k: v for k, v in conf.items() if not k.startswith("_")}


def _key_of(name: str, legacy: bool) -> Callable[[str], str]:
    return (lambda option: f"logging.{name}_{option}") if legacy else (lambda option: f"logger.{name}.{option}")


def check_loggers(logging_options: Any, group: Mapping[str, Any] | None = None) -> None:
    """Before launch, cheaply (no logger package is imported): every enabled logger's packages are
    installed and its options are ones it takes."""
    for name, (conf, legacy) in enabled_loggers(logging_options, group).items():
        cls, options = _split(conf)
        cls.check(options, _key_of(name, legacy))
        missing = [m for m in cls.requires(options) if importlib.util.find_spec(m) is None]
        if missing:
            key, off = (f"logging.{name}=true", f"logging.{name}=false") if legacy else (
                f"logger={name}", f"leave {name} out of logger")
            raise ConfigError(f"{key} needs {', '.join(missing)} (not installed). Fix: pip install -e "
                              f"'.[{cls.EXTRA}]' (or 'runner[{cls.EXTRA}]'), or {off}.")


def build_loggers(logging_options: Any, group: Mapping[str, Any] | None, *, run_dir: Path, hparams: dict,
                  name: str, group_name: str | None) -> list[Logger]:
    loggers = []
    for conf, _ in enabled_loggers(logging_options, group).values():
        cls, options = _split(conf)
        loggers.append(cls(run_dir=run_dir, hparams=hparams, name=name, group=group_name, **options))
    return loggers
