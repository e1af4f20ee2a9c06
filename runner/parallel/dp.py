"""Data-parallel modes (``parallel.dp_mode``): how each stage module is replicated over its dp
group, the last thing ``runner.parallel.parallelize`` applies to it. Every use of a mode reads this
registry: the config's choices, the checks before launch, the wrapping, and whether a rank's
stages may share a tied parameter.

Adding a mode: one entry here, with its wrapping function (``parallel.dp_mode=<name>`` then
selects it; ``docs/data-parallelism.md`` says what it costs). The gradient code needs nothing
new as long as the mode's parameters are plain tensors or ``DTensor``s: the global norm, ``verify``
and checkpoints gather ``DTensor``s whole.

Imports nothing heavy at the top (the checks before launch read the names before torch is
imported); the wrapping functions import what they use."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    import torch

    from runner.models.split import StageModule
    from runner.parallel.mesh import Mesh

__all__ = ["DPMode", "DP_MODES"]


@dataclass(frozen=True)
class DPMode:
    name: str  # parallel.dp_mode=<name>
    # (stage module, mesh, compute dtype or None) -> the module to run, replicated over mesh.dp_mesh
    # (torch's composable wrappers change the module in place and return it).
    wrap: Callable[[StageModule, Mesh, torch.dtype | None], StageModule]
    # Keeps replicas in step, so parallel.dp > 1 may use it (none cannot: replicas would train apart).
    replicates: bool
    # Wraps each stage module on its own: two stages of one rank cannot share a tied parameter
    # (each keeps a copy, kept equal like copies on different ranks).
    per_stage: bool


def _unwrapped(module: StageModule, mesh: Mesh, dtype: torch.dtype | None) -> StageModule:
    module.autocast_dtype = dtype  # the stage autocasts its own forward
    return module


def _replicate(module: StageModule, mesh: Mesh, dtype: torch.dtype | None) -> StageModule:
    """torch's FSDP-based replicate: DDP semantics, and it also reduces the gradients that
    zero-bubble schedules' weight backward sets directly."""
    from runner._torch import pp as _torch_pp

    module.autocast_dtype = dtype
    _torch_pp.replicate(module, mesh=mesh.dp_mesh)  # in place: the module's class becomes a replicated one
    return module


def _sharing(children: list[torch.nn.Module]) -> list[list[torch.nn.Module]]:
    """The modules that own parameters, grouped where they share one (a tied embedding and head
    in one stage, as at pp=1): FSDP shards a parameter in one group, so modules sharing it are
    one ``fully_shard`` unit (apart, each would get its own sharded copy: the tie broken)."""
    groups: list[tuple[set[int], list[torch.nn.Module]]] = []
    for child in children:
        ids = {id(p) for p in child.parameters()}
        if not ids:
            continue
        joined = [g for g in groups if g[0] & ids]
        merged: tuple[set[int], list[torch.nn.Module]] = (ids, [])
        for g in joined:
            groups.remove(g)
            merged[0].update(g[0])
            merged[1].extend(g[1])
        merged[1].append(child)
        groups.append(merged)
    return [units for _, units in groups]


def _fully_shard(module: StageModule, mesh: Mesh, dtype: torch.dtype | None) -> StageModule:
    """FSDP2: an FSDP unit per module of the stage's units that owns parameters, then the stage
    root. Parameters stay gathered between microbatches (reshard_after_forward=False): pipelining
    runs many forwards per step, and re-gathering for each would multiply the all-gathers by the
    microbatch count. Computation runs in ``dtype`` (FSDP casts parameters and inputs itself);
    gradients are reduced in fp32 either way."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    for units in _sharing(module.unit_modules()):
        fully_shard(units if len(units) > 1 else units[0], mesh=mesh.dp_mesh, reshard_after_forward=False,
                    mp_policy=policy)
    fully_shard(module, mesh=mesh.dp_mesh, reshard_after_forward=False, mp_policy=policy)  # in place (an FSDPModule)
    return module


DP_MODES: dict[str, DPMode] = {mode.name: mode for mode in (
    DPMode("none", _unwrapped, replicates=False, per_stage=False),
    DPMode("ddp", _replicate, replicates=True, per_stage=True),
    DPMode("fsdp", _fully_shard, replicates=True, per_stage=True),
)}
