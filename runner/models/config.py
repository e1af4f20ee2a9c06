"""The ``model`` group's schemas: the keys every built-in factory takes (``ModelConfig``), one per
built-in model, and ``model=hf``'s. A user factory (``model._target_=pkg.mod.fn``) is called with
the keys of the selected group. Imports nothing heavy."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Optional

from omegaconf import II, MISSING

__all__ = ["ModelConfig", "TransformerConfig", "MLPConfig", "HFModelConfig"]


@dataclass
class ModelConfig:
    """Keys every built-in model factory takes. A user factory (``model._target_=pkg.mod.fn``)
    is called with the keys of the selected model group."""

    _target_: str = MISSING
    vocab_size: int = II("data.vocab_size")
    max_seq_len: int = II("train.seq_len")
    dim: int = 64
    n_layers: int = 4
    tie_embeddings: bool = False  # head shares the token embedding's weight


@dataclass
class TransformerConfig(ModelConfig):
    _target_: str = "runner.models.builtin.transformer"
    n_heads: int = 4
    ffn_mult: int = 4


@dataclass
class MLPConfig(ModelConfig):
    _target_: str = "runner.models.builtin.mlp"
    ffn_mult: int = 4


@dataclass
class HFModelConfig:
    """``model=hf``: a Hugging Face causal LM from a local directory (runner.models.hf)."""

    _target_: str = "runner.models.hf.causal_lm"
    path: str = MISSING  # a directory with config.json, optionally *.safetensors and tokenizer files
    pretrained: bool = True  # read the directory's weights (each rank its own stages'); false = random init
    # Run a family outside the tested list (Llama-like reading of its pipeline plan); verify then runs on the
    # first step unless verify=false is given.
    allow_unlisted: bool = False
    # config.json values to change, as AutoConfig.from_pretrained(path, **overrides): e.g. dropout off,
    # +model.config_overrides.resid_pdrop=0.0
    config_overrides: Dict[str, Any] = field(default_factory=dict)
    attn_implementation: Optional[str] = None  # eager | sdpa | ...; null = transformers' default
