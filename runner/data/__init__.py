"""Datasets (``datasets``: ``data=synthetic|text|hf|tokens``, each a pure function of seed, split and
step), the files a form reads (``files``, ``records``, ``token_files``), tokenization and its cache
(``tokens``, ``token_cache``). Schema: ``config`` (``data=...``). Nothing is
imported here."""

# relayout: keep-file (the names below are the paths of runner/data.py before issue #34)
from typing import Any

_MOVED = {name: "runner.data.datasets" for name in ("SyntheticData", "TextData", "HFData", "TokensData")}


def __getattr__(name: str) -> Any:
    """Shim: ``_target_: runner.data.SyntheticData`` (``TextData``, ``HFData``, ``TokensData``), as an
    older run's ``.hydra/config.yaml`` names the datasets, resolves to ``runner.data.datasets``'s;
    imported only when asked for, so this package's face stays free of torch."""
    if name in _MOVED:
        import importlib

        return getattr(importlib.import_module(_MOVED[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
