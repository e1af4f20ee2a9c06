"""The sweep report: ``sweep.csv``, ``sweep.md`` and ``sweep.png`` in a Hydra multirun directory,
one row per job (its overrides, status, throughput, step time, bubble, memory, final loss).
A job's status is ``ok``, ``rejected`` (its combination failed the checks before launch: a
``ConfigError``, in well under a second, no rank started), ``failed`` (it crashed), or ``running``.

Built from the job directories themselves (``.hydra/overrides.yaml``, ``summary.json``, or the
``error.txt`` a failed job leaves), so it is rebuilt as each job ends, works for jobs running in
parallel (joblib) under a file lock, survives a failing job (Hydra's basic sweeper raises the first
failure before ``on_multirun_end``), and can be rebuilt by hand:

    python -m runner.report multirun/<date>/<time>
"""

from __future__ import annotations

import csv
import fcntl
import json
import os
import sys
from pathlib import Path
from typing import Any

import yaml
from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig

__all__ = ["collect_rows", "write_report", "SweepReport", "ERROR_FILE"]

ERROR_FILE = "error.txt"  # written into a job's directory when the job fails
COLUMNS = ["job", "overrides", "status", "tokens_per_s", "step_time_s", "bubble", "bubble_theoretical",
           "peak_mem_mib", "final_loss", "error"]


def _row(job_dir: Path) -> dict[str, Any]:
    overrides = yaml.safe_load((job_dir / ".hydra" / "overrides.yaml").read_text()) or []
    row: dict[str, Any] = {"job": job_dir.name, "overrides": " ".join(overrides), "status": "running"}
    summary_file, error_file = job_dir / "summary.json", job_dir / ERROR_FILE
    if summary_file.is_file():
        s = json.loads(summary_file.read_text())
        row.update(status="ok", tokens_per_s=round(s["tokens_per_s"], 1), step_time_s=round(s["step_time_s"], 5),
                   bubble=round(s["bubble"]["mean"], 4), bubble_theoretical=round(s["bubble"]["theoretical"], 4),
                   peak_mem_mib=round(max(s["peak_mem_bytes"]) / 2**20, 1), final_loss=round(s["final_loss"], 5))
    elif error_file.is_file():
        lines = error_file.read_text().strip().splitlines()
        # A rank's failure is a header ("RankFailedError: rank 1 failed:") over its traceback,
        # whose last line says what happened.
        error = f"{lines[0]} {lines[-1].strip()}" if lines[0].endswith(":") and len(lines) > 1 else lines[0]
        row.update(status="rejected" if error.startswith("ConfigError:") else "failed", error=error[:200])
    return row


def collect_rows(sweep_dir: Path) -> list[dict[str, Any]]:
    jobs = [d for d in sweep_dir.iterdir() if (d / ".hydra" / "overrides.yaml").is_file()]
    return [_row(d) for d in sorted(jobs, key=lambda d: (len(d.name), d.name))]


def _markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(str(r.get(c, "")).replace("|", "\\|") for c in COLUMNS) + " |" for r in rows]
    counts = {status: sum(r["status"] == status for r in rows) for status in ("ok", "rejected", "failed")}
    footer = (f"\n{len(rows)} jobs, {counts['ok']} ok, {counts['rejected']} rejected before launch, "
              f"{counts['failed']} failed.\n")
    return "\n".join(lines) + "\n" + footer


def _plot(path: Path, rows: list[dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if r["status"] == "ok"]
    # Label jobs by what varies between them (the swept values), not the overrides they share.
    shared = set.intersection(*(set(r["overrides"].split()) for r in ok)) if len(ok) > 1 else set()
    labels = [" ".join(o for o in r["overrides"].split() if o not in shared) or f"job {r['job']}" for r in ok]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(max(6.0, 0.9 * len(ok) + 2), 6), sharex=True)
    xs = range(len(ok))
    top.bar(xs, [r["tokens_per_s"] for r in ok], color="#4C78A8")
    top.set_ylabel("tokens/s")
    bottom.bar([x - 0.2 for x in xs], [r["bubble"] for r in ok], width=0.4, label="measured", color="#F58518")
    bottom.bar([x + 0.2 for x in xs], [r["bubble_theoretical"] for r in ok], width=0.4, label="theoretical",
               color="#54A24B")
    bottom.set_ylabel("bubble")
    bottom.legend(fontsize=8)
    bottom.set_xticks(list(xs), labels, rotation=30, ha="right", fontsize=7)
    failed = len(rows) - len(ok)
    common = " ".join(sorted(shared))
    title = f"{len(ok)} jobs" + (f" ({failed} rejected or failed, not shown)" if failed else "")
    fig.suptitle(title + (f"\n{common}" if common else ""), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_report(sweep_dir: Path) -> list[dict[str, Any]]:
    """Rebuild the report from every job directory; serialised across processes."""
    sweep_dir.mkdir(parents=True, exist_ok=True)
    with open(sweep_dir / ".report.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        rows = collect_rows(sweep_dir)
        with open(sweep_dir / "sweep.csv.tmp", "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=COLUMNS)
            writer.writeheader()
            writer.writerows(rows)
        os.replace(sweep_dir / "sweep.csv.tmp", sweep_dir / "sweep.csv")
        (sweep_dir / "sweep.md").write_text(_markdown(rows))
        if any(r["status"] == "ok" for r in rows):
            _plot(sweep_dir / "sweep.png", rows)
    return rows


def _sweep_dir(config: DictConfig) -> Path:
    return Path(config.hydra.sweep.dir).resolve()


class SweepReport(Callback):
    """Registered in ``conf/config.yaml`` under ``hydra.callbacks``."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        os.environ["RUNNER_SWEEP_DIR"] = str(_sweep_dir(config))  # for the failure summary in cli()

    def on_job_end(self, config: DictConfig, job_return: Any, **kwargs: Any) -> None:
        if HydraConfig.get().mode == RunMode.MULTIRUN:
            write_report(_sweep_dir(config))

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = _sweep_dir(config)
        write_report(sweep_dir)
        print(where_report(sweep_dir))


def where_report(sweep_dir: Path) -> str:
    """Where a sweep's outputs are: its report (and the files beside it), each job's run directory."""
    beside = [n for n in ("sweep.csv", "sweep.png") if (sweep_dir / n).is_file()]
    return (f"sweep report  {sweep_dir / 'sweep.md'}{' (and ' + ', '.join(beside) + ')' if beside else ''}\n"
            f"job run dirs  {sweep_dir}/<job number>/")


def main(argv: list[str] | None = None) -> int:
    args = argv if argv is not None else sys.argv[1:]
    if len(args) != 1 or not Path(args[0]).is_dir():
        print("usage: python -m runner.report <multirun directory>", file=sys.stderr)
        return 2
    rows = write_report(Path(args[0]))
    print((Path(args[0]) / "sweep.md").read_text(), end="")
    return 1 if any(r["status"] in ("failed", "rejected") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
