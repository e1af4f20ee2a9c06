"""Pre-spawn validation: everything that can be checked without ranks is checked here, in the
launching process, and produces the ``Layout`` every rank then follows.

``check_config`` holds the checks that need no torch; the command line runs it before importing
torch, the pipelining runtime and DCP (seconds), so a wrong value fails at once. The checks that
need them (schedule rules asked of torch, the meta model, the first batch) import them inside."""

from __future__ import annotations

import dataclasses
import difflib
import logging
import os
import shutil
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator

from omegaconf import DictConfig, OmegaConf

from runner.config import (
    AC_MODES,
    DEVICES,
    DP_MODES,
    LR_SCHEDULES,
    NO_DECAY_NAMES,
    PRECISION_NAMES,
    START_METHODS,
    parse_bytes,
)
from runner.errors import ConfigError
from runner.loggers import check_loggers

if TYPE_CHECKING:
    import torch

__all__ = ["Layout", "check_config", "validate"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Layout:
    """Where every part of the model runs: derived once from the config, never configured twice."""

    schedule: str
    csv: str | None
    pp: int
    microbatches: int
    stages: tuple[tuple[str, ...], ...]  # the model's pipeline units in each stage (runner.units)
    stage_to_rank: dict[int, int]

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def stages_on(self, rank: int) -> list[int]:
        return sorted(s for s, r in self.stage_to_rank.items() if r == rank)

    def describe(self) -> str:
        lines = [f"schedule={self.schedule} pp={self.pp} stages={self.num_stages} "
                 f"microbatches={self.microbatches}"]
        from runner.units import describe_names

        for s, names in enumerate(self.stages):
            lines.append(f"  stage {s} on rank {self.stage_to_rank[s]}: {describe_names(names)}")
        return "\n".join(lines)


def _check_missing(cfg: DictConfig) -> None:
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        raise ConfigError(
            f"Required value(s) missing: {', '.join(missing)}. Fix: set them on the command line, "
            f"e.g. {missing[0]}=<value>."
        )


# Groups whose keys are the arguments of a user's factory (model._target_=pkg.mod.fn and so on):
# extra keys there are legitimate, and the factory itself rejects what it does not take.
_OPEN_GROUPS = ("model", "data", "loss")


def _schema_nodes(node: DictConfig, path: str) -> Iterator[tuple[str, DictConfig]]:
    if dataclasses.is_dataclass(OmegaConf.get_type(node)):
        yield path, node
    for key, child in node.items_ex(resolve=False):
        if isinstance(child, DictConfig) and not (path == "" and key in _OPEN_GROUPS):
            yield from _schema_nodes(child, f"{path}{key}.")


def _check_unknown_keys(cfg: DictConfig) -> None:
    """A key added with ``+key=value`` that no schema declares would be ignored without a word:
    ``+parallel.microbtches=8`` (Hydra's own suggestion for the typo) is refused like a plain typo."""
    for path, node in _schema_nodes(cfg, ""):
        known = sorted(f.name for f in dataclasses.fields(OmegaConf.get_type(node)))
        for key in node.keys():
            if key in known:
                continue
            close = difflib.get_close_matches(str(key), known, n=1)
            hint = f"Did you mean {path}{close[0]}? " if close else ""
            raise ConfigError(f"{path}{key} is not a key of {path.rstrip('.') or 'the config'}: nothing would read "
                              f"it. {hint}Fix: drop +{path}{key}; the keys are {', '.join(known)}.")


def _check_numbers(cfg: DictConfig) -> None:
    p, t = cfg.parallel, cfg.train
    for key, value in [("parallel.pp", p.pp), ("parallel.dp", p.dp),
                       ("parallel.microbatches", p.microbatches), ("train.steps", t.steps),
                       ("train.batch_size", t.batch_size), ("train.seq_len", t.seq_len)]:
        if value < 1:
            raise ConfigError(f"{key}={value} must be at least 1.")
    if p.dp_mode not in DP_MODES:
        raise ConfigError(f"parallel.dp_mode={p.dp_mode!r} is not one of {', '.join(DP_MODES)}.")
    if p.dp > 1 and p.dp_mode == "none":
        raise ConfigError(
            f"parallel.dp={p.dp} with parallel.dp_mode=none: replicas would train apart. "
            "Fix: parallel.dp_mode=ddp or parallel.dp_mode=fsdp."
        )
    if not cfg.launch.timeout_s > 0 or not cfg.launch.grace_s >= 0:
        raise ConfigError(f"launch.timeout_s={cfg.launch.timeout_s}, launch.grace_s={cfg.launch.grace_s}: the "
                          "timeout must be > 0 seconds and the grace period >= 0. Fix: e.g. launch.timeout_s=300.")
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
    if cfg.device not in DEVICES:
        raise ConfigError(f"device={cfg.device!r} is not one of {', '.join(DEVICES)}.")
    if cfg.launch.start_method not in START_METHODS:
        raise ConfigError(f"launch.start_method={cfg.launch.start_method!r} is not one of "
                          f"{', '.join(START_METHODS)}.")
    if cfg.eval.every < 0 or cfg.eval.steps < 1:
        raise ConfigError(f"eval.every={cfg.eval.every}, eval.steps={cfg.eval.steps}: every must be >= 0 "
                          "(0 = no evaluation) and steps >= 1.")
    parse_bytes("plan.memory_limit", cfg.plan.memory_limit)


def _one_of(key: str, value, allowed) -> None:
    if value not in allowed:
        raise ConfigError(f"{key}={value!r} is not one of {', '.join(map(str, allowed))}. "
                          f"Fix: {key}=<one of them>.")


def _check_training_options(cfg: DictConfig) -> None:
    t = cfg.train
    _one_of("train.precision", t.precision, PRECISION_NAMES)
    _one_of("train.activation_checkpointing", t.activation_checkpointing, AC_MODES)
    _one_of("train.lr_schedule", t.lr_schedule, LR_SCHEDULES)
    unknown = [k for k in t.no_decay if k not in NO_DECAY_NAMES]
    if unknown:
        raise ConfigError(f"train.no_decay={list(t.no_decay)} has unknown kinds {unknown}. "
                          f"Fix: a subset of {list(NO_DECAY_NAMES)} ([] decays everything).")
    if t.ac_every < 1:
        raise ConfigError(f"train.ac_every={t.ac_every} must be at least 1.")


def _check_host(cfg: DictConfig) -> None:
    """What depends on this host's GPUs and compilers (asks torch)."""
    import torch

    t, ranks = cfg.train, cfg.parallel.pp * cfg.parallel.dp
    if cfg.device == "cuda" and torch.cuda.device_count() < ranks:
        raise ConfigError(
            f"device=cuda needs one GPU per rank ({ranks}) but this host has "
            f"{torch.cuda.device_count()}. Fix: device=cpu, or fewer ranks."
        )
    on_gpu = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    if t.precision == "bf16" and on_gpu and not torch.cuda.is_bf16_supported():
        raise ConfigError("train.precision=bf16: this GPU has no bf16 support. Fix: train.precision=fp32.")
    if t.compile and not on_gpu and not (os.environ.get("CXX") or shutil.which("g++") or shutil.which("clang++")):
        raise ConfigError("train.compile=true on CPU needs a C++ compiler for inductor, and none was found "
                          "(g++, clang++ or $CXX). Fix: install one, or train.compile=false.")


def _check_batches(cfg: DictConfig) -> dict[str, torch.Tensor]:
    """Draw the first batch of each split the run uses; returns one microbatch's keyword inputs."""
    import torch

    from runner.data import build_dataset, get_batch

    t, p = cfg.train, cfg.parallel
    data = build_dataset(cfg.data, seed=t.seed)  # e.g. a missing text file fails here
    kwargs = {}
    for split in ("train", "val") if cfg.eval.every else ("train",):
        try:
            inputs, targets, kwargs = get_batch(data, 0, t.batch_size, t.seq_len, split)
        except (TypeError, ValueError) as e:
            raise ConfigError(
                f"data._target_={cfg.data.get('_target_')!r}: batch(step, batch_size, seq_len, split={split!r}) "
                f"failed: {e}\nFix: return (inputs, targets) or (inputs, targets, keyword_inputs); see docs/models.md."
            ) from e
        bad = [k for k, v in kwargs.items() if not isinstance(v, torch.Tensor) or v.shape[:1] != (t.batch_size,)]
        if bad or inputs.shape != (t.batch_size, t.seq_len) or targets.shape != inputs.shape:
            raise ConfigError(
                f"data._target_={cfg.data.get('_target_')!r} returned inputs {tuple(inputs.shape)}, targets "
                f"{tuple(targets.shape)}, keyword inputs {bad or 'ok'}: expected (batch_size, seq_len) = "
                f"{(t.batch_size, t.seq_len)} and batch-first tensors. Fix: the dataset's batch()."
            )
    microbatch = t.batch_size // (p.dp * p.microbatches)
    return {k: v[:microbatch] for k, v in kwargs.items()}


def _check_loss(cfg: DictConfig) -> None:
    """Call the loss on a tiny real microbatch: a wrong target or signature fails here."""
    import torch

    from runner.losses import build_loss

    target = cfg.loss.get("_target_")
    try:
        vocab = cfg.data.get("vocab_size") or 8
        loss = build_loss(cfg.loss)(torch.randn(1, 2, vocab), torch.zeros(1, 2, dtype=torch.long))
    except Exception as e:
        raise ConfigError(f"loss._target_={target!r} could not be built or called as loss(logits, targets): {e}\n"
                          "Fix: a function (logits (batch, seq, vocab), targets (batch, seq)) -> scalar tensor; "
                          "keep loss._partial_=true.") from e
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        raise ConfigError(f"loss._target_={target!r} returned {type(loss).__name__} "
                          f"{tuple(getattr(loss, 'shape', ()))}, not a scalar tensor. Fix: return the mean loss.")


def _check_keyword_inputs(meta, kwargs: dict[str, torch.Tensor]) -> None:
    consumed = meta.spec.keyword_inputs()
    unused = sorted(set(kwargs) - consumed) if consumed is not None else []
    if unused:
        raise ConfigError(f"The dataset returns keyword inputs {unused}, which the {meta.spec.family} model does not "
                          f"take (it takes {sorted(consumed)}). Fix: a dataset that returns only those.")


def _check_vocab(cfg: DictConfig, model_vocab: int) -> None:
    """Token ids index the embedding: the data's vocabulary must fit the model's."""
    data_vocab = cfg.data.get("vocab_size")
    if data_vocab is not None and data_vocab > model_vocab:
        raise ConfigError(f"data.vocab_size={data_vocab} is larger than the model's vocabulary ({model_vocab}): "
                          "token ids would fall outside its embedding. Fix: a tokenizer or data of the model's "
                          "vocabulary, or a model with a larger one.")


def _log_tied(meta, stages) -> None:
    stage_of = {u: i for i, units in enumerate(stages) for u in units}
    for names in meta.tied:
        owners = sorted({stage_of[u] for n in names for u in meta.unit_names
                         if any(n.startswith(f"{m}.") for m in meta.spec.unit(u).modules)})
        if len(owners) > 1:
            log.info("Tied weight %s spans stages %s: each holds a copy, gradients summed every step",
                     " = ".join(names), owners)


def _schedule_layout(cfg: DictConfig) -> tuple[int, dict[int, int]]:
    """(number of stages, stage → rank) as the schedule dictates."""
    from runner import schedule as sched

    p, name = cfg.parallel, cfg.schedule.name
    if p.pp == 1:  # the unsplit reference: one stage, no schedule
        ignored = [f"parallel.{k}={p[k]}" for k in ("stages_per_rank", "split_points", "stage_modules")
                   if p.get(k) is not None]
        if ignored:
            log.warning("parallel.pp=1 trains the unsplit model; ignoring %s", ", ".join(ignored))
        return 1, {0: 0}
    compiled = cfg.train.compile
    if name == "csv":
        return sched.read_csv_schedule(
            cfg.schedule.csv, pp=p.pp, stages_per_rank=p.stages_per_rank, microbatches=p.microbatches,
            compiled=compiled,
        )
    spr = p.stages_per_rank or sched.default_stages_per_rank(name)
    sched.check_schedule(name, pp=p.pp, stages_per_rank=spr, microbatches=p.microbatches, compiled=compiled)
    return p.pp * spr, sched.placement(name, p.pp, p.pp * spr)


def _splits_backward(cfg: DictConfig, layout: Layout) -> bool:
    """Whether the schedule runs separate input (I) and weight (W) backward actions."""
    from runner import schedule as sched

    if layout.schedule == "csv":
        order = sched.csv_order(layout.csv)
    else:
        order = sched.schedule_order(layout.schedule, layout.pp, layout.microbatches, layout.num_stages // layout.pp)
    return any(op.kind in ("I", "W") for ops in order.values() for op in ops)


def check_config(cfg: DictConfig) -> None:
    """The checks that need no torch: missing values, numbers, option names, loggers."""
    _check_missing(cfg)
    _check_unknown_keys(cfg)
    _check_numbers(cfg)
    check_loggers(cfg.logging, cfg.get("logger"))  # enabled loggers' packages are importable, options known
    _check_training_options(cfg)


def validate(cfg: DictConfig) -> Layout:
    """Check a composed config; raise ``ConfigError`` naming key, value and fix."""
    from runner.split import build_meta_model, check_init, check_shapes, plan_split

    check_config(cfg)
    _check_host(cfg)
    num_stages, stage_to_rank = _schedule_layout(cfg)
    kwargs = _check_batches(cfg)
    _check_loss(cfg)
    p = cfg.parallel
    stage_modules = p.get("stage_modules")
    meta = build_meta_model(cfg.model, stage_modules)
    pipelined = p.pp > 1
    stages = plan_split(meta, num_stages, p.split_points if pipelined else None,
                        stage_modules if pipelined else None)
    check_init(meta)
    _check_keyword_inputs(meta, kwargs)
    vocab = check_shapes(meta, stages, microbatch=cfg.train.batch_size // (p.dp * p.microbatches),
                         seq_len=cfg.train.seq_len, kwargs=kwargs)
    _check_vocab(cfg, vocab)
    sizes = [len(s) for s in stages]
    if len(set(sizes)) > 1:
        log.info("Uneven split (units per stage): %s", sizes)
    _log_tied(meta, stages)
    layout = Layout(
        schedule=cfg.schedule.name,
        csv=cfg.schedule.get("csv"),
        pp=cfg.parallel.pp,
        microbatches=cfg.parallel.microbatches,
        stages=stages,
        stage_to_rank=stage_to_rank,
    )
    if cfg.train.activation_checkpointing != "none" and layout.pp > 1 and _splits_backward(cfg, layout):
        log.warning(
            "train.activation_checkpointing=%s with schedule=%s: its weight backward (W) runs one autograd pass "
            "per parameter group and recomputes every checkpointed block in each, so a step is several times "
            "slower than without checkpointing (ZBV: 2.7x in BENCHMARKS.md). Fix, if speed matters: "
            "train.activation_checkpointing=every_n or none, or a schedule with whole backward steps.",
            cfg.train.activation_checkpointing, layout.schedule)
    return layout
