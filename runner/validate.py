"""Pre-spawn validation: everything that can be checked without ranks is checked here, in the
launching process, and produces the ``Layout`` every rank then follows."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from omegaconf import DictConfig, OmegaConf

from runner import schedule as sched
from runner.data import build_dataset
from runner.errors import ConfigError
from runner.split import build_meta_model, check_shapes, check_tied_weights, plan_split

__all__ = ["Layout", "validate"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Layout:
    """Where every part of the model runs: derived once from the config, never configured twice."""

    schedule: str
    csv: str | None
    pp: int
    microbatches: int
    stages: tuple[tuple[str, ...], ...]  # the model's top-level children in each stage
    stage_to_rank: dict[int, int]

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def stages_on(self, rank: int) -> list[int]:
        return sorted(s for s, r in self.stage_to_rank.items() if r == rank)

    def describe(self) -> str:
        lines = [f"schedule={self.schedule} pp={self.pp} stages={self.num_stages} "
                 f"microbatches={self.microbatches}"]
        for s, names in enumerate(self.stages):
            lines.append(f"  stage {s} on rank {self.stage_to_rank[s]}: {', '.join(names)}")
        return "\n".join(lines)


def _check_missing(cfg: DictConfig) -> None:
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        raise ConfigError(
            f"Required value(s) missing: {', '.join(missing)}. Fix: set them on the command line, "
            f"e.g. {missing[0]}=<value>."
        )


def _check_numbers(cfg: DictConfig) -> None:
    p, t = cfg.parallel, cfg.train
    for key, value in [("parallel.pp", p.pp), ("parallel.dp", p.dp),
                       ("parallel.microbatches", p.microbatches), ("train.steps", t.steps),
                       ("train.batch_size", t.batch_size), ("train.seq_len", t.seq_len)]:
        if value < 1:
            raise ConfigError(f"{key}={value} must be at least 1.")
    if p.dp_mode not in ("none", "ddp", "fsdp"):
        raise ConfigError(f"parallel.dp_mode={p.dp_mode!r} is not one of none, ddp, fsdp.")
    if p.dp > 1 and p.dp_mode == "none":
        raise ConfigError(
            f"parallel.dp={p.dp} with parallel.dp_mode=none: replicas would train apart. "
            "Fix: parallel.dp_mode=ddp or parallel.dp_mode=fsdp."
        )
    if cfg.checkpoint.every < 0 or cfg.checkpoint.keep < 1:
        raise ConfigError(
            f"checkpoint.every={cfg.checkpoint.every}, checkpoint.keep={cfg.checkpoint.keep}: "
            "every must be >= 0 and keep >= 1."
        )
    if t.batch_size < p.microbatches * p.dp:
        raise ConfigError(
            f"train.batch_size={t.batch_size} is smaller than parallel.microbatches x parallel.dp "
            f"= {p.microbatches * p.dp}. Fix: train.batch_size={p.microbatches * p.dp} or more."
        )
    if t.batch_size % (p.microbatches * p.dp):
        raise ConfigError(
            f"train.batch_size={t.batch_size} does not divide into parallel.dp={p.dp} x "
            f"parallel.microbatches={p.microbatches} equal microbatches. "
            f"Fix: a multiple of {p.microbatches * p.dp}."
        )
    if cfg.device not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"device={cfg.device!r} is not one of auto, cpu, cuda.")
    ranks = p.pp * p.dp
    if cfg.device == "cuda" and torch.cuda.device_count() < ranks:
        raise ConfigError(
            f"device=cuda needs one GPU per rank ({ranks}) but this host has "
            f"{torch.cuda.device_count()}. Fix: device=cpu, or fewer ranks."
        )


def _schedule_layout(cfg: DictConfig) -> tuple[int, dict[int, int]]:
    """(number of stages, stage → rank) as the schedule dictates."""
    p, name = cfg.parallel, cfg.schedule.name
    if p.pp == 1:  # the unsplit reference: one stage, no schedule
        ignored = [f"parallel.{k}={p[k]}" for k in ("stages_per_rank", "split_points") if p[k] is not None]
        if ignored:
            log.warning("parallel.pp=1 trains the unsplit model; ignoring %s", ", ".join(ignored))
        return 1, {0: 0}
    if name == "csv":
        return sched.read_csv_schedule(
            cfg.schedule.csv, pp=p.pp, stages_per_rank=p.stages_per_rank, microbatches=p.microbatches
        )
    spr = p.stages_per_rank or sched.default_stages_per_rank(name)
    sched.check_schedule(name, pp=p.pp, stages_per_rank=spr, microbatches=p.microbatches)
    return p.pp * spr, sched.placement(name, p.pp, p.pp * spr)


def validate(cfg: DictConfig) -> Layout:
    """Check a composed config; raise ``ConfigError`` naming key, value and fix."""
    _check_missing(cfg)
    _check_numbers(cfg)
    num_stages, stage_to_rank = _schedule_layout(cfg)
    build_dataset(cfg.data, seed=cfg.train.seed)  # e.g. a missing text file fails here
    model = build_meta_model(cfg.model)
    stages = plan_split(model, num_stages, cfg.parallel.split_points if cfg.parallel.pp > 1 else None)
    check_tied_weights(model, stages)
    check_shapes(model, stages, microbatch=cfg.train.batch_size // (cfg.parallel.dp * cfg.parallel.microbatches),
                 seq_len=cfg.train.seq_len, vocab_size=cfg.data.vocab_size)
    sizes = [len(s) for s in stages]
    if len(set(sizes)) > 1:
        log.info("Uneven split (children per stage): %s", sizes)
    return Layout(
        schedule=cfg.schedule.name,
        csv=cfg.schedule.get("csv"),
        pp=cfg.parallel.pp,
        microbatches=cfg.parallel.microbatches,
        stages=stages,
        stage_to_rank=stage_to_rank,
    )
