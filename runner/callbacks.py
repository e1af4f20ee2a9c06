"""User callbacks from the config: ``callbacks: {name: {_target_: pkg.mod.Class, ...kwargs}}``.

Each entry is a ``runner.hooks.Hook`` (a subclass, or a function returning one), instantiated with
``hydra.utils.instantiate`` on every rank and run after the trainer's own hooks, in the order of
the config's keys. ``check_callbacks`` (called by ``runner.validate`` before launch) instantiates
each once in the launching process, so a ``_target_`` that cannot be imported, takes other
arguments, or makes no ``Hook`` is refused with a ``ConfigError`` before any rank starts.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from runner.errors import ConfigError
from runner.hooks import Hook

__all__ = ["check_callbacks", "build_callbacks"]

_FIX = "a Hook subclass (runner.hooks.Hook) or a function returning one, importable as pkg.module.Name"


def _target(name: str, conf: Any) -> str:
    key = f"callbacks.{name}"
    if not isinstance(conf, Mapping) or not conf.get("_target_"):
        raise ConfigError(f"{key}={conf!r} names no _target_. Fix: +{key}._target_=<{_FIX}>.")
    return str(conf["_target_"])


def _build(name: str, conf: Any) -> Hook:
    """One callback, instantiated; ``ConfigError`` naming its key, value and fix otherwise."""
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    key, target = f"callbacks.{name}", _target(name, conf)
    try:
        hook = instantiate(conf)
    except InstantiationException as e:  # not importable, or the kwargs are not its arguments
        cause = " ".join(str(e.__cause__ or e).split()).rstrip(".?")  # Hydra's lines, as one
        raise ConfigError(f"{key}._target_={target!r} cannot be instantiated: {cause}. "
                          f"Fix: {_FIX} (on PYTHONPATH), with keyword arguments it takes.") from e
    if not isinstance(hook, Hook):
        raise ConfigError(f"{key}._target_={target!r} made a {type(hook).__name__}, not a runner.hooks.Hook. "
                          f"Fix: {_FIX}.")
    return hook


def check_callbacks(group: Mapping[str, Any] | None) -> None:
    """Before launch: every callback can be instantiated, and is a ``Hook``."""
    for name, conf in (group or {}).items():
        _build(str(name), conf)


def build_callbacks(group: Mapping[str, Any] | None) -> list[Hook]:
    """On each rank: the config's callbacks, in the order of its keys."""
    return [_build(str(name), conf) for name, conf in (group or {}).items()]
