"""The config tree: ``RunConfig`` assembled from each package's schema (``parallel``, ``schedule``,
``model``, ``data``, ``launch``, ``checkpoint``, ``profile``, ``logging`` in their packages' ``config.py``;
``train``, ``eval`` and ``plan`` in ``runner.config``), the resolvers, and Hydra's ConfigStore.

Every YAML file under ``conf/`` extends one of these dataclasses through its defaults list, so a
misspelt key or a value of the wrong type fails at compose time with Hydra's own message, before
anything is launched. What Hydra lets through (keys added with ``+``, values outside a field's
choices, missing values) ``check_schema`` refuses, as the first of ``runner.validate.check_config``'s
checks. Importing this module registers the schemas; it imports nothing heavy.
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterator, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, ListConfig, OmegaConf

from runner.checkpoint.config import CheckpointConfig
from runner.config import EvalConfig, PlanConfig, TrainConfig
from runner.config_nodes import check_model_vocab, missing_keys
from runner.data.config import HFDataConfig, SyntheticDataConfig, TextDataConfig, TokensDataConfig
from runner.errors import ConfigError
from runner.models.config import HFModelConfig, MLPConfig, TransformerConfig
from runner.options import Device, allowed, choices
from runner.outputs.config import LoggingConfig, ProfileConfig
from runner.parallel.config import ParallelConfig
from runner.parallel.dims import ParallelDims
from runner.pipeline.config import CsvScheduleConfig, ScheduleConfig
from runner.ranks.config import LaunchConfig
from runner.rehearse.config import RehearseConfig

__all__ = ["RunConfig", "SCHEMAS", "register_configs", "config_dir", "RANK_OPTIONS", "rank_options",
           "check_schema"]


def config_dir() -> Path:
    """The config tree: ``runner/conf`` in an installed wheel (the build ships the repository's
    top-level ``conf/`` there), ``conf/`` next to the package in a checkout."""
    shipped = Path(__file__).resolve().parent / "conf"
    return shipped if shipped.is_dir() else Path(__file__).resolve().parent.parent / "conf"


@dataclass
class RunConfig:
    schedule: ScheduleConfig = MISSING
    model: Any = MISSING
    data: Any = MISSING
    # The loss of one microbatch: a function (logits, targets) -> scalar mean, instantiated with
    # _partial_: true, so loss._target_=pkg.module.fn plugs in your own.
    loss: Any = MISSING
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)
    rehearse: RehearseConfig = field(default_factory=RehearseConfig)  # rehearse=on: runner.rehearse
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    # Experiment loggers as Hydra's logger group: logger=wandb, 'logger=[tensorboard,mlflow]'
    # (conf/logger/<name>.yaml: the logger's _target_ and options). logging.<name>=true also works.
    logger: Dict[str, Any] = field(default_factory=dict)
    # Your own hooks (runner.hooks.Hook), by name: callbacks.<name>._target_=pkg.mod.Class plus its keyword
    # arguments; each instantiated on every rank and run after the trainer's own (runner.callbacks).
    callbacks: Dict[str, Any] = field(default_factory=dict)
    device: str = field(default="auto", metadata=choices(Device))  # auto | cpu | cuda
    # Also train the unsplit model on rank 0 beside the run for verify_steps optimizer steps and compare
    # gradients, weights, losses and norms (docs/verify.md). null (auto): on for a model=hf family outside
    # the tested list (model.allow_unlisted=true), off otherwise.
    verify: Optional[bool] = None
    verify_steps: int = 2  # optimizer steps verify follows (>= 1; 1 = the first update only)


def _tokenizer_vocab(tokenizer: str | None, default: int | None) -> int | None:
    from runner.data.tokens import tokenizer_vocab  # reads tokenizer.json only when one is named

    return tokenizer_vocab(tokenizer, default)


# The sections the ranks read, as their schemas' objects: ResolvedRun's fields of the same names.
RANK_OPTIONS = {"train": TrainConfig, "eval": EvalConfig, "checkpoint": CheckpointConfig, "profile": ProfileConfig}


def rank_options(cfg: DictConfig) -> dict[str, Any]:
    """Each section of ``RANK_OPTIONS`` resolved in ``cfg`` and typed by its schema (also a config
    made from plain dicts, as a spawned job's resolved config is)."""
    return {key: OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(schema),
                                                     OmegaConf.to_container(cfg[key], resolve=True)))
            for key, schema in RANK_OPTIONS.items()}


# The schemas the group options in conf/ extend, name -> (group, dataclass): ``conf/schedule/1f1b.yaml``
# opens with ``defaults: [/schema_schedule@_here_]``. Stored at the root of the config store, not in
# their groups, so that they are no options of the groups: not in --help, nor offered by tab completion.
SCHEMAS: dict[str, tuple[str, type]] = {
    "schema_rehearse": ("rehearse", RehearseConfig),
    "schema_schedule": ("schedule", ScheduleConfig),
    "schema_schedule_csv": ("schedule", CsvScheduleConfig),
    "schema_model_transformer": ("model", TransformerConfig),
    "schema_model_mlp": ("model", MLPConfig),
    "schema_model_hf": ("model", HFModelConfig),
    "schema_data_synthetic": ("data", SyntheticDataConfig),
    "schema_data_text": ("data", TextDataConfig),
    "schema_data_hf": ("data", HFDataConfig),
    "schema_data_tokens": ("data", TokensDataConfig),
}


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
            if value is None and f.default is None:  # an optional one unset (plan.schedules=null: every schedule)
                continue
            if isinstance(value, ListConfig):
                unknown = [v for v in value if v not in values]
                if unknown:
                    unset = f", or {key}=null" if f.default is None else ""
                    raise ConfigError(f"{key}={list(value)} has unknown values {unknown}. "
                                      f"Fix: a subset of {list(values)}{unset}.")
            elif value not in values:
                raise ConfigError(f"{key}={value!r} is not one of {', '.join(values)}. "
                                  f"Fix: {f.metadata['set_as'] or key}=<one of them>.")


def _check_tokenizer(cfg: DictConfig) -> None:
    """A ``data.tokenizer`` whose vocabulary could not be read (``data.vocab_size`` null): the
    tokenizer's own error (not there, not a tokenizer), not the missing vocabulary it causes."""
    data = cfg.get("data")
    if isinstance(data, DictConfig) and data.get("tokenizer") is not None and data.get("vocab_size") is None:
        from runner.data.tokens import load_tokenizer

        load_tokenizer(data.tokenizer)


def check_schema(cfg: DictConfig) -> None:
    """A composed config against the tree's schemas, before anything is resolved: missing values,
    the vocabulary's interpolation, keys no schema declares, option values outside their choices."""
    _check_missing(cfg)
    _check_tokenizer(cfg)
    check_model_vocab(cfg)
    _check_unknown_keys(cfg)
    _check_choices(cfg)


def register_configs() -> None:
    if not OmegaConf.has_resolver("world_size"):  # ${world_size:${parallel}}: ranks per job (runner.parallel.dims)
        OmegaConf.register_new_resolver("world_size", lambda parallel: ParallelDims.from_config(parallel).world_size)
    if not OmegaConf.has_resolver("runner_vocab"):  # ${runner_vocab:<tokenizer dir or null>,<default>}
        OmegaConf.register_new_resolver("runner_vocab", _tokenizer_vocab, use_cache=True)
    cs = ConfigStore.instance()
    cs.store(name="base_config", node=RunConfig)
    for name, (_, node) in SCHEMAS.items():
        cs.store(name=name, node=node)


register_configs()
