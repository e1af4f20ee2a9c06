"""A tp plan applied to a module's names (``stage_plan``), and pretrained weights under tensor
parallelism: a rank never holds a sharded weight whole.
``place_shards`` makes each planned parameter a DTensor laid out as ``runner.parallel.tp.apply_tp`` lays
it out, with an empty local shard; loading reads that shard alone from the safetensors file
(``local_part``: torch.chunk's rows or columns), and ``parallelize_module`` keeps the DTensors as
they are (torch refuses one whose layout differs from its style's: the table is checked by torch)."""

from __future__ import annotations

import fnmatch
from typing import Any, Mapping

from torch import nn

__all__ = ["style_of", "stage_plan", "param_layouts", "shard_range", "place_shards", "local_part"]


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
    (replicated). Modules no torch style partitions (not Linear or Embedding) are left out: they
    are read whole and distributed by ``parallelize_module`` as before."""
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


def place_shards(module: nn.Module, tp_mesh: Any, plan: Mapping[str, str]) -> None:
    """Replace ``module``'s planned parameters (``param_layouts``) by DTensors over ``tp_mesh``
    with uninitialised local shards, in place; a parameter tied under several names stays one."""
    import torch
    from torch import nn
    from torch.distributed.tensor import DTensor, Replicate, Shard

    count, index = tp_mesh.size(), tp_mesh.get_local_rank()
    placed: dict[int, nn.Parameter] = {}
    for name, dim in param_layouts(module, plan).items():
        whole = module.get_parameter(name)
        if id(whole) in placed:
            continue
        shape = list(whole.shape)
        if dim is not None:
            start, stop = shard_range(shape[dim], count, index)
            shape[dim] = stop - start
        local = torch.empty(shape, dtype=whole.dtype, device=whole.device)
        dtensor = DTensor.from_local(local, tp_mesh, [Shard(dim) if dim is not None else Replicate()],
                                     run_check=False, shape=whole.shape, stride=whole.stride())
        placed[id(whole)] = nn.Parameter(dtensor, requires_grad=whole.requires_grad)
    for name, p in list(module.named_parameters(remove_duplicate=False)):
        if id(p) in placed:
            owner, _, leaf = name.rpartition(".")
            setattr(module.get_submodule(owner), leaf, placed[id(p)])


def local_part(tensor: Any) -> tuple[int, int, int] | None:
    """The part of the whole tensor a DTensor's local shard holds, as (dim, start, stop); None
    for a plain tensor or a replicated DTensor (the whole)."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(tensor, DTensor):
        return None
    assert tensor.device_mesh.ndim == 1, "tp shards over one mesh dimension"
    placement = tensor.placements[0]
    if not isinstance(placement, Shard):
        return None
    start, stop = shard_range(tensor.shape[placement.dim], tensor.device_mesh.size(),
                              tensor.device_mesh.get_local_rank())
    return placement.dim, start, stop
