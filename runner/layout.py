"""The run's core types, resolved once before any rank starts (``runner.validate``) and then only
read: the ``Layout`` (where every part of the model runs) and the ``ResolvedRun`` (the layout and every
other value the launcher resolved or derived). Ranks receive the resolved run, and the composed config
for what the factories take; nothing changes the config after composition.

Imports nothing heavy: the planner, the profiles and the command line use these types."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from runner.parallel.dims import ParallelDims

if TYPE_CHECKING:  # the schemas' objects arrive built (validate): no import of Hydra's config store here
    from runner.checkpoint.config import CheckpointConfig
    from runner.config import EvalConfig, TrainConfig
    from runner.outputs.config import ProfileConfig

__all__ = ["Layout", "ResolvedRun", "TiedSpan", "microbatch_size"]


def microbatch_size(batch_size: int, *, dp: int, microbatches: int) -> int:
    """Samples in one microbatch of one replica: the global batch split over dp replicas, then
    into microbatches (the checks before launch make it divide)."""
    return batch_size // (dp * microbatches)


@dataclass(frozen=True)
class TiedSpan:
    """A weight tied across pipeline ranks (``model.tie_embeddings`` with the embedding and the head
    on different ranks): the pipeline ranks holding a copy, which sum their gradients after every
    backward (``runner.parallel.tied``), so they meet there each step; and the bytes each of them
    sums (its copy's fp32 gradient, or its shard's under tp or FSDP)."""

    ranks: tuple[int, ...]
    grad_bytes: int


@dataclass(frozen=True)
class Layout:
    """Where every part of the model runs: derived once from the config, never configured twice."""

    schedule: str  # a runner.pipeline.registry name, or "csv"
    csv: str | None  # the schedule file, when the run follows one: its own key, whatever the name
    pp: int
    microbatches: int
    stages: tuple[tuple[str, ...], ...]  # the model's pipeline units in each stage (runner.models.units)
    stage_to_rank: dict[int, int]
    tied: tuple[TiedSpan, ...] = ()  # weights tied across pipeline ranks (none on one rank: V placements)

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def stages_per_rank(self) -> int:
        return max(1, self.num_stages // self.pp)

    def stages_on(self, rank: int) -> list[int]:
        return sorted(s for s, r in self.stage_to_rank.items() if r == rank)

    def describe(self) -> str:
        lines = [f"schedule={self.schedule} pp={self.pp} stages={self.num_stages} "
                 f"microbatches={self.microbatches}"]
        from runner.models.units import describe_names

        for s, names in enumerate(self.stages):
            lines.append(f"  stage {s} on pipeline rank {self.stage_to_rank[s]}: {describe_names(names)}")
        return "\n".join(lines)


@dataclass(frozen=True)
class ResolvedRun:
    """Everything a run resolved before its ranks start. The config keeps what the user composed
    (``auto``, ``null``, ``latest``); the resolved run holds what those became here, and the options the
    ranks read, as their schemas' typed objects with every interpolation resolved once (the ranks
    take only the factories' keys, ``model``, ``data`` and ``loss``, from the composed config)."""

    layout: Layout
    dims: ParallelDims  # the parallel degrees and the ranks' order (runner.parallel.dims)
    batch_size: int  # global samples per optimizer step
    seq_len: int
    steps: int  # the last step (numbered from 1) of the run
    device: str  # cpu or cuda: device=auto resolved for this host
    threads_per_rank: int  # intra-op threads: launch.threads_per_rank, or this host's cores shared out
    rank_cpus: tuple[tuple[int, ...], ...] | None  # the cores of each rank on this host (launch.pin_cpus)
    run_dir: Path | None  # None where nothing runs (the planner's candidates)
    resume: Path | None  # the checkpoint directory checkpoint.resume named (a run directory, latest: found)
    verify: bool
    verify_steps: int  # the optimizer steps verify follows (runner.verify)
    train: TrainConfig
    eval: EvalConfig
    checkpoint: CheckpointConfig
    profile: ProfileConfig
    # Windows of seq_len + 1 tokens in the data's training split (None: not a token stream), what a
    # checkpoint records of the data's length (runner.checkpoint.resume_check)
    train_windows: int | None = None

    def __post_init__(self) -> None:
        assert self.dims.pp == self.layout.pp, (self.dims, self.layout.pp)

    @property
    def pp(self) -> int:
        return self.layout.pp

    @property
    def dp(self) -> int:
        """Replicas of the whole pipeline."""
        return self.dims.dp

    @property
    def dp_mode(self) -> str:
        return self.dims.dp_mode

    @property
    def world_size(self) -> int:
        """Ranks of the job, as the layout's owner counts them."""
        return self.dims.world_size

    @property
    def microbatch_size(self) -> int:
        return microbatch_size(self.batch_size, dp=self.dp, microbatches=self.layout.microbatches)

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.seq_len

    def resolved_values(self) -> dict[str, object]:
        """The config keys the launcher resolved, by dotted key, as written into
        ``resolved_config.yaml`` and logged as the run's hyperparameters."""
        return {"device": self.device, "launch.threads_per_rank": self.threads_per_rank,
                "launch.pin_cpus": self.rank_cpus is not None,
                "checkpoint.resume": None if self.resume is None else str(self.resume), "verify": self.verify}
