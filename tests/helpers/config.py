"""The repository's paths, the tiny model every test run uses, and Hydra composition."""

from __future__ import annotations

from pathlib import Path

from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from omegaconf import DictConfig, OmegaConf

import runner.compose  # noqa: F401  (registers the schemas)

TESTS = Path(__file__).resolve().parents[1]
ROOT = TESTS.parent
EXAMPLES = ROOT / "examples"

# Small enough for 2 CPU cores, big enough to split into 8 stages (6 blocks + embed, norm, head).
TINY = ["device=cpu", "model.dim=32", "model.n_layers=6", "train.seq_len=16",
        "train.steps=5", "data.vocab_size=48", "profile.enabled=false"]


def compose(*overrides: str) -> DictConfig:
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return hydra_compose(config_name="config", overrides=list(overrides))


def resolved(*overrides: str) -> dict:
    """The composed config as a plain dict, interpolations resolved: what a spawned case receives."""
    return OmegaConf.to_container(compose(*overrides), resolve=True)
