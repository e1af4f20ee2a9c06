"""Pre-spawn validation: everything that can be checked without ranks is checked here, in the
launching process, and resolved into the ``RunPlan`` (``runner.layout``) every rank then follows.

``check_config`` holds the checks that need no torch; the command line runs it before importing
torch, the pipelining runtime and DCP (seconds), so a wrong value fails at once. The checks that
need them (schedule rules asked of torch, the meta model, the first batch) import them inside."""

from __future__ import annotations

import dataclasses
import difflib
import logging
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, ListConfig, OmegaConf

from runner.checkpoint.resume_check import resume_checkpoint
from runner.compose import rank_options
from runner.config import parse_bytes
from runner.config_nodes import check_model_vocab, missing_keys
from runner.errors import CheckpointError, ConfigError
from runner.layout import Layout, RunPlan, microbatch_size
from runner.options import allowed
from runner.outputs.config import LOGGING_MOVED
from runner.outputs.loggers import check_loggers
from runner.parallel.dims import ParallelDims
from runner.parallel.dp import DP_MODES
from runner.pipeline.registry import CSV, SCHEDULES
from runner.ranks.env import under_torchrun

if TYPE_CHECKING:
    import torch

__all__ = ["check_config", "usable_cpus", "validate"]

log = logging.getLogger(__name__)


def _check_missing(cfg: DictConfig) -> None:
    missing = sorted(missing_keys(cfg))
    if missing:
        raise ConfigError(
            f"Required value(s) missing: {', '.join(missing)}. Fix: set them on the command line, "
            f"e.g. {missing[0]}=<value>."
        )


# Groups whose keys are the arguments of a user's factory (model._target_=pkg.mod.fn and so on):
# extra keys there are legitimate, and the factory itself rejects what it does not take.
_OPEN_GROUPS = ("model", "data", "loss")


def _schema_nodes(node: DictConfig, path: str) -> Iterator[tuple[str, DictConfig, tuple[dataclasses.Field, ...]]]:
    """Each node with a dataclass schema: its path, the node and the schema's fields."""
    schema = OmegaConf.get_type(node)
    if schema is not None and dataclasses.is_dataclass(schema):
        yield path, node, dataclasses.fields(schema)
    for key, child in node.items_ex(resolve=False):
        if isinstance(child, DictConfig) and not (path == "" and key in _OPEN_GROUPS):
            yield from _schema_nodes(child, f"{path}{str(key)}.")


def _check_unknown_keys(cfg: DictConfig) -> None:
    """A key added with ``+key=value`` that no schema declares would be ignored without a word:
    ``+parallel.microbtches=8`` (Hydra's own suggestion for the typo) is refused like a plain typo."""
    for path, node, fields in _schema_nodes(cfg, ""):
        known = sorted(f.name for f in fields)
        for name in node.keys():
            key = str(name)
            if key in known:
                continue
            close = difflib.get_close_matches(key, known, n=1)
            hint = f"Did you mean {path}{close[0]}? " if close else ""
            raise ConfigError(f"{path}{key} is not a key of {path.rstrip('.') or 'the config'}: nothing would read "
                              f"it. {hint}Fix: drop +{path}{key}; the keys are {', '.join(known)}.")


def _check_choices(cfg: DictConfig) -> None:
    """Every string option against its schema field's choices (``runner.options``, or a registry:
    ``runner.pipeline.registry``, ``runner.parallel.dp``)."""
    for path, node, fields in _schema_nodes(cfg, ""):
        for f in fields:
            if "choices" not in f.metadata or f.name not in node:
                continue
            key, value, values = f"{path}{f.name}", node[f.name], allowed(f.metadata["choices"])
            if isinstance(value, ListConfig):
                unknown = [v for v in value if v not in values]
                if unknown:
                    raise ConfigError(f"{key}={list(value)} has unknown values {unknown}. "
                                      f"Fix: a subset of {list(values)}.")
            elif value not in values:
                raise ConfigError(f"{key}={value!r} is not one of {', '.join(values)}. "
                                  f"Fix: {f.metadata['set_as'] or key}=<one of them>.")


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
    (``Layout.csv``), not the name ``csv``."""
    if cfg.schedule.name != CSV:
        return None
    if cfg.schedule.get("csv") is None:
        raise ConfigError("schedule.name=csv needs a file: nothing sets schedule.csv. "
                          "Fix: schedule=csv schedule.csv=<the file>.")
    return cfg.schedule.csv


def _check_host(cfg: DictConfig, device: str, ranks: int) -> None:
    """What depends on this host's GPUs and compilers (asks torch); ``device``: resolved."""
    import torch

    t = cfg.train
    if device == "cuda" and torch.cuda.device_count() < ranks:
        raise ConfigError(
            f"device=cuda needs one GPU per rank ({ranks}) but this host has "
            f"{torch.cuda.device_count()}. Fix: device=cpu, or fewer ranks."
        )
    if t.precision == "bf16" and device == "cuda" and not torch.cuda.is_bf16_supported():
        raise ConfigError("train.precision=bf16: this GPU has no bf16 support. Fix: train.precision=fp32.")
    if t.compile and device != "cuda" and not (os.environ.get("CXX") or shutil.which("g++") or shutil.which("clang++")):
        raise ConfigError("train.compile=true on CPU needs a C++ compiler for inductor, and none was found "
                          "(g++, clang++ or $CXX). Fix: install one, or train.compile=false.")


def _check_batches(cfg: DictConfig) -> tuple[Any, dict[str, torch.Tensor]]:
    """Draw the first batch of each split the run uses; returns the dataset, one microbatch's keyword inputs."""
    import torch

    from runner.data.datasets import build_dataset, get_batch

    t, p = cfg.train, cfg.parallel
    data = build_dataset(cfg.data, seed=t.seed)  # e.g. a missing text file fails here
    kwargs = {}
    for split in ("train", "val") if cfg.eval.every else ("train",):
        try:
            inputs, targets, kwargs = get_batch(data, 1, t.batch_size, t.seq_len, split)
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
    microbatch = microbatch_size(t.batch_size, dp=p.dp, microbatches=p.microbatches)
    return data, {k: v[:microbatch] for k, v in kwargs.items()}


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


def _log_tied(meta, stages, stage_to_rank: dict[int, int], per_stage: bool) -> None:
    stage_of = {u: i for i, units in enumerate(stages) for u in units}
    for names in meta.tied:
        owners = sorted({stage_of[u] for n in names for u in meta.unit_names
                         if any(n.startswith(f"{m}.") for m in meta.spec.unit(u).modules)})
        ranks = sorted({stage_to_rank[s] for s in owners})
        if len(owners) > 1:  # one rank (V placements) shares one parameter, unless dp wraps each stage (tied.py)
            log.info("Tied weight %s spans stages %s on ranks %s: %s", " = ".join(names), owners, ranks,
                     "one parameter" if len(ranks) == 1 and not per_stage else "a copy each, gradients summed")


def _schedule_layout(cfg: DictConfig, csv: str | None) -> tuple[int, dict[int, int]]:
    """(number of stages, stage → rank) as the schedule, or the schedule file ``csv``, dictates."""
    from runner.pipeline import schedule as sched

    p, name = cfg.parallel, cfg.schedule.name
    if p.pp == 1:  # the unsplit reference: one stage, no schedule
        ignored = [f"parallel.{k}={p[k]}" for k in ("stages_per_rank", "split_points", "stage_modules")
                   if p.get(k) is not None]
        if ignored:
            log.warning("parallel.pp=1 trains the unsplit model; ignoring %s", ", ".join(ignored))
        return 1, {0: 0}
    compiled = cfg.train.compile
    if csv is not None:
        return sched.read_csv_schedule(csv, pp=p.pp, stages_per_rank=p.stages_per_rank,
                                       microbatches=p.microbatches, compiled=compiled)
    spr = p.stages_per_rank or sched.default_stages_per_rank(name)
    sched.check_schedule(name, pp=p.pp, stages_per_rank=spr, microbatches=p.microbatches, compiled=compiled)
    return p.pp * spr, sched.placement(name, p.pp, p.pp * spr)


def _splits_backward(layout: Layout) -> bool:
    """Whether the schedule runs separate input (I) and weight (W) backward actions."""
    if layout.csv is None:
        return SCHEDULES[layout.schedule].splits_backward
    from runner.pipeline.schedule import csv_order

    return any(op.kind in ("I", "W") for ops in csv_order(layout.csv).values() for op in ops)


# -- what the launcher resolves ---------------------------------------------------------------

def _concurrent_jobs() -> int:
    """Jobs a Hydra launcher runs at once on this host (joblib's n_jobs; -1 = one per core)."""
    n_jobs = HydraConfig.get().launcher.get("n_jobs") if HydraConfig.initialized() else None
    if not n_jobs:
        return 1
    return n_jobs if n_jobs > 0 else os.cpu_count() or 1


def usable_cpus() -> list[int]:
    """The cores this process may run on (a container's or taskset's share, not the host's count)."""
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))


def _threads_per_rank(cfg: DictConfig, ranks_on_host: int) -> int:
    """Ranks on one host, of every job running at once, share its cores: oversubscribed
    intra-op threads slow every rank down."""
    return cfg.launch.threads_per_rank or max(1, len(usable_cpus()) // (ranks_on_host * _concurrent_jobs()))


def _rank_cpus(cfg: DictConfig, device: str, ranks_on_host: int, threads: int) -> tuple[tuple[int, ...], ...] | None:
    """The cores each rank this runner spawns is pinned to (``launch.pin_cpus``), or None: not
    pinned. Consecutive blocks of ``threads`` cores, by rank."""
    pin = cfg.launch.pin_cpus
    if under_torchrun() and pin:
        raise ConfigError("launch.pin_cpus=true pins the ranks the runner starts itself; these ranks were "
                          "started by torchrun (or SLURM). Fix: launch.pin_cpus=null, and place them with the "
                          "launcher's own options (torchrun --numa-binding on GPUs) or numactl/taskset.")
    if under_torchrun() or pin is False or ranks_on_host == 1 or not hasattr(os, "sched_setaffinity"):
        return None
    cpus = usable_cpus()
    # Unasked, only where this job's ranks fill the cores: other jobs would be pinned to the same first
    # cores while the rest stay idle (a parallel sweep's, another user's). GPU runs' host threads: the OS's.
    if pin is None and (device != "cpu" or _concurrent_jobs() > 1 or len(cpus) // threads != ranks_on_host):
        return None
    if ranks_on_host * threads > len(cpus):  # asked for (unasked, the ranks fill the cores exactly)
        raise ConfigError(
            f"launch.pin_cpus=true: {ranks_on_host} ranks x {threads} threads (launch.threads_per_rank) need "
            f"{ranks_on_host * threads} cores, and this process may use {len(cpus)}. Fix: a smaller "
            "launch.threads_per_rank, or launch.pin_cpus=null to pin only where the threads fit.")
    return tuple(tuple(cpus[r * threads:(r + 1) * threads]) for r in range(ranks_on_host))


def _launch_dir() -> Path:
    """Where the user started the runner (Hydra may have changed into the run directory)."""
    return Path(HydraConfig.get().runtime.cwd) if HydraConfig.initialized() else Path.cwd()


def _resume_point(cfg: DictConfig, run_dir: Path) -> Path:
    """The checkpoint directory ``checkpoint.resume`` names: a checkpoint, a run directory's newest
    complete one, or (``latest``) the newest of the runs under ``checkpoint.latest_root``."""
    try:
        latest_root = _launch_dir() / Path(cfg.checkpoint.latest_root).expanduser()
        from runner.models.split import build_meta_model  # the model the checkpoint's tensors must fit
        path, step = resume_checkpoint(cfg, run_dir, latest_root, build_meta_model)  # its tokenizer checked too
    except CheckpointError as e:  # before any rank starts: the configuration names a bad checkpoint
        raise ConfigError(f"checkpoint.resume={cfg.checkpoint.resume!r}: {e}") from None
    if step >= cfg.train.steps:
        raise ConfigError(f"checkpoint.resume: {path} is at step {step}, already "
                          f"train.steps={cfg.train.steps}. Fix: a larger train.steps.")
    return path


def check_config(cfg: DictConfig) -> None:
    """The checks that need no torch: missing values, unknown keys, option values, numbers,
    loggers."""
    _refuse_logging_keys(cfg)
    _check_missing(cfg)
    check_model_vocab(cfg)
    _check_unknown_keys(cfg)
    _check_choices(cfg)
    _check_numbers(cfg)
    _schedule_file(cfg)
    check_loggers(cfg.get("logger"))  # enabled loggers' packages are importable, options known


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


def _layout(cfg: DictConfig, csv: str | None, *, verify: bool, device: str) -> Layout:
    """The stages and their placement, after every check that needs the model or the data."""
    from runner.data.datasets import check_vocab
    from runner.models.split import build_meta_model, check_init, check_shapes, plan_split
    from runner.parallel.tp import check_tp
    from runner.verify.memory import check_reference_fits

    p, t = cfg.parallel, cfg.train
    num_stages, stage_to_rank = _schedule_layout(cfg, csv)
    data, kwargs = _check_batches(cfg)
    _check_loss(cfg)
    stage_modules = p.get("stage_modules")
    meta = build_meta_model(cfg.model, stage_modules)
    check_tp(meta, p, cfg.train.seq_len, cfg.loss)
    pipelined = p.pp > 1
    stages = plan_split(meta, num_stages, p.split_points if pipelined else None,
                        stage_modules if pipelined else None)
    check_init(meta)
    _check_keyword_inputs(meta, kwargs)
    microbatch = microbatch_size(t.batch_size, dp=p.dp, microbatches=p.microbatches)
    vocab = check_shapes(meta, stages, microbatch=microbatch, seq_len=t.seq_len, kwargs=kwargs)
    if verify:  # the unsplit reference, on rank 0's host beside the run
        check_reference_fits(meta, microbatch=microbatch, dp=p.dp, seq_len=t.seq_len, device=device, kwargs=kwargs)
    check_vocab(data, cfg.data.get("vocab_size"), vocab)  # every id of a token file, read once
    sizes = [len(s) for s in stages]
    if len(set(sizes)) > 1:
        log.info("Uneven split (units per stage): %s", sizes)
    _log_tied(meta, stages, stage_to_rank, DP_MODES[p.dp_mode].per_stage)
    layout = Layout(schedule=cfg.schedule.name, csv=csv, pp=p.pp, microbatches=p.microbatches, stages=stages,
                    stage_to_rank=stage_to_rank)
    if cfg.train.activation_checkpointing != "none" and layout.pp > 1 and _splits_backward(layout):
        log.warning(
            "train.activation_checkpointing=%s with schedule=%s: its weight backward (W) runs one autograd pass "
            "per parameter group and recomputes every checkpointed block in each, so a step is several times "
            "slower than without checkpointing (BENCHMARKS.md, \"Training options\"). Fix, if speed matters: "
            "train.activation_checkpointing=every_n or none, or a schedule with whole backward steps.",
            cfg.train.activation_checkpointing, layout.schedule)
    return layout


def validate(cfg: DictConfig, run_dir: Path | None = None) -> RunPlan:
    """Check a composed config (raising ``ConfigError`` naming key, value and fix) and resolve it
    into the run's plan: its layout, the device ``auto`` picks here, threads per rank and, for a
    run in ``run_dir``, the checkpoint ``checkpoint.resume`` names. ``run_dir`` None: nothing will
    run (the planner's candidates); no checkpoint is looked for."""
    from runner.models.hf import resolve_verify
    from runner.ranks.dist import resolve_device

    check_config(cfg)
    csv = _schedule_file(cfg)
    dims = ParallelDims.from_config(cfg.parallel)
    ranks_on_host = int(os.environ.get("LOCAL_WORLD_SIZE", dims.world_size))
    device = resolve_device(cfg.device, ranks_on_host)
    _check_host(cfg, device, ranks_on_host)
    verify = resolve_verify(cfg)
    layout = _layout(cfg, csv, verify=verify, device=device)
    resume = _resume_point(cfg, run_dir) if run_dir is not None and cfg.checkpoint.resume else None
    threads = _threads_per_rank(cfg, ranks_on_host)
    return RunPlan(layout=layout, dims=dims, batch_size=cfg.train.batch_size,
                   seq_len=cfg.train.seq_len, steps=cfg.train.steps, device=device, threads_per_rank=threads,
                   rank_cpus=_rank_cpus(cfg, device, ranks_on_host, threads), run_dir=run_dir, resume=resume,
                   verify=verify, verify_steps=cfg.verify_steps, **rank_options(cfg))  # what the ranks read, typed
