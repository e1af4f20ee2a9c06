"""runner: a declarative, Hydra-configured training runner for pipeline-parallel PyTorch.

``runner.run(overrides)`` runs from Python what ``python -m runner <overrides>`` runs (``runner.api``);
it is imported on first use, so ``import runner`` stays light (no torch, no Hydra)."""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

__all__ = ["run", "__version__"]


def __getattr__(name: str) -> Any:
    # Imported by name, on first access: every module imports this package (for __version__), and
    # runner.api imports the launcher, so no import statement here (tests/test_architecture.py).
    if name == "run":
        return importlib.import_module("runner.api").run
    raise AttributeError(f"module 'runner' has no attribute {name!r}")
