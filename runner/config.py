"""Structured-config schemas, registered in Hydra's ConfigStore.

Every YAML file under ``conf/`` extends one of these dataclasses through its defaults list, so a
misspelt key or a value of the wrong type fails at compose time with Hydra's own message, before
anything is launched.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import II, MISSING, DictConfig, OmegaConf

from runner.dims import ParallelDims
from runner.dp import DP_MODES
from runner.errors import ConfigError
from runner.options import (
    ActivationCheckpointing,
    Device,
    LRSchedule,
    NoDecay,
    Precision,
    StartMethod,
    WandbMode,
    choices,
)
from runner.plan.target_config import TargetPlanConfig  # plan.target's keys
from runner.rehearse.config import RehearseConfig  # rehearse's keys
from runner.schedules import schedule_names

__all__ = ["RunConfig", "register_configs", "config_dir", "parse_bytes", "RANK_OPTIONS", "rank_options"]

# A string option's accepted values are its field's choices (runner.options, or a registry):
# the checks before launch (runner.validate) refuse any other value, naming key, value and fix.
WANDB_MODES = WandbMode.values()


def config_dir() -> Path:
    """The config tree: ``runner/conf`` in an installed wheel (the build ships the repository's
    top-level ``conf/`` there), ``conf/`` next to the package in a checkout."""
    shipped = Path(__file__).resolve().parent / "conf"
    return shipped if shipped.is_dir() else Path(__file__).resolve().parent.parent / "conf"


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(key: str, value: Any) -> int | None:
    """A memory size as users type it: ``2000000000``, ``2e9``, ``2GB``, ``1.5GiB`` (KB/MB/GB/TB
    are powers of 10, KiB/MiB/GiB/TiB powers of 2); None stays None."""
    if value is None:
        return None
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*", str(value))
    unit = match and match.group(2).lower()
    if not match or unit not in _UNITS:
        raise ConfigError(f"{key}={value!r} is not a memory size. Fix: bytes as a number (2000000000, 2e9) "
                          "or with a unit (2GB, 1.5GiB, 512MiB).")
    return int(float(match.group(1)) * _UNITS[unit])


@dataclass
class ScheduleConfig:
    # A schedule of the registry runner.schedules (gpipe, 1f1b, interleaved_1f1b, looped_bfs,
    # interleaved_zb, zbv, dualpipev), or csv.
    name: str = field(default=MISSING, metadata=choices(schedule_names, set_as="schedule"))


@dataclass
class CsvScheduleConfig(ScheduleConfig):
    name: str = field(default="csv", metadata=choices(schedule_names, set_as="schedule"))
    # Path to a compute-only action CSV (one row per pipeline rank, e.g. "0F0,0F1,2F0,...").
    csv: str = MISSING


@dataclass
class ParallelConfig:
    pp: int = 2  # pipeline ranks; 1 = the unsplit model in one process (the reference)
    dp: int = 1  # data-parallel replicas of the whole pipeline (ranks: runner.dims)
    # How each stage is replicated over dp: none (dp must be 1), ddp (torch's FSDP-based
    # replicate: gradients all-reduced, correct for every schedule), fsdp (FSDP2 fully_shard).
    dp_mode: str = field(default="none", metadata=choices(DP_MODES))  # runner.dp
    # Tensor parallelism inside each stage (runner.tp): the model's own tp_plan shards its layers
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


@dataclass
class TrainConfig:
    steps: int = 30
    batch_size: int = 16  # global samples per optimizer step
    seq_len: int = 32  # tokens per sample
    lr: float = 3e-3  # peak learning rate (AdamW)
    # After warmup: cosine or linear decay to lr * min_lr_ratio at the last step, or constant.
    lr_schedule: str = field(default="cosine", metadata=choices(LRSchedule))
    min_lr_ratio: float = 0.1
    warmup_steps: int = 3  # linear warmup from lr / warmup_steps
    weight_decay: float = 0.1
    # Parameter kinds AdamW does not decay: bias, norm (LayerNorm/RMSNorm/... weights), embedding.
    # Decaying them pulls gains and lookup rows towards zero for no regularisation benefit.
    no_decay: List[str] = field(default_factory=lambda: ["bias", "norm", "embedding"], metadata=choices(NoDecay))
    betas: List[float] = field(default_factory=lambda: [0.9, 0.95])
    grad_clip: float = 1.0  # max global gradient norm across all stages; 0 = off
    seed: int = 0
    # fp32 | bf16. bf16 autocasts each stage's forward (parameters, gradients and the optimizer
    # stay fp32); with parallel.dp_mode=fsdp it is FSDP's mixed-precision policy instead.
    precision: str = field(default="fp32", metadata=choices(Precision))
    # Recompute activations in backward instead of keeping them: none | full (every block) |
    # every_n (every ac_every-th block). Blocks are the model's children between the first and
    # the last (the embedding and the head are never recomputed).
    activation_checkpointing: str = field(default="none", metadata=choices(ActivationCheckpointing))
    ac_every: int = 2
    # torch.compile each child of every stage (in place: parameter names do not change).
    # Schedules that split backward into input and weight parts (interleaved_zb, zbv, dualpipev,
    # F/I/W CSVs) cannot run compiled stages and are rejected before launch.
    compile: bool = False


@dataclass
class EvalConfig:
    every: int = 0  # forward-only evaluation on held-out data every K optimizer steps (and after the last); 0 = off
    steps: int = 2  # held-out batches (of train.batch_size) per evaluation


@dataclass
class LaunchConfig:
    # Seconds without progress before the job is declared stuck (> 0): the gloo/nccl collective
    # timeout, and a spawned rank silent this long while training ends the job, named.
    timeout_s: float = 300.0
    # Intra-op threads per rank; null = this host's cores divided among the ranks it runs.
    threads_per_rank: Optional[int] = None
    # Pin each rank's threads to cores of its own (consecutive blocks of the cores this process
    # may use: `taskset -c` chooses which), so ranks neither share a core nor migrate (on a
    # 2-core host, models with actions of a few ms stepped 8-18% faster and steadier; with
    # 30-250 ms actions, no difference beyond run-to-run noise). null = pin CPU runs whose ranks
    # fill those cores (one job at a time); true = pin, or a config error if the threads do not
    # fit; false = leave placement to the OS. Ranks torchrun or SLURM started are theirs to place.
    pin_cpus: Optional[bool] = None
    # Rendezvous: null = a file in the run directory (no port, no collisions); N = a TCP store on
    # 127.0.0.1:N hosted by the launcher (bound to loopback only).
    port: Optional[int] = None
    # After SIGINT/SIGTERM, a stall or a failed rank: how long ranks get to exit before SIGKILL (>= 0).
    grace_s: float = 10.0
    # How rank processes start: fork (children inherit the launcher's imports: startup in
    # milliseconds instead of seconds), spawn (fresh interpreters), or auto: fork for CPU runs
    # on Linux, spawn where fork is unsafe (CUDA, macOS, OpenMP threads: runner.processes).
    start_method: str = field(default="auto", metadata=choices(StartMethod))


@dataclass
class ProfileConfig:
    # torch.profiler chrome traces per rank, the merged timeline, schedule.png and the simulated
    # schedule. The executed schedule.csv and the bubble are recorded either way.
    enabled: bool = True
    wait: int = 1  # steps skipped before profiling (the first step includes shape inference)
    warmup: int = 1  # profiler warm-up steps, not recorded
    active: int = 3  # steps recorded


@dataclass
class LoggingConfig:
    tensorboard: bool = False  # rank 0 writes scalars under <run dir>/tensorboard (needs tensorboard)
    # Weights & Biases (needs runner[wandb]). Offline by default so a run needs no network or
    # account; `wandb sync <run dir>/wandb/offline-run-*` uploads it later.
    wandb: bool = False
    wandb_project: str = "runner"  # groups runs in the W&B UI
    # offline | online (needs `wandb login`) | disabled (keep config, log nothing)
    wandb_mode: str = field(default="offline", metadata=choices(WandbMode))
    # MLflow (needs runner[mlflow]): a per-run database, or a shared store to compare runs in one UI.
    mlflow: bool = False
    # null = sqlite:///<run dir>/mlflow.db (no server); or a shared store, e.g. http://host:5000.
    mlflow_tracking_uri: Optional[str] = None
    mlflow_experiment: str = "runner"  # groups runs in the MLflow UI


@dataclass
class CheckpointConfig:
    every: int = 0  # save every K optimizer steps into <run dir>/checkpoints/step-N; 0 = never
    keep: int = 2  # complete checkpoints kept (the newest)
    # Continue from: a checkpoint directory, a run directory (its newest complete checkpoint), or
    # "latest": the newest complete checkpoint of the runs under latest_root that are not in progress.
    resume: Optional[str] = None
    # Where resume=latest looks (relative to the launch directory): this directory and run
    # directories up to three levels below it (outputs/<date>/<time>, multirun/<date>/<time>/<job>).
    latest_root: str = "outputs"
    # Resume with a data.tokenizer other than the one the checkpoint recorded (its token ids then
    # stand for other text); false: such a resume is refused before any rank starts.
    allow_tokenizer_change: bool = False


@dataclass
class PlanConfig(TargetPlanConfig):
    """``python -m runner.plan``: candidates, costs and limits (ignored by training runs)."""

    microbatches: List[int] = field(default_factory=lambda: [2, 4, 8, 16])  # counts to try
    # Before predicting, a few steps of real runs of this model (1F1B, interleaved 1F1B and ZBV
    # at the smallest microbatch count, 1F1B at the largest: runner.plan.probe), each this many
    # seconds of steps as predicted (8-60 steps), fit the cost model to how its actions run in a
    # pipeline; 0 = no probes (the child timings and the calibration alone: 15-27% low in
    # BENCHMARKS.md).
    probe_seconds: float = 4.0
    # A previous run's directory (or its summary.json) to fit to instead of probing; or a .yaml/.json of costs.
    costs: Optional[str] = None
    # Activations per rank: bytes (2e9, 2GB, 1.5GiB), 1f1b (p microbatches') or 2x1f1b; null = no limit.
    memory_limit: Optional[str] = None
    weight_grad_fraction: Optional[float] = None  # M_W / M_B, what an I keeps for its W; null: measured
    # Message and runtime costs; null = measured on two ranks of this host before planning.
    comm_latency_s: Optional[float] = None  # per message between ranks
    comm_bandwidth: Optional[float] = None  # bytes/s between ranks
    action_overhead_s: Optional[float] = None  # the pipelining runtime's cost per F/B/I/W action
    corunning_slowdown: Optional[float] = None  # compute time with every rank busy / alone
    comm_busy_delay_s: Optional[float] = None  # added to a message whose sender is computing
    action_jitter: Optional[float] = None  # coefficient of variation of an action's time
    repeats: int = 5  # timings per child; the median is used
    # Candidates predicted within this fraction of the fastest tie (the prediction's own error:
    # BENCHMARKS.md, planner section); the recommended one is then the one with least memory.
    tie_tolerance: float = 0.05
    # Also search action orders for the measured costs under memory_limit: one per microbatch
    # count, placement (1 or 2 stages per rank, looped or V) and split, written as CSV files
    # into the plan directory and listed beside the built-in schedules.
    synthesize: bool = False
    search_budget: int = 200  # orders evaluated per searched layout: bounds the search, not the clock
    search_seed: int = 0
    # Also plan every other parallel.pp x parallel.dp x parallel.tp of the same number of ranks
    # (tp's collectives costed from a calibrated all-reduce: runner.plan.tp_cost).
    search_degrees: bool = False


@dataclass
class ModelConfig:
    """Keys every built-in model factory takes. A user factory (``model._target_=pkg.mod.fn``)
    is called with the keys of the selected model group."""

    _target_: str = MISSING
    vocab_size: int = II("data.vocab_size")
    max_seq_len: int = II("train.seq_len")
    dim: int = 64
    n_layers: int = 4
    tie_embeddings: bool = False  # head shares the token embedding's weight


@dataclass
class TransformerConfig(ModelConfig):
    _target_: str = "runner.models.transformer"
    n_heads: int = 4
    ffn_mult: int = 4


@dataclass
class MLPConfig(ModelConfig):
    _target_: str = "runner.models.mlp"
    ffn_mult: int = 4


@dataclass
class HFModelConfig:
    """``model=hf``: a Hugging Face causal LM from a local directory (runner.hf)."""

    _target_: str = "runner.hf.causal_lm"
    path: str = MISSING  # a directory with config.json, optionally *.safetensors and tokenizer files
    pretrained: bool = True  # read the directory's weights (each rank its own stages'); false = random init
    # Run a family outside the tested list (Llama-like reading of its pipeline plan); verify then runs on the
    # first step unless verify=false is given.
    allow_unlisted: bool = False
    # config.json values to change, as AutoConfig.from_pretrained(path, **overrides): e.g. dropout off,
    # +model.config_overrides.resid_pdrop=0.0
    config_overrides: Dict[str, Any] = field(default_factory=dict)
    attn_implementation: Optional[str] = None  # eager | sdpa | ...; null = transformers' default


@dataclass
class SyntheticDataConfig:
    _target_: str = "runner.data.SyntheticData"
    vocab_size: int = 64
    # Probability that a token follows the hidden bigram rule instead of being uniform noise.
    signal: float = 0.9
    # Left-pad each sample by a random length and pass attention_mask=(batch, seq) bool to every
    # child whose forward takes it (padded targets are ignored by the loss).
    padding: bool = False


@dataclass
class TextDataConfig:
    _target_: str = "runner.data.TextData"
    path: str = MISSING  # a local text file (bytes), or with a tokenizer also a directory or glob of them
    tokenizer: Optional[str] = None  # a local Hugging Face tokenizer directory; null = bytes (vocabulary 256)
    vocab_size: Optional[int] = II("runner_vocab:${.tokenizer},256")  # the tokenizer's, or 256 bytes
    val_fraction: float = 0.1  # the tail of the token stream held out for evaluation
    cache_dir: Optional[str] = None  # tokenized files; null = $XDG_CACHE_HOME/runner/tokens
    # Key the token cache by a SHA-256 of the sources' bytes (read once per run), not by their path,
    # inode, size and times: a copy or a touch reuses it, and any edit is caught even where times lie.
    cache_by_content: bool = False


@dataclass
class HFDataConfig:
    """Local json/jsonl/parquet/arrow/csv files through ``datasets``, tokenized once and cached."""

    _target_: str = "runner.data.HFData"
    path: str = MISSING  # a file, directory or glob of one format
    field: str = "text"  # the column holding each document
    tokenizer: str = MISSING  # a local Hugging Face tokenizer directory (a model=hf directory has one)
    vocab_size: Optional[int] = II("runner_vocab:${.tokenizer},null")
    val_fraction: float = 0.01
    cache_dir: Optional[str] = None
    cache_by_content: bool = False  # as data=text's: the token cache keyed by the sources' bytes


@dataclass
class TokensDataConfig:
    """A pre-tokenized corpus: one flat binary of token ids (numpy memmap), or a .npy file."""

    _target_: str = "runner.data.TokensData"
    path: str = MISSING
    dtype: str = "uint16"  # uint16 (vocabularies up to 65536) | uint32
    vocab_size: Optional[int] = None  # needed by the built-in models; checked against every batch
    val_fraction: float = 0.01


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
    rehearse: RehearseConfig = field(default_factory=RehearseConfig)  # rehearse=true: runner.rehearse
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    # Experiment loggers as Hydra's logger group: logger=wandb, 'logger=[tensorboard,mlflow]'
    # (conf/logger/<name>.yaml: the logger's _target_ and options). logging.<name>=true also works.
    logger: Dict[str, Any] = field(default_factory=dict)
    device: str = field(default="auto", metadata=choices(Device))  # auto | cpu | cuda
    # Also run the unsplit model on the first batch and compare loss and every gradient. null (auto):
    # on for a model=hf family outside the tested list (model.allow_unlisted=true), off otherwise.
    verify: Optional[bool] = None


def _tokenizer_vocab(tokenizer: str | None, default: int | None) -> int | None:
    from runner.tokens import tokenizer_vocab  # reads tokenizer.json only when one is named

    return tokenizer_vocab(tokenizer, default)


# The sections the ranks read, as their schemas' objects: RunPlan's fields of the same names.
RANK_OPTIONS = {"train": TrainConfig, "eval": EvalConfig, "checkpoint": CheckpointConfig, "profile": ProfileConfig}


def rank_options(cfg: DictConfig) -> dict[str, Any]:
    """Each section of ``RANK_OPTIONS`` resolved in ``cfg`` and typed by its schema (also a config
    made from plain dicts, as a spawned job's resolved config is)."""
    return {key: OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(schema),
                                                     OmegaConf.to_container(cfg[key], resolve=True)))
            for key, schema in RANK_OPTIONS.items()}


def register_configs() -> None:
    if not OmegaConf.has_resolver("world_size"):  # ${world_size:${parallel}}: ranks per job (runner.dims)
        OmegaConf.register_new_resolver("world_size", lambda parallel: ParallelDims.from_config(parallel).world_size)
    if not OmegaConf.has_resolver("runner_vocab"):  # ${runner_vocab:<tokenizer dir or null>,<default>}
        OmegaConf.register_new_resolver("runner_vocab", _tokenizer_vocab, use_cache=True)
    cs = ConfigStore.instance()
    cs.store(name="base_config", node=RunConfig)
    cs.store(group="rehearse", name="base_rehearse", node=RehearseConfig)
    cs.store(group="schedule", name="base_schedule", node=ScheduleConfig)
    cs.store(group="schedule", name="base_csv_schedule", node=CsvScheduleConfig)
    cs.store(group="model", name="base_transformer", node=TransformerConfig)
    cs.store(group="model", name="base_mlp", node=MLPConfig)
    cs.store(group="model", name="base_hf", node=HFModelConfig)
    cs.store(group="data", name="base_synthetic", node=SyntheticDataConfig)
    cs.store(group="data", name="base_text", node=TextDataConfig)
    cs.store(group="data", name="base_hf", node=HFDataConfig)
    cs.store(group="data", name="base_tokens", node=TokensDataConfig)


register_configs()
