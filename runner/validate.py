"""Pre-spawn validation: everything that can be checked without ranks is checked here, in the
launching process, and resolved into the ``ResolvedRun`` (``runner.layout``) every rank then follows.

``check_config`` holds the checks that need no torch; the command line runs it before importing
torch, the pipelining runtime and DCP (seconds), so a wrong value fails at once. The checks that
need them (schedule rules asked of torch, the meta model, the first batch) import them inside.

Each check lives with what it checks; this module orders them and resolves what they leave:
the schemas' (``runner.compose.check_schema``), this host's (``runner.ranks.host``: GPUs,
compilers, threads and pinned cores), the data's, the loss's and the model's (``runner.data``,
``runner.losses``, ``runner.models.split``), the schedule's stage count and placement
(``runner.pipeline.schedule.stage_layout``), a resume's (``runner.checkpoint.resume_check``). What
stays here spans the groups: the run's numbers and the order that assembles the ``Layout``."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Callable, Mapping

from omegaconf import DictConfig

from runner.callbacks import check_callbacks
from runner.checkpoint.resume_check import resume_point
from runner.compose import check_schema, rank_options
from runner.config import parse_bytes
from runner.errors import ConfigError
from runner.layout import Layout, ResolvedRun, TiedSpan, microbatch_size
from runner.models.sizes import ModelSizes, model_sizes
from runner.options import OptimizerSync
from runner.outputs.config import LOGGING_MOVED
from runner.outputs.loggers import check_loggers
from runner.parallel.dims import ParallelDims, check_tp_options
from runner.parallel.dp import DP_MODES
from runner.pipeline.csv_file import resolve_schedule_file
from runner.pipeline.registry import CSV, SCHEDULES
from runner.ranks.host import check_host, rank_cpus, threads_per_rank

__all__ = ["check_config", "tied_spans", "validate"]

log = logging.getLogger(__name__)


def _check_checkpoints(cfg: DictConfig) -> None:
    """What saving, and restarting from what was saved, need (the values each key may take)."""
    if cfg.checkpoint.async_save and not cfg.checkpoint.every:
        log.warning("checkpoint.async_save=true has no effect: checkpoint.every=0 saves no checkpoint.")
    restarts = cfg.launch.max_restarts
    if restarts < 0:
        raise ConfigError(f"launch.max_restarts={restarts} must be >= 0. Fix: launch.max_restarts=0 (a failed rank "
                          "ends the job) or the number of restarts to allow.")
    if restarts and not cfg.checkpoint.every:
        log.warning("launch.max_restarts=%d with checkpoint.every=0: the run saves no checkpoint, so a restart "
                    "trains again from step 1. Fix, to lose less: checkpoint.every=K.", restarts)


def _check_numbers(cfg: DictConfig) -> None:
    p, t = cfg.parallel, cfg.train
    degrees = [(ParallelDims.key(name), p.get(name, 1)) for name in ParallelDims.ORDER]
    for key, value in [*degrees, ("parallel.microbatches", p.microbatches), ("train.steps", t.steps),
                       ("verify_steps", cfg.verify_steps),
                       ("train.batch_size", t.batch_size), ("train.seq_len", t.seq_len)]:
        if value < 1:
            raise ConfigError(f"{key}={value} must be at least 1.")
    if p.dp > 1 and not DP_MODES[p.dp_mode].replicates:
        modes = " or ".join(f"parallel.dp_mode={m.name}" for m in DP_MODES.values() if m.replicates)
        raise ConfigError(f"parallel.dp={p.dp} with parallel.dp_mode={p.dp_mode}: replicas would train apart. "
                          f"Fix: {modes}.")
    if not cfg.launch.timeout_s > 0 or not cfg.launch.grace_s >= 0:
        raise ConfigError(f"launch.timeout_s={cfg.launch.timeout_s}, launch.grace_s={cfg.launch.grace_s}: the "
                          "timeout must be > 0 seconds and the grace period >= 0. Fix: e.g. launch.timeout_s=300.")
    if cfg.checkpoint.every < 0 or cfg.checkpoint.keep < 1:
        raise ConfigError(f"checkpoint.every={cfg.checkpoint.every}, checkpoint.keep={cfg.checkpoint.keep}: "
                          "every must be >= 0 and keep >= 1.")
    _check_checkpoints(cfg)
    split = p.microbatches * p.dp  # equal microbatches in every replica
    if t.batch_size < split:
        raise ConfigError(
            f"train.batch_size={t.batch_size} is smaller than parallel.microbatches x parallel.dp "
            f"= {split}. Fix: train.batch_size={split} or more."
        )
    if t.batch_size % split:
        raise ConfigError(
            f"train.batch_size={t.batch_size} does not divide into parallel.dp={p.dp} x "
            f"parallel.microbatches={p.microbatches} equal microbatches. "
            f"Fix: a multiple of {split}."
        )
    if cfg.eval.every < 0 or cfg.eval.steps < 1:
        raise ConfigError(f"eval.every={cfg.eval.every}, eval.steps={cfg.eval.steps}: every must be >= 0 "
                          "(0 = no evaluation) and steps >= 1.")
    if t.ac_every < 1:
        raise ConfigError(f"train.ac_every={t.ac_every} must be at least 1.")
    if str(cfg.plan.memory_limit).strip().lower() not in ("1f1b", "2x1f1b"):  # limits relative to 1F1B's memory
        parse_bytes("plan.memory_limit", cfg.plan.memory_limit)
    if cfg.plan.probe_seconds < 0:
        raise ConfigError(f"plan.probe_seconds={cfg.plan.probe_seconds} must be >= 0. Fix: seconds of steps per "
                          "probe run (4.0), or 0 to plan without probes.")


def _schedule_file(cfg: DictConfig) -> str | None:
    """The schedule file the run follows (``schedule=csv``), if any: from here on its own key
    (``Layout.csv``), not the name ``csv``. A bare name of a shipped example that is no file in the
    working directory is that example's path (``resolve_schedule_file``)."""
    if cfg.schedule.name != CSV:
        return None
    if cfg.schedule.get("csv") is None:
        raise ConfigError("schedule.name=csv needs a file: nothing sets schedule.csv. "
                          "Fix: schedule=csv schedule.csv=<the file, or a shipped example's name>.")
    return resolve_schedule_file(cfg.schedule.csv)


def check_config(cfg: DictConfig) -> None:
    """The checks that need no torch: missing values, unknown keys, option values, numbers, the
    model's sizes (its group's keys, or model=hf's config.json) against the layout, loggers."""
    _refuse_logging_keys(cfg)
    check_schema(cfg)
    _check_numbers(cfg)
    _schedule_file(cfg)
    check_tp_options(cfg.parallel, cfg.train.seq_len, cfg.loss)
    sizes = model_sizes(cfg.model)
    if sizes is not None:
        _check_model_sizes(cfg, sizes)
    check_loggers(cfg.get("logger"))  # enabled loggers' packages are importable, options known


def _num_stages(cfg: DictConfig) -> tuple[int, str] | None:
    """The stages the layout needs and why, as far as the config says without torch (None: a
    schedule file's, or parallel.stage_modules's lists, decide; checked when the model is built)."""
    p = cfg.parallel
    if p.pp == 1:
        return 1, "parallel.pp=1"
    if cfg.schedule.name == CSV or p.get("stage_modules") is not None:
        return None
    spr = p.stages_per_rank or SCHEDULES[cfg.schedule.name].stages_per_rank
    given = "parallel.stages_per_rank" if p.stages_per_rank else f"schedule={cfg.schedule.name}'s default"
    return p.pp * spr, f"parallel.pp={p.pp} x {spr} stages per rank ({given})"


def _check_model_sizes(cfg: DictConfig, sizes: ModelSizes) -> None:
    """The model's layers against the stages, its heads against parallel.tp, its longest sequence
    against train.seq_len: from its sizes alone, before the data or the model is built."""
    stages, tp, seq_len = _num_stages(cfg), cfg.parallel.get("tp", 1), cfg.train.seq_len
    if sizes.layers is not None and stages is not None and sizes.layers.value + sizes.other_units < stages[0]:
        need, key = stages[0] - sizes.other_units, sizes.layers.key
        raise ConfigError(
            f"The model has {sizes.layers.value + sizes.other_units} pipeline units (one per layer, {sizes.layers}, "
            f"and the embedding, the final norm and the head) but the layout needs {stages[0]} stages ({stages[1]}). "
            f"Fix: {key}={need} or more, or lower parallel.pp or parallel.stages_per_rank.")
    for heads in sizes.heads:
        if heads.value % tp:
            fits = [d for d in range(2, heads.value + 1) if all(h.value % d == 0 for h in sizes.heads)]
            raise ConfigError(f"parallel.tp={tp} does not divide {heads}: each tensor-parallel shard holds whole "
                              f"heads. Fix: parallel.tp={' or '.join(map(str, fits[:4])) or 1}.")
    if sizes.positions is not None and seq_len > sizes.positions.value:
        raise ConfigError(
            f"train.seq_len={seq_len} is longer than the model takes: {sizes.positions}. Positions past it have "
            f"no embedding, or one it never trained on. Fix: train.seq_len={sizes.positions.value} or less, or "
            f"{sizes.positions.key}={seq_len} to raise the limit (a model without learned position embeddings).")


def _refuse_logging_keys(cfg: DictConfig) -> None:
    """``logging.<name>=true`` and ``logging.<name>_<option>``, the older spelling of the ``logger``
    group, are refused with the group's spelling as the fix: one way to turn on each logger."""
    for key, (name, option) in LOGGING_MOVED.items():
        value = (cfg.get("logging") or {}).get(key)
        if value is None:
            continue
        shown = str(value).lower() if isinstance(value, bool) else value
        if option is not None:
            fix = f"logger={name} logger.{name}.{option}={shown}"
        elif value:
            fix = f"logger={name} (several: 'logger=[tensorboard,mlflow]')"
        else:
            fix = f"leave logging.{key} out (no logger runs unless logger= names it)"
        raise ConfigError(f"logging.{key}={shown} is no longer read: the loggers are the logger group. Fix: {fix}.")


def _layout(cfg: DictConfig, csv: str | None, *, verify: bool, device: str,
            progress: Callable[[str], None]) -> tuple[Layout, int | None]:
    """The stages and their placement, after every check that needs the model or the data; and the
    windows of the data's training split (``runner.data.datasets.train_windows``)."""
    from runner.data.datasets import check_batches, check_eval_windows, check_vocab, train_windows
    from runner.losses import check_loss
    from runner.models.split import build_meta_model, check_init, check_keyword_inputs, check_shapes, plan_split
    from runner.parallel.tied import log_tied_placement
    from runner.parallel.tp import check_tp
    from runner.pipeline.schedule import splits_backward, stage_layout
    from runner.verify.memory import check_reference_fits

    p, t = cfg.parallel, cfg.train
    num_stages, stage_to_rank = stage_layout(cfg.schedule.name, p, csv, compiled=t.compile)
    microbatch = microbatch_size(t.batch_size, dp=p.dp, microbatches=p.microbatches)
    stage_modules = p.get("stage_modules")
    meta = build_meta_model(cfg.model, stage_modules)  # the model's checks first: the data's may tokenize
    check_tp(meta, p)
    pipelined = p.pp > 1
    stages = plan_split(meta, num_stages, p.split_points if pipelined else None,
                        stage_modules if pipelined else None)
    check_init(meta)
    progress("config checked")
    data, kwargs = check_batches(cfg.data, seed=t.seed, batch_size=t.batch_size, seq_len=t.seq_len,
                                 splits=("train", "val") if cfg.eval.every else ("train",), microbatch=microbatch)
    if cfg.eval.every:
        check_eval_windows(data, eval_steps=cfg.eval.steps, batch_size=t.batch_size, seq_len=t.seq_len)
    check_loss(cfg.loss, cfg.data.get("vocab_size") or 8)
    check_keyword_inputs(meta, kwargs)
    vocab = check_shapes(meta, stages, microbatch=microbatch, seq_len=t.seq_len, kwargs=kwargs)
    if verify:  # the unsplit reference, on rank 0's host beside the run
        check_reference_fits(meta, microbatch=microbatch, dp=p.dp, seq_len=t.seq_len, device=device, kwargs=kwargs)
    check_vocab(data, cfg.data.get("vocab_size"), vocab)  # every id of a token file, read once
    progress("data ready")
    sizes = [len(s) for s in stages]
    if len(set(sizes)) > 1:
        log.info("Uneven split (units per stage): %s", sizes)
    log_tied_placement(meta, stages, stage_to_rank, DP_MODES[p.dp_mode].per_stage)
    layout = Layout(schedule=cfg.schedule.name, csv=csv, pp=p.pp, microbatches=p.microbatches, stages=stages,
                    stage_to_rank=stage_to_rank, tied=tied_spans(meta, stages, stage_to_rank, p))
    if cfg.train.activation_checkpointing != "none" and layout.pp > 1 and splits_backward(layout.schedule, csv):
        log.warning(
            "train.activation_checkpointing=%s with schedule=%s: its weight backward (W) runs one autograd pass "
            "per parameter group and recomputes every checkpointed block in each, so a step is several times "
            "slower than without checkpointing (BENCHMARKS.md, \"Training options\"). Fix, if speed matters: "
            "train.activation_checkpointing=every_n or none, or a schedule with whole backward steps.",
            cfg.train.activation_checkpointing, layout.schedule)
    return layout, train_windows(data, t.seq_len)


def tied_spans(meta, stages, stage_to_rank: Mapping[int, int], p: DictConfig) -> tuple[TiedSpan, ...]:
    """The weights tied across pipeline ranks of this split and placement (``p``: ``parallel.*``),
    and the bytes of the gradient each copy sums: fp32, the vocabulary rows over tp and (FSDP) a
    shard over dp (``runner.parallel.tied``). The planner's probes ask it of their runs too."""
    from runner.models.split import tied_stages

    shards = int(p.get("tp", 1)) * (p.dp if p.dp_mode == "fsdp" else 1)
    spans = []
    for owners, numel in tied_stages(meta, stages):
        ranks = tuple(sorted({stage_to_rank[s] for s in owners}))
        if len(ranks) > 1:
            spans.append(TiedSpan(ranks, 4 * numel // shards))
    return tuple(spans)


def _check_optimizer_sync(cfg: DictConfig, *, verify: bool, resume: Path | None) -> None:
    """``verify`` reads a resumed run's AdamW state when the first step's norm is known: under
    ``post_validate`` and ``deferred`` the update has been applied by then."""
    if verify and resume is not None and cfg.train.optimizer_sync != OptimizerSync.barrier:
        raise ConfigError(f"train.optimizer_sync={cfg.train.optimizer_sync} with verify=true and checkpoint.resume="
                          f"{cfg.checkpoint.resume}: verify reads the resumed AdamW state before the first update, "
                          f"which {cfg.train.optimizer_sync} has already applied when the step's norm arrives. Fix: "
                          f"train.optimizer_sync=barrier for the verified run ({cfg.train.optimizer_sync} trains "
                          "bit-identically to it), or verify=false.")


def validate(cfg: DictConfig, run_dir: Path | None = None, *,
             progress: Callable[[str], None] = lambda what: None) -> ResolvedRun:
    """Check a composed config (raising ``ConfigError`` naming key, value and fix) and resolve it
    into the ``ResolvedRun``: its layout, the device ``auto`` picks here, threads per rank and, for a
    run in ``run_dir``, the checkpoint ``checkpoint.resume`` names. ``run_dir`` None: nothing will
    run (the planner's candidates); no checkpoint is looked for. ``progress``: told when the config
    is checked and the data ready (a run's startup lines)."""
    from runner.models.hf import resolve_verify
    from runner.ranks.dist import resolve_device

    check_config(cfg)
    check_callbacks(cfg.get("callbacks"))  # the user's hooks: importable, and Hooks
    csv = _schedule_file(cfg)
    dims = ParallelDims.from_config(cfg.parallel)
    ranks_on_host = int(os.environ.get("LOCAL_WORLD_SIZE", dims.world_size))
    device = resolve_device(cfg.device, ranks_on_host)
    check_host(cfg, device, ranks_on_host)
    verify = resolve_verify(cfg)
    layout, windows = _layout(cfg, csv, verify=verify, device=device, progress=progress)
    resume = resume_point(cfg, run_dir, windows) if run_dir is not None and cfg.checkpoint.resume else None
    _check_optimizer_sync(cfg, verify=verify, resume=resume)
    threads = threads_per_rank(cfg, ranks_on_host)
    return ResolvedRun(layout=layout, dims=dims, batch_size=cfg.train.batch_size,
                   seq_len=cfg.train.seq_len, steps=cfg.train.steps, device=device, threads_per_rank=threads,
                   rank_cpus=rank_cpus(cfg, device, ranks_on_host, threads), run_dir=run_dir, resume=resume,
                   verify=verify, verify_steps=cfg.verify_steps, train_windows=windows,
                   **rank_options(cfg))  # what the ranks read, typed
