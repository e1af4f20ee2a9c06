from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from omegaconf import DictConfig

import runner.config  # noqa: F401  (registers the schemas)

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"

# Small enough for 2 CPU cores, big enough to split into 8 stages (6 blocks + embed, norm, head).
TINY = ["device=cpu", "model.dim=32", "model.n_layers=6", "train.seq_len=16",
        "train.steps=5", "data.vocab_size=48", "profile.enabled=false"]


def compose(*overrides: str) -> DictConfig:
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return hydra_compose(config_name="config", overrides=list(overrides))


@pytest.fixture(autouse=True)
def _single_thread_reference():
    # The test process runs references next to spawned ranks on 2 cores: keep it to one thread.
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


sys.path.insert(0, str(Path(__file__).parent))  # spawned ranks import tests' helper modules
