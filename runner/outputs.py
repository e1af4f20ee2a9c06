"""What a run leaves behind: ``metrics.jsonl`` (a line per step), ``summary.json``, and the
final table on stdout. Written by rank 0 only."""

from __future__ import annotations

import json
import resource
import statistics
import time
from pathlib import Path

import torch

__all__ = ["MetricsWriter", "peak_memory_bytes", "make_summary", "write_summary", "format_table"]


class MetricsWriter:
    """``metrics.jsonl``, and TensorBoard scalars when asked (``logging.tensorboard=true``)."""

    def __init__(self, run_dir: Path, *, tensorboard: bool = False):
        self.file = open(run_dir / "metrics.jsonl", "w")
        self.tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter  # optional extra: runner[tensorboard]

            self.tb = SummaryWriter(log_dir=str(run_dir / "tensorboard"))
        self.last_step = 0

    def write(self, record: dict) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()  # a crashed run keeps every finished step
        self.last_step = record["step"]
        if self.tb:
            for key in ("loss", "lr", "grad_norm", "step_time_s", "tokens_per_s"):
                self.tb.add_scalar(f"train/{key}", record[key], record["step"])

    def close(self, bubble: dict | None = None) -> None:
        self.file.close()
        if self.tb:
            if bubble:
                self.tb.add_scalar("pipeline/bubble", bubble["mean"], self.last_step)
                self.tb.add_scalar("pipeline/bubble_theoretical", bubble["theoretical"], self.last_step)
            self.tb.close()


def peak_memory_bytes(device: torch.device) -> int:
    """GPU: the allocator's high-water mark. CPU: the process's resident-set high-water mark."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def make_summary(*, cfg, layout, first_step, losses, step_times, tokens_per_step, launch_time, startup_s,
                 peak_mem) -> dict:
    steady = step_times[1:] or step_times  # the first step includes shape inference and warm-up
    step_time = statistics.median(steady)
    return {
        "schedule": layout.schedule,
        "pp": cfg.parallel.pp,
        "dp": cfg.parallel.dp,
        "microbatches": layout.microbatches,
        "num_stages": layout.num_stages,
        "stages": {str(i): list(names) for i, names in enumerate(layout.stages)},
        "steps": len(losses),
        "first_step": first_step,  # > 0 when resumed from a checkpoint
        "losses": losses,
        "final_loss": losses[-1],
        "step_time_s": step_time,
        "tokens_per_s": tokens_per_step / step_time,
        "startup_s": startup_s,
        "started_at": launch_time,  # epoch seconds: when this job was launched, and when it ended
        "finished_at": time.time(),
        "peak_mem_bytes": peak_mem,
        "torch_version": torch.__version__,
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
