"""The config tree: ``RunConfig`` assembled from each package's schema (``parallel``, ``schedule``,
``model``, ``data``, ``launch``, ``checkpoint``, ``profile``, ``logging`` in their packages' ``config.py``;
``train``, ``eval`` and ``plan`` in ``runner.config``), the resolvers, and Hydra's ConfigStore.

Every YAML file under ``conf/`` extends one of these dataclasses through its defaults list, so a
misspelt key or a value of the wrong type fails at compose time with Hydra's own message, before
anything is launched. Importing this module registers the schemas; it imports nothing heavy.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from runner.checkpoint.config import CheckpointConfig
from runner.config import EvalConfig, PlanConfig, TrainConfig
from runner.data.config import HFDataConfig, SyntheticDataConfig, TextDataConfig, TokensDataConfig
from runner.models.config import HFModelConfig, MLPConfig, TransformerConfig
from runner.options import Device, choices
from runner.outputs.config import LoggingConfig, ProfileConfig
from runner.parallel.config import ParallelConfig
from runner.parallel.dims import ParallelDims
from runner.pipeline.config import CsvScheduleConfig, ScheduleConfig
from runner.ranks.config import LaunchConfig
from runner.rehearse.config import RehearseConfig

__all__ = ["RunConfig", "SCHEMAS", "register_configs", "config_dir", "RANK_OPTIONS", "rank_options"]


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
    device: str = field(default="auto", metadata=choices(Device))  # auto | cpu | cuda
    # Also train the unsplit model on rank 0 beside the run for verify_steps optimizer steps and compare
    # gradients, weights, losses and norms (docs/verify.md). null (auto): on for a model=hf family outside
    # the tested list (model.allow_unlisted=true), off otherwise.
    verify: Optional[bool] = None
    verify_steps: int = 2  # optimizer steps verify follows (>= 1; 1 = the first update only)


def _tokenizer_vocab(tokenizer: str | None, default: int | None) -> int | None:
    from runner.data.tokens import tokenizer_vocab  # reads tokenizer.json only when one is named

    return tokenizer_vocab(tokenizer, default)


# The sections the ranks read, as their schemas' objects: RunPlan's fields of the same names.
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
