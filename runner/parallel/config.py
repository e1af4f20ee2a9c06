"""The ``parallel.*`` keys (schema ``ParallelConfig``): the degrees ``ParallelDims`` is built from, the
dp mode, tp's options, microbatches and the split. Imports nothing heavy: every command line composes
the config."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

from runner.options import choices
from runner.parallel.dp import DP_MODES

__all__ = ["ParallelConfig"]


@dataclass
class ParallelConfig:
    pp: int = 2  # pipeline ranks; 1 = the unsplit model in one process (the reference)
    dp: int = 1  # data-parallel replicas of the whole pipeline (ranks: runner.parallel.dims)
    # How each stage is replicated over dp: none (dp must be 1), ddp (torch's FSDP-based
    # replicate: gradients all-reduced, correct for every schedule), fsdp (FSDP2 fully_shard).
    dp_mode: str = field(default="none", metadata=choices(DP_MODES))  # runner.parallel.dp
    # Tensor parallelism inside each stage (runner.parallel.tp): the model's own tp_plan shards its layers
    # over tp consecutive ranks (one node's fast links); parallel.pp x dp x tp = the ranks.
    tp: int = 1
    sequence_parallel: bool = False  # with tp: norms and the activations between blocks sharded on the sequence
    loss_parallel: bool = False  # with tp: the vocabulary-sharded logits go into the loss without a gather
    microbatches: int = 4  # microbatches per step, per pipeline
    # Stages per pipeline rank; null = derived from the schedule (1 single-stage, 2 multi-stage).
    stages_per_rank: Optional[int] = None
    # Names of the pipeline units where a new stage starts (model.layers.4); null = balanced by
    # parameter count. Units: an nn.Sequential's children (a nested Sequential's entries), a
    # Hugging Face model's embedding, layers, norm and head, or what stage_modules lists.
    split_points: Optional[List[str]] = None
    # The units of each stage, torchtitan's form: [[embed,layers.0],[layers.1,norm,head]]; a
    # container stands for its entries. Needed for a model that is neither an nn.Sequential nor
    # declares its units; otherwise an alternative to split_points.
    stage_modules: Optional[List[List[str]]] = None
