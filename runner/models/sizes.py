"""What a model's sizes are before it is built: its decoder layers, attention heads and longest
sequence, read from the model group's keys (the built-in models) or from ``model=hf``'s
``config.json`` with ``model.config_overrides`` applied, as transformers' ``AutoConfig`` would.
Neither torch nor transformers is imported: ``runner.validate.check_config`` refuses a layout the
model cannot take from these before any data is tokenized or torch imported. Each number carries
the key a user changes it with, spelt as the model in use spells it (``model.n_layers``;
``model.config_overrides.num_hidden_layers``, GPT-2's ``n_layer``)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["Size", "ModelSizes", "model_sizes"]

BUILTIN = {"runner.models.builtin.transformer", "runner.models.builtin.mlp",
           "runner.models.transformer", "runner.models.mlp"}  # the last two: older runs' names
HF = "runner.models.hf.causal_lm"
# Hugging Face config.json names of each size: the common one first, then a family's own (GPT-2's).
_HF_NAMES = {
    "layers": ("num_hidden_layers", "n_layer"),
    "heads": ("num_attention_heads", "n_head"),
    "kv_heads": ("num_key_value_heads",),
    "positions": ("max_position_embeddings", "n_positions"),
}


@dataclass(frozen=True)
class Size:
    value: int
    key: str  # the key that sets it: model.n_layers, model.config_overrides.num_hidden_layers
    source: str = ""  # where the value was read, when not from the key itself ("model.path's config.json")

    def __str__(self) -> str:
        if self.source:  # as the file names it: the key is how to change it
            return f"{self.key.rpartition('.')[2]}={self.value} in {self.source}"
        return f"{self.key}={self.value}"


@dataclass(frozen=True)
class ModelSizes:
    layers: Size | None  # decoder layers: one pipeline unit each
    other_units: int  # the units beside the layers (the embedding, the final norm, the head)
    heads: tuple[Size, ...] = ()  # attention heads, key/value heads: each tp shard holds whole ones
    positions: Size | None = None  # the longest sequence the model takes (None: any)

    @property
    def units(self) -> int | None:
        return None if self.layers is None else self.layers.value + self.other_units


def model_sizes(model_cfg: Any) -> ModelSizes | None:
    """The sizes of the model ``model_cfg`` (the composed ``model`` group) builds; None for a user's
    factory, or a ``model=hf`` directory whose ``config.json`` cannot be read (its factory says why
    when it is built)."""
    target = model_cfg.get("_target_")
    if target in BUILTIN:
        layers = Size(int(model_cfg.n_layers), "model.n_layers")
        heads = model_cfg.get("n_heads")
        return ModelSizes(layers, 3, heads=(Size(int(heads), "model.n_heads"),) if heads is not None else ())
    if target == HF:
        return _hf_sizes(model_cfg)
    return None


def _hf_sizes(model_cfg: Any) -> ModelSizes | None:
    try:
        stored = json.loads((Path(str(model_cfg.path)).expanduser() / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(stored, dict):
        return None
    overrides = dict(model_cfg.get("config_overrides") or {})

    def size(what: str) -> Size | None:
        names = _HF_NAMES[what]
        for name in names:  # the user's value first, under either name
            if isinstance(overrides.get(name), int):
                return Size(overrides[name], f"model.config_overrides.{name}")
        for name in names:
            if isinstance(stored.get(name), int):
                return Size(stored[name], f"model.config_overrides.{name}", "model.path's config.json")
        return None

    heads = tuple(s for s in (size("heads"), size("kv_heads")) if s is not None)
    return ModelSizes(size("layers"), 3, heads=heads, positions=size("positions"))
