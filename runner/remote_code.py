"""No code from a model, tokenizer or checkpoint directory ever runs.

transformers runs a directory's own Python when its ``config.json`` or ``tokenizer_config.json``
has an ``auto_map`` (and asks on stdin when ``trust_remote_code`` is not given). Every load the
runner makes passes ``trust_remote_code=False``; these checks refuse such a directory first, by
reading the JSON files themselves, so the user learns which file and entry before anything starts.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

from runner.errors import ConfigError

__all__ = ["FILES", "refuse_remote_code", "refuse_remote_overrides"]

# The files whose auto_map makes transformers import the directory's Python.
FILES = ("config.json", "tokenizer_config.json")


def _auto_map(file: Path) -> Any:
    try:
        data = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{file} cannot be read as JSON: {e}. Fix: a valid {file.name} "
                          "(as save_pretrained writes it).") from None
    return data.get("auto_map") if isinstance(data, dict) else None


def refuse_remote_code(directory: Path, key: str) -> None:
    """A ``ConfigError`` naming the file and its ``auto_map`` entry when ``directory`` (given as
    ``key``) asks for its own code to run."""
    for name in FILES:
        file = directory / name
        if not file.is_file():
            continue
        entry = _auto_map(file)
        if entry:
            raise ConfigError(
                f"{key}: {file} has an auto_map ({json.dumps(entry)[:200]}): loading it would import Python "
                "code from that directory, which the runner never runs. Fix: a model or tokenizer of a class "
                "transformers ships (delete the auto_map entry only if the directory's classes are transformers' "
                "own), or convert it with the code's authors' instructions into such a class.")


def _hub_kernel(name: Any) -> bool:
    """An attention implementation that transformers would download from the Hub and import."""
    return isinstance(name, str) and ("/" in name or name.startswith("kernels-community"))


def refuse_remote_overrides(overrides: Mapping[str, Any], attn_implementation: str | None) -> None:
    """``model.config_overrides`` may not turn remote code on, nor may an attention implementation
    name a kernel repository on the Hub (``org/repo``)."""
    if "trust_remote_code" in overrides:
        raise ConfigError(f"model.config_overrides.trust_remote_code={overrides['trust_remote_code']!r}: the runner "
                          "never runs code from a model directory. Fix: remove the key (a model of a class "
                          "transformers ships needs none).")
    for key, value in (("model.config_overrides.attn_implementation", overrides.get("attn_implementation")),
                       ("model.config_overrides._attn_implementation", overrides.get("_attn_implementation")),
                       ("model.attn_implementation", attn_implementation)):
        if _hub_kernel(value):
            raise ConfigError(f"{key}={value!r} names a kernel repository on the Hub, which transformers would "
                              "download and import. Fix: an implementation transformers ships: eager, sdpa or "
                              "flash_attention_2 (or null for its default).")
