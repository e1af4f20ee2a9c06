"""Models: the built-in factories (``builtin``), Hugging Face families (``hf``, ``hf_weights``,
``hf_dirs``), a model's pipeline units (``units.ModelSpec``), the meta model cut into stages and
materialised shard-first (``split``), and where a tp plan shards each weight (``shards``).
Schema: ``config.ModelConfig`` and one per factory (``model=...``). Nothing is imported here."""

# relayout: keep-file (the names below are the paths of runner/models.py before issue #34)
from typing import Any

_MOVED = {"transformer": "runner.models.builtin", "mlp": "runner.models.builtin"}


def __getattr__(name: str) -> Any:
    """Shim: ``_target_: runner.models.transformer`` (``mlp``), as an older run's
    ``.hydra/config.yaml`` names the built-in factories, resolves to ``runner.models.builtin``'s;
    imported only when asked for, so this package's face stays free of torch."""
    if name in _MOVED:
        import importlib

        return getattr(importlib.import_module(_MOVED[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
