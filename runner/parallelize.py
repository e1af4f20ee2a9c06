"""What is applied to each stage module after it is materialised and before it becomes a
``PipelineStage``, in torchtitan's order: activation checkpointing, then ``torch.compile``, then
precision and data parallelism (FSDP's mixed-precision policy needs the unsharded module).
Nothing here renames a parameter: checkpoints and ``verify`` keep the unsplit model's names."""

from __future__ import annotations

import functools

import torch
from omegaconf import DictConfig
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils.checkpoint import checkpoint

from runner import _torch_pp
from runner.config import AC_MODES, PRECISION_NAMES
from runner.mesh import Mesh
from runner.split import StageModule

__all__ = ["PRECISIONS", "AC_MODES", "checkpointed_blocks", "parallelize"]

PRECISIONS = {"fp32": None, "bf16": torch.bfloat16}
assert tuple(PRECISIONS) == PRECISION_NAMES, "the names checked before launch (runner.config)"


def checkpointed_blocks(blocks: list[str], mode: str, every: int) -> set[str]:
    """The units whose activations are recomputed, of the model's blocks (``ModelSpec.blocks``:
    the decoder layers, or the units between the first and the last); the choice depends on the
    model, not on the split, so every layout recomputes the same blocks."""
    if mode == "full":
        return set(blocks)
    if mode == "every_n":
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


def _fully_shard(module: StageModule, mesh: Mesh, param_dtype: torch.dtype | None) -> nn.Module:
    """FSDP2: an FSDP unit per module of the stage's units that owns parameters, then the stage root. Parameters stay
    gathered between microbatches (reshard_after_forward=False): pipelining runs many forwards
    per step, and re-gathering for each would multiply the all-gathers by the microbatch count.
    Computation runs in ``param_dtype``; gradients are reduced in fp32 either way."""
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    for child in module.unit_modules():
        if any(True for _ in child.parameters()):
            fully_shard(child, mesh=mesh.dp_mesh, reshard_after_forward=False, mp_policy=policy)
    return fully_shard(module, mesh=mesh.dp_mesh, reshard_after_forward=False, mp_policy=policy)


def parallelize(module: StageModule, train: DictConfig, dp_mode: str, mesh: Mesh) -> nn.Module:
    """Activation checkpointing, compile, precision and dp for one stage module (in place)."""
    for name in checkpointed_blocks(module.spec.blocks(), train.activation_checkpointing, train.ac_every):
        if name in module.units:
            _checkpoint_forward(module.get_submodule(name))
    if train.compile:
        for child in module.unit_modules():
            child.compile()  # in place: no OptimizedModule wrapper, no "_orig_mod." in names
    dtype = PRECISIONS[train.precision]
    if dp_mode == "none" or mesh.dp_mesh is None:
        module.autocast_dtype = dtype
        return module
    if dp_mode == "ddp":  # replicate: DDP semantics that also reduce zero-bubble's W gradients
        module.autocast_dtype = dtype
        return _torch_pp.replicate(module, mesh=mesh.dp_mesh)
    return _fully_shard(module, mesh, dtype)  # FSDP casts parameters and inputs itself
