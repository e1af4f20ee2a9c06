"""The values the string options take, as string-valued enums: each member compares equal to its
string, and prints and serialises (f-strings, ``json.dumps``) as it, so the config keeps plain
strings and code may use either. The schemas (``runner.config``) name them as a field's choices,
and the checks before launch refuse any other value, naming the key, the value and the fix.

The options that users extend are registries instead: schedules (``runner.pipeline.registry``) and
data-parallel modes (``runner.parallel.dp``). Imports nothing heavy: the command line reads these before
torch is imported."""

from __future__ import annotations

from enum import Enum
from typing import Any

__all__ = ["Choice", "Device", "StartMethod", "Precision", "ActivationCheckpointing", "LRSchedule", "NoDecay",
           "OptimizerSync", "WandbMode", "choices", "allowed"]


class Choice(str, Enum):
    """A string option's values. (``str, Enum`` rather than 3.11's ``StrEnum``: Python 3.10.)"""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    @classmethod
    def values(cls) -> tuple[str, ...]:
        return tuple(member.value for member in cls)


class Device(Choice):
    auto = "auto"  # cuda when this host has a GPU for each of its ranks, else cpu
    cpu = "cpu"
    cuda = "cuda"


class StartMethod(Choice):
    auto = "auto"  # fork for CPU runs on Linux, spawn where fork is unsafe
    fork = "fork"
    spawn = "spawn"


class Precision(Choice):
    fp32 = "fp32"
    bf16 = "bf16"


class ActivationCheckpointing(Choice):
    none = "none"
    full = "full"
    every_n = "every_n"


class OptimizerSync(Choice):
    barrier = "barrier"  # every rank waits for the step's loss and global norm, then clips and steps
    post_validate = "post_validate"  # each rank steps at once; the global checks validate it afterwards
    deferred = "deferred"  # as post_validate, validated during the next step (redone and that step rerun if wrong)


class LRSchedule(Choice):
    constant = "constant"
    cosine = "cosine"
    linear = "linear"


class NoDecay(Choice):
    bias = "bias"
    norm = "norm"
    embedding = "embedding"


class WandbMode(Choice):
    offline = "offline"
    online = "online"
    disabled = "disabled"


def choices(source: Any, *, set_as: str | None = None) -> dict[str, Any]:
    """A schema field's metadata naming its allowed values: an enum, a registry (its names, read
    when checked, so an entry added at run time counts) or a function returning the names:
    ``field(default="none", metadata=choices(ActivationCheckpointing))``. A list field's every
    entry must be one of them. ``set_as``: how the fix sets it, where not ``<key>=`` (a group)."""
    return {"choices": source, "set_as": set_as}


def allowed(source: Any) -> tuple[str, ...]:
    """The values ``choices(source)`` allows."""
    if isinstance(source, type) and issubclass(source, Choice):
        return source.values()
    return tuple(source() if callable(source) else source)
