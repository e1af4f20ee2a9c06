"""Experiment loggers, one module each, composed as Hydra's ``logger`` group:
``logger=wandb``, ``'logger=[tensorboard,mlflow]'``; each option is ``conf/logger/<name>.yaml``
holding the ``_target_`` of its class and its options. The older spelling ``logging.<name>=true``
is refused before launch with this one as its fix (``runner.validate``).

A logger is a class built with ``(run_dir=, hparams=, name=, group=, **options)`` that offers
``log(numbers, step)`` and ``finish(final, step, failed, artifacts)``, and says before launch what
it needs: ``requires(options)`` (packages), ``EXTRA`` (the pip extra that installs them) and
``check(options, key_of)`` (its option values). Adding one is a module here and its yaml.
"""

from __future__ import annotations

import importlib.util
from functools import partial
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


def enabled_loggers(group: Mapping[str, Any] | None) -> dict[str, dict]:
    """name -> its config (with ``_target_``), for each option of the ``logger`` group."""
    return {name: dict(conf) for name, conf in (group or {}).items() if conf}


def _split(conf: Mapping[str, Any]) -> tuple[type[Logger], dict[str, Any]]:
    from hydra.utils import get_class

    # A _target_ names a class with Logger's interface (subclassing it is how it gets the defaults).
    return cast("type[Logger]", get_class(conf["_target_"])), {k: v for k, v in conf.items() if not k.startswith("_")}


def check_loggers(group: Mapping[str, Any] | None) -> None:
    """Before launch, cheaply (no logger package is imported): every enabled logger's packages are
    installed and its options are ones it takes."""
    for name, conf in enabled_loggers(group).items():
        cls, options = _split(conf)
        cls.check(options, partial("logger.{}.{}".format, name))  # how the user spells each option's key
        missing = [m for m in cls.requires(options) if importlib.util.find_spec(m) is None]
        if missing:
            raise ConfigError(f"logger={name} needs {', '.join(missing)} (not installed). Fix: pip install -e "
                              f"'.[{cls.EXTRA}]' (or 'runner[{cls.EXTRA}]'), or leave {name} out of logger.")


def build_loggers(group: Mapping[str, Any] | None, *, run_dir: Path, hparams: dict, name: str,
                  group_name: str | None) -> list[Logger]:
    loggers = []
    for conf in enabled_loggers(group).values():
        cls, options = _split(conf)
        loggers.append(cls(run_dir=run_dir, hparams=hparams, name=name, group=group_name, **options))
    return loggers
