"""Reading a composed config's nodes without resolving them: what the checks before launch
(``runner.validate``) ask of the tree before any interpolation runs."""

from __future__ import annotations

from typing import Any, Iterator

from omegaconf import DictConfig, ListConfig, OmegaConf

from runner.errors import ConfigError

__all__ = ["missing_keys", "check_model_vocab"]


def missing_keys(node: DictConfig | ListConfig, path: str = "") -> Iterator[str]:
    """Keys left ``???``, found without resolving anything: ``OmegaConf.missing_keys`` resolves
    interpolations, and one that reads a missing key (``data.vocab_size`` reads ``data.tokenizer``)
    fails there with OmegaConf's own message instead."""
    keys: list[Any] = list(range(len(node))) if isinstance(node, ListConfig) else list(node.keys())
    for key in keys:
        child = node._get_node(key)
        if OmegaConf.is_missing(node, key):
            yield f"{path}{key!s}"
        elif isinstance(child, (DictConfig, ListConfig)):
            yield from missing_keys(child, f"{path}{key!s}.")


def check_model_vocab(cfg: DictConfig) -> None:
    """A built-in model sizes its embedding by ``data.vocab_size``, which ``data=tokens`` cannot
    know: null there, OmegaConf would refuse it inside the model's build with its own words."""
    model = cfg.get("model")
    if (isinstance(model, DictConfig) and "vocab_size" in model and OmegaConf.is_interpolation(model, "vocab_size")
            and cfg.data.get("vocab_size") is None):
        raise ConfigError("model.vocab_size follows data.vocab_size, which is null: the token ids' vocabulary is not "
                          "known. Fix: data.vocab_size=<the vocabulary size of the tokenizer that wrote data.path>.")
