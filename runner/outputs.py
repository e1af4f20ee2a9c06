"""What a run leaves behind: ``metrics.jsonl`` (a line per step), ``summary.json``, and the
final table on stdout. Written by rank 0 only. Imports no torch at the top: the command line
checks the loggers and prints the table from here before (and without) a run's heavy imports."""

from __future__ import annotations

import importlib.util
import json
import os
import resource
import statistics
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

import yaml
from omegaconf import DictConfig, OmegaConf

from runner.config import WANDB_MODES
from runner.errors import ConfigError
from runner.provenance import git_commit, provenance

if TYPE_CHECKING:
    from runner.clock import StartupClock
    from runner.layout import RunPlan

__all__ = ["MetricsWriter", "check_loggers", "peak_memory_bytes", "as_ran", "write_resolved_config", "make_summary",
           "write_summary", "format_table"]


# What each optional logger imports, and the extra that installs it.
_LOGGER_PACKAGES = {
    "tensorboard": (["tensorboard"], "tensorboard"),
    "wandb": (["wandb"], "wandb"),
    # mlflow-skinny; its local store (sqlite) also needs sqlalchemy and alembic.
    "mlflow": (["mlflow", "sqlalchemy", "alembic"], "mlflow"),
}


def check_loggers(options) -> None:
    """Raise ``ConfigError`` for an enabled logger whose package is missing, or a bad
    ``logging.wandb_mode``. Cheap (no imports): runs before any rank starts."""
    if options.wandb_mode not in WANDB_MODES:
        raise ConfigError(f"logging.wandb_mode={options.wandb_mode!r} is not one of {', '.join(WANDB_MODES)}.")
    for key, (modules, extra) in _LOGGER_PACKAGES.items():
        if not getattr(options, key):
            continue
        if key == "mlflow" and not _local_sqlite(options.mlflow_tracking_uri):
            modules = ["mlflow"]  # a server or file store needs no database driver here
        missing = [m for m in modules if importlib.util.find_spec(m) is None]
        if missing:
            raise ConfigError(_missing_message(key, extra, missing))


def _missing_message(key: str, extra: str, missing: list[str]) -> str:
    return (f"logging.{key}=true needs {', '.join(missing)} (not installed). "
            f"Fix: pip install -e '.[{extra}]' (or 'runner[{extra}]'), or logging.{key}=false.")


def _local_sqlite(uri: str | None) -> bool:
    return uri is None or uri.startswith("sqlite:")


def _metric_name(key: str) -> str:
    """``loss`` → ``train/loss``, ``val_loss`` → ``val/loss``: the dashboards group by prefix."""
    return f"val/{key[4:]}" if key.startswith("val_") else f"train/{key}"


def _numbers(record: dict) -> dict[str, float]:
    """Every numeric entry of a step's record but the step itself, under its logger name."""
    return {_metric_name(k): float(v) for k, v in record.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        out: dict[str, Any] = {}
        for k, v in tree.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: tree}


def run_identity(run_dir: Path) -> tuple[str, str | None]:
    """(name, group) of a run in the loggers' UIs: named by its command-line overrides (Hydra's
    ``.hydra/overrides.yaml``; the directory name without any), grouped by the sweep it belongs
    to (the sweep directory, which ``runner.report.SweepReport`` exports for the jobs)."""
    overrides_file = run_dir / ".hydra" / "overrides.yaml"
    overrides = yaml.safe_load(overrides_file.read_text()) if overrides_file.is_file() else None
    sweep = os.environ.get("RUNNER_SWEEP_DIR")
    group = f"{Path(sweep).parent.name}/{Path(sweep).name}" if sweep else None
    return " ".join(overrides or []) or run_dir.name, group


class MetricsWriter:
    """``metrics.jsonl``, plus the loggers ``logging.*`` turns on: TensorBoard, Weights & Biases,
    MLflow. Every numeric key of a record is logged, as ``train/<key>`` (``val_<key>`` as
    ``val/<key>``); the pipeline bubble at close as ``pipeline/bubble``. ``run_config`` (the
    composed config) is logged as the run's hyperparameters. ``options`` is ``cfg.logging``,
    already checked by ``check_loggers`` before launch. Runs are named and grouped by
    ``run_identity``."""

    def __init__(self, run_dir: Path, options, *, run_config: Mapping | None = None, resumed_after: int = 0):
        if isinstance(run_config, DictConfig):
            run_config = OmegaConf.to_container(run_config, resolve=True)
        hparams = dict(run_config or {})
        path = run_dir / "metrics.jsonl"
        # Resumed from a checkpoint of step N into a run directory: its records of steps 1..N stay
        # (``history``); the steps after N are trained again and replace the old ones.
        self.history = _history(path, resumed_after)
        if resumed_after:
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text("".join(json.dumps(r) + "\n" for r in self.history))
            os.replace(tmp, path)
        self.file = open(path, "a" if resumed_after else "w")
        self.last_step = 0
        self.tb = self.wandb = self.mlflow = None
        name, group = run_identity(run_dir)
        if options.tensorboard:
            from torch.utils.tensorboard import SummaryWriter  # optional extra: runner[tensorboard]

            self.tb = SummaryWriter(log_dir=str(run_dir / "tensorboard"))
        if options.wandb:
            self.wandb = _start_wandb(run_dir, options, hparams, name=name, group=group)
        if options.mlflow:
            self.mlflow = _MLflowRun(run_dir, options, hparams, name=name, group=group)

    def write(self, record: dict) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()  # a crashed run keeps every finished step
        step = self.last_step = record["step"]
        numbers = _numbers(record)
        if self.tb:
            for name, value in numbers.items():
                self.tb.add_scalar(name, value, step)
        if self.wandb:
            self.wandb.log(numbers, step=step)
        if self.mlflow:
            self.mlflow.log(numbers, step)

    def close(self, bubble: dict | None = None, *, failed: bool = False, artifacts: list[Path] = ()) -> None:
        """Finish every logger; ``failed`` marks the W&B and MLflow runs as failed (a crashed or
        stopped run must not stay "running" in their UIs); ``artifacts`` (the summary, the
        pictures) are copied into MLflow's run."""
        self.file.close()
        final = {}
        if bubble:
            final = {"pipeline/bubble": bubble["mean"], "pipeline/bubble_theoretical": bubble["theoretical"]}
        if self.tb:
            for name, value in final.items():
                self.tb.add_scalar(name, value, self.last_step)
            self.tb.close()
        if self.wandb:
            self.wandb.summary.update(final)  # one number per run: the summary, not a time series
            self.wandb.finish(exit_code=1 if failed else 0)
        if self.mlflow:
            self.mlflow.log(final, self.last_step)
            for path in artifacts:
                self.mlflow.client.log_artifact(self.mlflow.run_id, str(path))
            self.mlflow.finish("FAILED" if failed else "FINISHED")


def _history(path: Path, steps_done: int) -> list[dict]:
    """The records of steps up to ``steps_done`` (numbered from 1) in an existing ``metrics.jsonl``."""
    if not steps_done or not path.is_file():
        return []
    kept = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:  # a line cut short by a crash
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int) and record["step"] <= steps_done:
            kept.append(record)
    return kept


def _start_wandb(run_dir: Path, options, hparams: dict, *, name: str, group: str | None):
    try:
        import wandb  # optional extra: runner[wandb]
    except ImportError as e:
        raise ConfigError(_missing_message("wandb", "wandb", ["wandb"])) from e
    # The process-wide settings must carry the mode too: with only the run's mode offline,
    # wandb 0.31's telemetry still contacts the server (a DNS lookup and a POST at exit).
    wandb.setup(settings=wandb.Settings(mode=options.wandb_mode))
    return wandb.init(project=options.wandb_project, mode=options.wandb_mode, dir=str(run_dir),
                      config=hparams, name=name, group=group)


class _MLflowRun:
    """One MLflow run, through ``MlflowClient`` rather than mlflow's process-wide active run, so a
    run that fails before ``close()`` leaves nothing behind for the next one in this process."""

    def __init__(self, run_dir: Path, options, hparams: dict, *, name: str, group: str | None):
        try:
            from mlflow.entities import Metric, Param  # optional extra: runner[mlflow]
            from mlflow.exceptions import MlflowException
            from mlflow.tracking import MlflowClient
            from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH, MAX_PARAMS_TAGS_PER_BATCH
        except ImportError as e:
            raise ConfigError(_missing_message("mlflow", "mlflow", ["mlflow"])) from e
        self._metric = Metric
        uri = options.mlflow_tracking_uri
        local = uri is None
        if local:  # no server: a database in the run directory (mlflow 3 refuses a plain mlruns/)
            uri = f"sqlite:///{(run_dir / 'mlflow.db').resolve()}"
        self.client = MlflowClient(tracking_uri=uri)
        self.tracking_uri = uri
        experiment = self.client.get_experiment_by_name(options.mlflow_experiment)
        if experiment is not None:
            experiment_id = experiment.experiment_id
        else:
            artifacts = (run_dir / "mlruns").resolve().as_uri() if local else None
            try:
                experiment_id = self.client.create_experiment(options.mlflow_experiment, artifact_location=artifacts)
            except MlflowException:  # another run sharing this store created it first
                experiment_id = self.client.get_experiment_by_name(options.mlflow_experiment).experiment_id
        # MLflow's own tag for the code version; the sweep as a tag to filter by.
        tags = {"mlflow.source.git.commit": git_commit(), "sweep": group}
        self.run_id = self.client.create_run(experiment_id, run_name=name,
                                             tags={k: v for k, v in tags.items() if v}).info.run_id
        params = [Param(k, _param_value(v, MAX_PARAM_VAL_LENGTH)) for k, v in _flatten(hparams).items()]
        for i in range(0, len(params), MAX_PARAMS_TAGS_PER_BATCH):
            self.client.log_batch(self.run_id, params=params[i:i + MAX_PARAMS_TAGS_PER_BATCH])

    def log(self, numbers: dict[str, float], step: int) -> None:
        if numbers:
            now = int(time.time() * 1000)
            self.client.log_batch(self.run_id, metrics=[self._metric(k, v, now, step) for k, v in numbers.items()])

    def finish(self, status: str) -> None:
        self.client.set_terminated(self.run_id, status=status)


def _param_value(value: Any, limit: int) -> str:
    """Config values as they would be written on the command line; too long → cut, marked."""
    text = value if isinstance(value, str) else json.dumps(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def peak_memory_bytes(device) -> int:
    """GPU: the allocator's high-water mark. CPU: the process's resident-set high-water mark."""
    import torch

    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def as_ran(cfg: DictConfig, plan: RunPlan) -> dict:
    """The config as the ranks ran it: interpolations resolved, and what the launcher decided
    (``RunPlan.resolved_values``: the device, threads per rank, the checkpoint a resume found)
    filled in. A copy: the composed config itself stays as composed."""
    config = OmegaConf.to_container(cfg, resolve=True)
    for key, value in plan.resolved_values().items():
        *parents, leaf = key.split(".")
        node = config
        for parent in parents:
            node = node[parent]
        node[leaf] = value
    return config


def write_resolved_config(run_dir: Path, config: Mapping) -> Path:
    """``resolved_config.yaml``: ``config`` as ``as_ran`` gives it."""
    path = run_dir / "resolved_config.yaml"
    path.write_text(OmegaConf.to_yaml(config))
    return path


def make_summary(*, plan: RunPlan, clock: StartupClock, first_step: int, losses: list[float],
                 step_times: list[float], peak_mem: list[int], device_names: list[str], config_path: Path) -> dict:
    steady = step_times[1:] or step_times  # the first step includes shape inference and warm-up
    step_time = statistics.median(steady)
    layout = plan.layout
    return {
        "schedule": layout.schedule,
        "pp": layout.pp,
        "dp": plan.dp,
        "microbatches": layout.microbatches,
        "num_stages": layout.num_stages,
        "stages": {str(i): list(names) for i, names in enumerate(layout.stages)},
        "steps": len(losses),
        "first_step": first_step,  # > 0 when resumed from a checkpoint
        "losses": losses,
        "final_loss": losses[-1],
        "step_time_s": step_time,
        "tokens_per_s": plan.tokens_per_step / step_time,
        "startup_s": clock.since_launch("setup"),  # to the end of setup: the first step is measured apart
        "started_at": clock.launched_at,  # epoch seconds: when this job was launched, and when it ended
        "finished_at": time.time(),
        "peak_mem_bytes": peak_mem,
        # Provenance: what produced these numbers.
        **provenance(),
        "device_names": device_names,  # per rank
        "config": str(config_path.resolve()),
    }


def write_summary(run_dir: Path, summary: dict) -> None:
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")


def format_table(summary: dict) -> str:
    rows = [
        ("schedule", f"{summary['schedule']} (pp={summary['pp']}, stages={summary['num_stages']}, "
                     f"microbatches={summary['microbatches']})"),
        ("loss", f"{summary['losses'][0]:.4f} -> {summary['final_loss']:.4f} over {summary['steps']} steps"),
        ("step time", f"{summary['step_time_s'] * 1e3:.1f} ms (median)"),
        ("throughput", f"{summary['tokens_per_s']:,.0f} tokens/s"),
        ("startup", f"{summary['startup_s']:.1f} s"),
        ("bubble", f"{summary['bubble']['mean']:.3f} measured, {summary['bubble']['theoretical']:.3f} "
                   f"theoretical ({summary['bubble']['theoretical_source']})"),
        ("peak memory", ", ".join(f"{b / 2**20:.0f} MiB" for b in summary["peak_mem_bytes"])),
    ]
    if "verify" in summary:
        v = summary["verify"]
        rows.append(("verify", f"{'passed' if v['passed'] else 'FAILED'} (max abs grad diff "
                               f"{v['max_abs_diff']:.2g}, max rel {v['max_rel_diff']:.2g})"))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
