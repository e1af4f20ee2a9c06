"""runner: a declarative, Hydra-configured training runner for pipeline-parallel PyTorch.

``runner.run(overrides)`` runs from Python what ``python -m runner <overrides>`` runs, and
``runner.plan(overrides)`` plans as ``python -m runner.plan <overrides>`` does (``runner.api``);
they are imported on first use, so ``import runner`` stays light (no torch, no Hydra)."""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

__all__ = ["run", "plan", "__version__"]


def __getattr__(name: str) -> Any:
    # Imported by name, on first access: every module imports this package (for __version__), and
    # runner.api imports the launcher, so no import statement here (tests/test_architecture.py).
    if name == "run":
        return importlib.import_module("runner.api").run
    if name == "plan":  # the package runner.plan, callable as runner.api.plan
        return importlib.import_module("runner.plan")
    raise AttributeError(f"module 'runner' has no attribute {name!r}")
