"""Structured-config schemas, registered in Hydra's ConfigStore.

Every YAML file under ``conf/`` extends one of these dataclasses through its defaults list, so a
misspelt key or a value of the wrong type fails at compose time with Hydra's own message, before
anything is launched.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import II, MISSING, OmegaConf

__all__ = ["RunConfig", "register_configs"]


@dataclass
class ScheduleConfig:
    # One of runner.schedule.SCHEDULES (gpipe, 1f1b, interleaved_1f1b, looped_bfs,
    # interleaved_zb, zbv, dualpipev).
    name: str = MISSING


@dataclass
class CsvScheduleConfig(ScheduleConfig):
    name: str = "csv"
    # Path to a compute-only action CSV (one row per pipeline rank, e.g. "0F0,0F1,2F0,...").
    csv: str = MISSING


@dataclass
class ParallelConfig:
    pp: int = 2  # pipeline ranks; 1 = the unsplit model in one process (the reference)
    dp: int = 1  # data-parallel replicas of the whole pipeline (ranks = pp * dp)
    # How each stage is replicated over dp: none (dp must be 1), ddp (torch's FSDP-based
    # replicate: gradients all-reduced, correct for every schedule), fsdp (FSDP2 fully_shard).
    dp_mode: str = "none"
    microbatches: int = 4  # microbatches per step, per pipeline
    # Stages per pipeline rank; null = derived from the schedule (1 single-stage, 2 multi-stage).
    stages_per_rank: Optional[int] = None
    # Names of top-level model children where a new stage starts; null = balanced automatically.
    split_points: Optional[List[str]] = None


@dataclass
class TrainConfig:
    steps: int = 30
    batch_size: int = 16  # global samples per optimizer step
    seq_len: int = 32  # tokens per sample
    lr: float = 3e-3  # peak learning rate (AdamW)
    # After warmup: cosine or linear decay to lr * min_lr_ratio at the last step, or constant.
    lr_schedule: str = "cosine"
    min_lr_ratio: float = 0.1
    warmup_steps: int = 3  # linear warmup from lr / warmup_steps
    weight_decay: float = 0.1
    # Parameter kinds AdamW does not decay: bias, norm (LayerNorm/RMSNorm/... weights), embedding.
    # Decaying them pulls gains and lookup rows towards zero for no regularisation benefit.
    no_decay: List[str] = field(default_factory=lambda: ["bias", "norm", "embedding"])
    betas: List[float] = field(default_factory=lambda: [0.9, 0.95])
    grad_clip: float = 1.0  # max global gradient norm across all stages; 0 = off
    seed: int = 0
    # fp32 | bf16. bf16 autocasts each stage's forward (parameters, gradients and the optimizer
    # stay fp32); with parallel.dp_mode=fsdp it is FSDP's mixed-precision policy instead.
    precision: str = "fp32"
    # Recompute activations in backward instead of keeping them: none | full (every block) |
    # every_n (every ac_every-th block). Blocks are the model's children between the first and
    # the last (the embedding and the head are never recomputed).
    activation_checkpointing: str = "none"
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
    # Rendezvous: null = a file in the run directory (no port, no collisions); N = a TCP store on
    # 127.0.0.1:N hosted by the launcher (bound to loopback only).
    port: Optional[int] = None
    # After SIGINT/SIGTERM, a stall or a failed rank: how long ranks get to exit before SIGKILL (>= 0).
    grace_s: float = 10.0
    # How rank processes start: fork (children inherit the launcher's imports: startup in
    # milliseconds instead of seconds), spawn (fresh interpreters), or auto: fork for CPU runs
    # on Linux, spawn where fork is unsafe (CUDA, macOS).
    start_method: str = "auto"


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
    wandb_mode: str = "offline"  # offline | online (needs `wandb login`) | disabled (keep config, log nothing)
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


@dataclass
class PlanConfig:
    """``python -m runner.plan``: candidates, costs and limits (ignored by training runs)."""

    microbatches: List[int] = field(default_factory=lambda: [2, 4, 8, 16])  # counts to try
    costs: Optional[str] = None  # a previous run's summary.json: its measured per-stage costs
    memory_limit: Optional[int] = None  # bytes of in-flight activations per rank; null = no limit
    # Message and runtime costs; null = measured on two ranks of this host before planning.
    comm_latency_s: Optional[float] = None  # per message between ranks
    comm_bandwidth: Optional[float] = None  # bytes/s between ranks
    action_overhead_s: Optional[float] = None  # the pipelining runtime's cost per F/B/I/W action
    corunning_slowdown: Optional[float] = None  # compute time with every rank busy / alone
    comm_busy_delay_s: Optional[float] = None  # added to a message whose sender is computing
    action_jitter: Optional[float] = None  # coefficient of variation of an action's time
    repeats: int = 5  # timings per child; the median is used


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
    path: str = MISSING  # any local text file, read as bytes
    vocab_size: int = 256  # byte-level: fixed
    val_fraction: float = 0.1  # the file's tail held out for evaluation


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
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    device: str = "auto"  # auto | cpu | cuda
    # Also run the unsplit model on the first batch and compare loss and every gradient.
    verify: bool = False


def register_configs() -> None:
    if not OmegaConf.has_resolver("mul"):  # ${mul:${parallel.pp},${parallel.dp}}: ranks per job
        OmegaConf.register_new_resolver("mul", lambda *xs: math.prod(int(x) for x in xs))
    cs = ConfigStore.instance()
    cs.store(name="base_config", node=RunConfig)
    cs.store(group="schedule", name="base_schedule", node=ScheduleConfig)
    cs.store(group="schedule", name="base_csv_schedule", node=CsvScheduleConfig)
    cs.store(group="model", name="base_transformer", node=TransformerConfig)
    cs.store(group="model", name="base_mlp", node=MLPConfig)
    cs.store(group="data", name="base_synthetic", node=SyntheticDataConfig)
    cs.store(group="data", name="base_text", node=TextDataConfig)


register_configs()
