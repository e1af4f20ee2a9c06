"""``python -m runner`` (or the ``runner`` console script): compose the config with Hydra, check
it, launch the ranks, print the summary.

Only this outermost entry turns errors into exit codes (``runner.errors``: 2 the configuration
cannot run, 3 the run failed, 130/143 interrupted, 1 a bug); inside, errors are raised.
Nothing imported at the top imports torch: Hydra's own errors (a misspelt key, a wrong type, an
unknown option), the checks that need no torch, ``--version`` and shell completion answer in a
fraction of a second; torch, the pipelining runtime and DCP load once a run needs them.
"""
# ruff: noqa: E402  (the launch clock starts before the imports)

from __future__ import annotations

import time

# "launch" of the first job: before importing torch, so startup_s counts that too. Later jobs of
# a sweep in this process start their own clock.
_FIRST_LAUNCH = [time.time()]

import atexit
import gc
import os
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from runner.compose import config_dir  # also registers the config schemas
from runner.errors import EXIT_CONFIG, EXIT_FAILED
from runner.exits import expand_home, run_entry
from runner.outputs.metrics import format_table
from runner.outputs.provenance import versions
from runner.outputs.sweep_report import ERROR_FILE, write_report
from runner.ranks.clock import StartupClock
from runner.ranks.console import quiet_libraries
from runner.ranks.env import adopt_slurm_ranks, under_torchrun
from runner.ranks.host import passive_threads
from runner.ranks.restarts import first_run_dir
from runner.rundir import RunDirInUseError
from runner.validate import check_config


@hydra.main(config_path=str(config_dir()), config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> float | None:
    """The Hydra task: returns tokens/s, the objective of ``hparams_search=optuna``."""
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    try:
        check_config(cfg)  # before torch is imported: a wrong value fails at once
        composed_at = time.time()
        clock = StartupClock(launched_at=_FIRST_LAUNCH.pop() if _FIRST_LAUNCH else composed_at)
        clock.mark("compose", composed_at)
        import torch

        if cfg.rehearse.enabled:  # each rank's step rehearsed alone, not run
            from runner.rehearse.launch import format_rehearsal, raise_if_over_capacity, rehearse

            torch.set_num_threads(1)
            report = rehearse(cfg, run_dir)
            print(format_rehearsal(report))
            raise_if_over_capacity(report)  # exit 3: a rank's peak over rehearse.capacity
            return None
        from runner.launch import launch  # torch, the pipelining runtime, DCP: what a run needs

        # Nothing has computed in this process yet: one thread keeps it so, and its ranks forkable
        # (runner.ranks.processes.spawn_reason); a sweep's in-process job is remembered there.
        torch.set_num_threads(1)
        summary = launch(cfg, run_dir, clock=clock)
    except Exception as e:  # leave the reason in the job directory for the sweep report
        if isinstance(e, RunDirInUseError):  # not this run's directory: another run's, in progress
            raise
        try:
            (run_dir / ERROR_FILE).write_text(f"{type(e).__name__}: {e}\n")
        except OSError:  # a full disk: the error itself still reaches the user
            pass
        raise
    if summary is None:
        return None
    print(format_table(summary))
    return summary["tokens_per_s"]


def _sweep_jobs() -> tuple[str | None, list[dict]]:
    """In a sweep: its directory and the rows of its rebuilt report; else (None, [])."""
    sweep_dir = os.environ.get("RUNNER_SWEEP_DIR")
    return (sweep_dir, write_report(Path(sweep_dir))) if sweep_dir else (None, [])


def _listed(sweep_dir: str | None, rows: list[dict], statuses: tuple[str, ...]) -> str:
    """The jobs with these statuses and why; empty if none."""
    listed = [r for r in rows if r["status"] in statuses]
    if not listed:
        return ""
    lines = [f"  job {r['job']} ({r['overrides']}): {r['status']}: {r.get('error', '')}" for r in listed]
    return (f"{len(listed)} of {len(rows)} jobs {' or '.join(statuses)} (report: {sweep_dir}/sweep.md):\n"
            + "\n".join(lines))


def _failed_jobs() -> str:
    return _listed(*_sweep_jobs(), ("failed", "rejected"))


def _version() -> str:
    v = versions()
    return (f"runner {v['runner']} (torch {v['torch']}, Hydra {v['hydra']}, Python {v['python']}; "
            f"configs: {config_dir()})")


def _end_of_search() -> None:
    """A search (optuna) records failing trials and carries on; its exit status says they failed.
    Rejected trials (invalid combinations of its search space) are listed, but are no failure."""
    sweep_dir, rows = _sweep_jobs()
    rejected, failed = _listed(sweep_dir, rows, ("rejected",)), _listed(sweep_dir, rows, ("failed",))
    if rejected:
        print(rejected, file=sys.stderr)
    if failed:
        print(failed, file=sys.stderr)
        sys.exit(EXIT_FAILED)


def _shadowed() -> str | None:
    """Why ``import runner`` found no package, or None. ``python -m runner`` puts the current
    directory first on ``sys.path``: a folder there named ``runner`` (without ``__init__.py``)
    becomes a namespace package merged with ours, whose ``runner/__init__.py`` then never runs."""
    package = sys.modules["runner"]
    if getattr(package, "__file__", None) is not None:
        return None
    others = [p for p in package.__path__ if Path(p).resolve() != Path(__file__).resolve().parent]
    return (f"error: the folder {others[0] if others else Path.cwd() / 'runner'} shadows the runner package: "
            "`python -m runner` imports from the current directory first, so the runner would run without its "
            "own package (runner/__init__.py). Fix: run from another directory, or use the `runner` command.")


def cli() -> None:
    passive_threads()  # before torch loads OpenMP: its threads sleep, not spin, while they wait
    # As the interpreter exits, after the handlers registered later (torch's, the loggers'): its
    # final collections would scan the whole heap of torch's modules for garbage, 0.7 CPU-s of every
    # run's end. The run's files and loggers are closed by then; no __del__ of ours waits for it.
    atexit.register(gc.freeze)
    shadowed = _shadowed()
    if shadowed:  # before any work: the summary would need runner.__version__
        print(shadowed, file=sys.stderr)
        sys.exit(EXIT_CONFIG)
    if "--version" in sys.argv[1:]:  # Hydra's own --version names only Hydra's
        print(_version())
        return
    sys.argv[1:] = expand_home(sys.argv[1:])
    quiet_libraries()  # before any library is imported: their progress bars and INFO lines off
    adopt_slurm_ranks()  # `srun python -m runner`: one task per rank
    if under_torchrun() and os.environ["RANK"] != "0":
        # Every torchrun rank composes the config, but only rank 0 keeps a run directory.
        sys.argv += ["hydra.run.dir=.", "hydra.output_subdir=null", "hydra/job_logging=stdout",
                     "hydra.job_logging.root.level=WARNING"]
    elif under_torchrun() and not any(a.startswith("hydra.run.dir=") for a in sys.argv[1:]):
        first = first_run_dir()  # restarted by torchrun: the run goes on in its own directory
        if first is not None:
            sys.argv.append(f"hydra.run.dir={first}")
    run_entry(_main_then_search_end, started=lambda: not _FIRST_LAUNCH, failed_jobs=_failed_jobs)


def _main_then_search_end() -> None:
    main()
    _end_of_search()


if __name__ == "__main__":
    cli()
