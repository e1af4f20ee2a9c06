"""A Hugging Face directory: the files its tokenizer keeps; none of its code ever runs.

transformers runs a directory's own Python when its ``config.json`` or ``tokenizer_config.json``
has an ``auto_map`` (and asks on stdin when ``trust_remote_code`` is not given). Every load the
runner makes passes ``trust_remote_code=False``; these checks refuse such a directory first, by
reading the JSON files themselves, so the user learns which file and entry before anything starts.
Each check returns the problem (a ``ConfigError``'s message) for its caller to raise: this module
imports nothing of the runner, so ``runner.data.tokens`` can use it without a longer import chain.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

__all__ = ["FILES", "TOKENIZER_FILES", "remote_code_problem", "remote_override_problem"]

# The files whose auto_map makes transformers import the directory's Python.
FILES = ("config.json", "tokenizer_config.json")
# The files of a tokenizer as transformers saves them (runner.models.hf adds a model's generation
# config; a checkpoint keeps them in its tokenizer/ directory: runner.checkpoint.files.TOKENIZER_DIR).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                   "tokenizer.model", "added_tokens.json", "chat_template.jinja")


def remote_code_problem(directory: Path, key: str) -> str | None:
    """What is wrong when ``directory`` (given as ``key``) asks for its own code to run: the file
    and its ``auto_map`` entry (None: nothing)."""
    for name in FILES:
        file = directory / name
        if not file.is_file():
            continue
        try:
            data = json.loads(file.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            return f"{key}: {file} cannot be read as JSON: {e}. Fix: a valid {name} (as save_pretrained writes it)."
        entry = data.get("auto_map") if isinstance(data, dict) else None
        if entry:
            return (
                f"{key}: {file} has an auto_map ({json.dumps(entry)[:200]}): loading it would import Python "
                "code from that directory, which the runner never runs. Fix: a model or tokenizer of a class "
                "transformers ships (delete the auto_map entry only if the directory's classes are transformers' "
                "own), or convert it with the code's authors' instructions into such a class.")
    return None


def _hub_kernel(name: Any) -> bool:
    """An attention implementation that transformers would download from the Hub and import."""
    return isinstance(name, str) and ("/" in name or name.startswith("kernels-community"))


def remote_override_problem(overrides: Mapping[str, Any], attn_implementation: str | None) -> str | None:
    """``model.config_overrides`` may not turn remote code on, nor may an attention implementation
    name a kernel repository on the Hub (``org/repo``): what is wrong, or None."""
    if "trust_remote_code" in overrides:
        return (f"model.config_overrides.trust_remote_code={overrides['trust_remote_code']!r}: the runner never "
                "runs code from a model directory. Fix: remove the key (a model of a class transformers ships "
                "needs none).")
    for key, value in (("model.config_overrides.attn_implementation", overrides.get("attn_implementation")),
                       ("model.config_overrides._attn_implementation", overrides.get("_attn_implementation")),
                       ("model.attn_implementation", attn_implementation)):
        if _hub_kernel(value):
            return (f"{key}={value!r} names a kernel repository on the Hub, which transformers would download "
                    "and import. Fix: an implementation transformers ships: eager, sdpa or flash_attention_2 (or "
                    "null for its default).")
    return None
