"""What is applied to each stage module before it becomes a ``PipelineStage``, on the meta device
before anything is allocated (``runner.models.split.fill`` then allocates only this rank's shards),
in torchtitan's order: tensor parallelism (``runner.parallel.tp``, applied by ``runner.pipeline``
before this), activation
checkpointing, then ``torch.compile``, then precision and data parallelism (FSDP's
mixed-precision policy needs the unsharded module; over tp it shards the tp shards: 2-D).
Nothing here renames a parameter: checkpoints and ``verify`` keep the unsplit model's names."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from runner._torch.dist import own_compile_cache
from runner.options import ActivationCheckpointing, Precision
from runner.parallel.dp import DP_MODES
from runner.parallel.mesh import Mesh

if TYPE_CHECKING:
    from runner.config import TrainConfig
    from runner.models.split import StageModule

__all__ = ["PRECISIONS", "checkpointed_blocks", "parallelize"]

PRECISIONS = {"fp32": None, "bf16": torch.bfloat16}
assert tuple(PRECISIONS) == Precision.values(), "a dtype for every train.precision (runner.options)"


def checkpointed_blocks(blocks: list[str], mode: str, every: int) -> set[str]:
    """The units whose activations are recomputed, of the model's blocks (``ModelSpec.blocks``:
    the decoder layers, or the units between the first and the last); the choice depends on the
    model, not on the split, so every layout recomputes the same blocks."""
    if mode == ActivationCheckpointing.full:
        return set(blocks)
    if mode == ActivationCheckpointing.every_n:
        return {name for i, name in enumerate(blocks, start=1) if i % every == 0}
    return set()


def _checkpoint_forward(module: nn.Module) -> None:
    """Non-reentrant checkpointing of ``module.forward``, set on the instance so the module keeps
    its class and parameter names (``checkpoint_wrapper`` would insert a name level)."""
    forward = module.forward

    @functools.wraps(forward)  # keeps the signature: keyword inputs are routed by it
    def recomputed(*args, **kwargs):
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    module.forward = recomputed


def parallelize(module: StageModule, train: TrainConfig, dp_mode: str, mesh: Mesh) -> StageModule:
    """Activation checkpointing, compile, precision and dp (``runner.parallel.dp``) for one stage module
    already sharded over its tp group (``runner.parallel.tp.apply_tp``; in place: returns the same module)."""
    for name in checkpointed_blocks(module.spec.blocks(), train.activation_checkpointing, train.ac_every):
        if name in module.units:
            _checkpoint_forward(module.get_submodule(name))
    if train.compile:
        # Under tp the compiled units are DTensor programs, which torch's cache keys alike on every
        # rank: each rank keeps its own. (Plain programs are shared: ranks reuse each other's.)
        if mesh.dims.tp > 1:
            own_compile_cache(f"runner-{'-'.join(f'{k}{v}' for k, v in mesh.dims.degrees.items())}-rank{mesh.rank}")
        for child in module.unit_modules():
            child.compile()  # in place: no OptimizedModule wrapper, no "_orig_mod." in names
    single = mesh.dp_mesh is None  # one process: nothing to replicate over
    return DP_MODES["none" if single else dp_mode].wrap(module, mesh, PRECISIONS[train.precision])
