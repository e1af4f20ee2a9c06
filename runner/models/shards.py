"""A tp plan applied to a module's names (``stage_plan``), and where torch's styles put each
planned parameter (``param_layouts``: the dimension sharded), which ``check_tp`` holds tied
weights to. A rank never holds a sharded weight whole: its stages are laid out on the meta device
and ``runner.models.split.fill`` allocates and fills only its shards."""

from __future__ import annotations

import fnmatch
from typing import Mapping

from torch import nn

__all__ = ["style_of", "stage_plan", "param_layouts", "shard_range"]


def style_of(name: str, plan: Mapping[str, str]) -> str | None:
    """The style of module ``name``: its plan entry's (the first pattern that matches it)."""
    return next((style for pattern, style in plan.items() if fnmatch.fnmatchcase(name, pattern)), None)


def stage_plan(module: nn.Module, plan: Mapping[str, str]) -> dict[str, str]:
    """The plan's entries for the modules ``module`` holds, by their full names."""
    return {name: style for name, _ in module.named_modules() if name and (style := style_of(name, plan))}


# Where torch's styles put the parameters of the modules they partition (ColwiseParallel and
# RowwiseParallel's partition functions for nn.Linear and nn.Embedding): the dimension each
# parameter is sharded on, None where every shard holds it whole.
_LAYOUTS: dict[tuple[str, str], dict[str, int | None]] = {
    ("colwise", "Linear"): {"weight": 0, "bias": 0},  # output features: the weight's rows
    ("colwise", "Embedding"): {"weight": 1},  # the embedding's columns
    ("rowwise", "Linear"): {"weight": 1, "bias": None},  # input features; the bias added once, whole
    ("rowwise", "Embedding"): {"weight": 0},  # vocabulary rows
}
_TORCH_STYLE = {"colwise": "colwise", "colwise_gather_output": "colwise", "rowwise": "rowwise",
                "embedding_rowwise": "rowwise"}


def param_layouts(module: nn.Module, plan: Mapping[str, str]) -> dict[str, int | None]:
    """The parameters ``apply_tp`` distributes, by full name: the dimension sharded, or None
    (replicated). Modules no torch style partitions (not Linear or Embedding) are left out."""
    from torch import nn

    out: dict[str, int | None] = {}
    for name, style in stage_plan(module, plan).items():
        sub = module.get_submodule(name)
        kind = "Linear" if isinstance(sub, nn.Linear) else "Embedding" if isinstance(sub, nn.Embedding) else ""
        layout = _LAYOUTS.get((_TORCH_STYLE.get(style, ""), kind))
        if layout is not None:
            out.update({f"{name}.{p}": layout[p] for p, _ in sub.named_parameters(recurse=False) if p in layout})
    return out


def shard_range(size: int, count: int, index: int) -> tuple[int, int]:
    """Shard ``index`` of ``count`` of a dimension of ``size``, as DTensor's ``Shard`` cuts it
    (``torch.chunk``: ceil(size / count) each, the last ones shorter or empty): [start, stop)."""
    step = -(-size // count)
    start = min(index * step, size)
    return start, min(start + step, size)
