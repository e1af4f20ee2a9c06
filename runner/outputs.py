"""What a run leaves behind: ``metrics.jsonl`` (a line per step), ``summary.json``, and the
final table on stdout. Written by rank 0 only."""

from __future__ import annotations

import json
import resource
import statistics
from pathlib import Path

import torch

__all__ = ["MetricsWriter", "peak_memory_bytes", "make_summary", "write_summary", "format_table"]


class MetricsWriter:
    def __init__(self, run_dir: Path):
        self.file = open(run_dir / "metrics.jsonl", "w")

    def write(self, record: dict) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()  # a crashed run keeps every finished step

    def close(self) -> None:
        self.file.close()


def peak_memory_bytes(device: torch.device) -> int:
    """GPU: the allocator's high-water mark. CPU: the process's resident-set high-water mark."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def make_summary(*, cfg, layout, losses, step_times, tokens_per_step, startup_s, peak_mem) -> dict:
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
        "losses": losses,
        "final_loss": losses[-1],
        "step_time_s": step_time,
        "tokens_per_s": tokens_per_step / step_time,
        "startup_s": startup_s,
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
        ("peak memory", ", ".join(f"{b / 2**20:.0f} MiB" for b in summary["peak_mem_bytes"])),
    ]
    if "verify" in summary:
        v = summary["verify"]
        rows.append(("verify", f"{'passed' if v['passed'] else 'FAILED'} (max abs grad diff "
                               f"{v['max_abs_diff']:.2g}, max rel {v['max_rel_diff']:.2g})"))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
