"""What a run leaves behind: ``metrics.jsonl`` (a line per step), ``summary.json``, and the
final table on stdout. Written by rank 0 only. Imports no torch at the top: the command line
checks the loggers and prints the table from here before (and without) a run's heavy imports."""

from __future__ import annotations

import ctypes
import json
import os
import resource
import statistics
import time
from pathlib import Path
from typing import TYPE_CHECKING, Mapping, Sequence

import yaml
from omegaconf import DictConfig, OmegaConf

from runner.outputs.loggers import build_loggers
from runner.outputs.provenance import provenance
from runner.parallel.dims import ParallelDims

if TYPE_CHECKING:
    from runner.layout import ResolvedRun
    from runner.ranks.clock import StartupClock

__all__ = ["MetricsWriter", "reset_peak_memory", "peak_memory_bytes", "as_ran", "write_resolved_config", "make_summary",
           "write_summary", "format_table"]


def _metric_name(key: str) -> str:
    """``loss`` → ``train/loss``, ``val_loss`` → ``val/loss``: the dashboards group by prefix."""
    return f"val/{key[4:]}" if key.startswith("val_") else f"train/{key}"


def _numbers(record: dict) -> dict[str, float]:
    """Every numeric entry of a step's record but the step itself, under its logger name."""
    return {_metric_name(k): float(v) for k, v in record.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}


def run_identity(run_dir: Path) -> tuple[str, str | None]:
    """(name, group) of a run in the loggers' UIs: named by its command-line overrides (Hydra's
    ``.hydra/overrides.yaml``; the directory name without any), grouped by the sweep it belongs
    to (the sweep directory, which ``runner.outputs.sweep_report.SweepReport`` exports for the jobs)."""
    overrides_file = run_dir / ".hydra" / "overrides.yaml"
    overrides = yaml.safe_load(overrides_file.read_text()) if overrides_file.is_file() else None
    sweep = os.environ.get("RUNNER_SWEEP_DIR")
    group = f"{Path(sweep).parent.name}/{Path(sweep).name}" if sweep else None
    return " ".join(overrides or []) or run_dir.name, group


class MetricsWriter:
    """``metrics.jsonl``, plus the loggers the ``logger`` group enables (``runner.outputs.loggers``:
    TensorBoard, Weights & Biases, MLflow). Every numeric key of a record is logged, as
    ``train/<key>`` (``val_<key>`` as ``val/<key>``); the pipeline bubble at close as
    ``pipeline/bubble``. ``run_config`` (the composed config) is logged as the run's
    hyperparameters, and its ``logger`` entries name the loggers (checked by ``check_loggers``
    before launch). Runs are named and grouped by ``run_identity``."""

    def __init__(self, run_dir: Path, *, run_config: Mapping | None = None, resumed_after: int = 0):
        hparams = _plain(run_config) if isinstance(run_config, DictConfig) else dict(run_config or {})
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
        name, group = run_identity(run_dir)
        self.loggers = build_loggers(hparams.get("logger"), run_dir=run_dir, hparams=hparams, name=name,
                                     group_name=group)

    def write(self, record: dict) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()  # a crashed run keeps every finished step
        step = self.last_step = record["step"]
        numbers = _numbers(record)
        for logger in self.loggers:
            logger.log(numbers, step)

    def close(self, bubble: dict | None = None, *, failed: bool = False, artifacts: Sequence[Path] = ()) -> None:
        """Finish every logger; ``failed`` marks the W&B and MLflow runs as failed (a crashed or
        stopped run must not stay "running" in their UIs); ``artifacts`` (the summary, the
        pictures) are copied into the loggers that keep files (MLflow)."""
        self.file.close()
        final = {}
        if bubble:
            final = {"pipeline/bubble": bubble["mean"], "pipeline/bubble_theoretical": bubble["theoretical"]}
        for logger in self.loggers:
            logger.finish(final, self.last_step, failed=failed, artifacts=list(artifacts))


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


def reset_peak_memory(device) -> None:
    """This rank's peak memory counted from here (its setup's start), not from its process's start:
    a process that ran an earlier job (a sweep's one-rank jobs, which Hydra's basic launcher runs in
    one process; ``runner.run`` called twice from Python) reported that job's peak as its own. GPU:
    the allocator's peak statistics reset. CPU (Linux): what earlier jobs freed given back to the
    system first (glibc's ``malloc_trim``: freed memory stays resident otherwise; their garbage in
    reference cycles was collected as the launch began, ``runner.launch``: a collection here, on the
    whole heap of every rank, cost 0.17 s a rank), then the resident set's high-water mark set to its
    current size (``/proc/self/clear_refs``); elsewhere it stays the process's since its start."""
    import torch

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)  # glibc's; absent elsewhere (musl, macOS)
    if trim is not None:
        trim(0)
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # 5: reset the peak resident set size to the process's current one
    except OSError:
        pass


def _vm_hwm_bytes() -> int | None:
    """``VmHWM`` of ``/proc/self/status``: the resident set's high-water mark, which
    ``reset_peak_memory`` resets (``ru_maxrss`` keeps the process's whole life). None off Linux."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    return None


def peak_memory_bytes(device) -> int:
    """GPU: the allocator's high-water mark. CPU: the process's resident-set high-water mark; both
    since ``reset_peak_memory`` (a rank calls it as its setup begins)."""
    import torch

    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    hwm = _vm_hwm_bytes()
    return hwm if hwm is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB


def _plain(cfg: DictConfig) -> dict:
    """``cfg`` as plain dicts and lists, interpolations resolved."""
    config = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(config, dict)  # the container of a DictConfig
    return config


def as_ran(cfg: DictConfig, resolved: ResolvedRun) -> dict:
    """The config as the ranks ran it: interpolations resolved, and what the launcher decided
    (``ResolvedRun.resolved_values``: the device, threads per rank, the checkpoint a resume found)
    filled in. A copy: the composed config itself stays as composed."""
    config = _plain(cfg)
    for key, value in resolved.resolved_values().items():
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


def make_summary(*, resolved: ResolvedRun, clock: StartupClock, first_step: int, losses: list[float],
                 step_times: list[float], peak_mem: list[int], device_names: list[str], config_path: Path) -> dict:
    steady = step_times[1:] or step_times  # the first step includes shape inference and warm-up
    step_time = statistics.median(steady)
    layout = resolved.layout
    return {
        "schedule": layout.schedule,
        **resolved.dims.degrees,  # pp, dp, tp: each parallel dimension's degree
        "microbatches": layout.microbatches,
        "num_stages": layout.num_stages,
        "stages": {str(i): list(names) for i, names in enumerate(layout.stages)},
        "steps": len(losses),
        "first_step": first_step,  # > 0 when resumed from a checkpoint
        "losses": losses,
        "final_loss": losses[-1],
        "step_time_s": step_time,
        "tokens_per_s": resolved.tokens_per_step / step_time,
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
        ("schedule", f"{summary['schedule']} (pp={summary['pp']}, "
                     + "".join(f"{k}={summary[k]}, " for k in ParallelDims.ORDER[1:] if summary.get(k, 1) > 1)
                     + f"stages={summary['num_stages']}, microbatches={summary['microbatches']})"),
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
        updates = [s["weights"]["max_lr_units"] for s in v.get("steps", []) if "weights" in s]
        after = f"; weights after {len(updates)} updates at most {max(updates):.2g} lr apart" if updates else ""
        rounding = f"; {v['rounding']['summary']}" if v.get("rounding") else ""  # the float64 rerun's finding
        rows.append(("verify", f"{'passed' if v['passed'] else 'FAILED'} (gradients at most "
                               f"{v['tolerance_used'] * 100:.2g}% of their tolerance, max abs grad diff "
                               f"{v['max_abs_diff']:.2g}{rounding}{after})"))
    if summary.get("config"):
        rows += where_outputs(Path(summary["config"]).parent)
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


# What a finished run leaves, by what a user looks for: (row, its files in the run directory).
_OUTPUTS = (("summary", ("summary.json", "metrics.jsonl")), ("traces", ("timeline.json", "traces/")),
            ("pictures", ("timeline.png", "schedule.png")))


def where_outputs(run_dir: Path) -> list[tuple[str, str]]:
    """Rows of where a run's outputs are: its directory, then the first of each kind in full and
    the others by name (those present)."""
    rows = [("run dir", str(run_dir))]
    for label, names in _OUTPUTS:
        found = [n for n in names if (run_dir / n).exists()]
        if found:
            rows.append((label, ", ".join([str(run_dir / found[0]), *found[1:]])))
    return rows
