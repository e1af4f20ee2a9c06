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

import os
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.errors import HydraException
from omegaconf import DictConfig
from omegaconf.errors import OmegaConfBaseException

from runner.checkpoint_files import RunDirInUseError
from runner.clock import StartupClock
from runner.config import config_dir  # also registers the config schemas
from runner.errors import EXIT_CONFIG, EXIT_FAILED, RunnerError, exit_code
from runner.outputs import format_table
from runner.provenance import versions
from runner.rank_env import adopt_slurm_ranks, under_torchrun
from runner.report import ERROR_FILE, write_report
from runner.rundir import Rejected
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
        from runner.launch import launch  # torch, the pipelining runtime, DCP: what a run needs

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


def _run_dir_unwritable(e: BaseException) -> bool:
    """Hydra creates the run directory, saves ``.hydra/`` and opens ``runner.log`` before the job
    starts: an ``OSError`` then, or logging's ``ValueError`` wrapping one (an existing directory
    that cannot be written), means the run directory. Not after a job has launched."""
    if not _FIRST_LAUNCH:
        return False
    cause = e.__cause__ or e.__context__
    return isinstance(e, OSError) or (isinstance(e, ValueError) and str(e).startswith("Unable to configure")
                                      and isinstance(cause, OSError))


def _outcome(e: BaseException) -> tuple[int, str] | None:
    """(exit code, message) for an error that ended the command; None for one to re-raise (a
    bug in the runner: Python's traceback and status 1). Codes: runner.errors."""
    if isinstance(e, (HydraException, OmegaConfBaseException)):  # a typo, a wrong type, an unknown option
        # (Hydra's MissingConfigException is also an OSError: checked first.)
        cause = f"\n{e.__cause__}" if isinstance(e.__cause__, OmegaConfBaseException) else ""
        return EXIT_CONFIG, f"{e}{cause}"
    if isinstance(e, RunnerError):
        return exit_code(e), _failed_jobs() or f"error: {e}"
    if isinstance(e, KeyboardInterrupt):  # SIGINT before the launcher's own handler was set
        return exit_code(e), "interrupted"
    if _run_dir_unwritable(e):
        error = e if isinstance(e, OSError) else (e.__cause__ or e.__context__)
        return EXIT_CONFIG, (f"error: cannot write the run directory: {error}\n"
                             "Fix: hydra.run.dir=<a writable directory>.")
    return None


def cli() -> None:
    if "--version" in sys.argv[1:]:  # Hydra's own --version names only Hydra's
        print(_version())
        return
    adopt_slurm_ranks()  # `srun python -m runner`: one task per rank
    if under_torchrun() and os.environ["RANK"] != "0":
        # Every torchrun rank composes the config, but only rank 0 keeps a run directory.
        sys.argv += ["hydra.run.dir=.", "hydra.output_subdir=null", "hydra/job_logging=stdout",
                     "hydra.job_logging.root.level=WARNING"]
    # Let our errors reach the handler below instead of Hydra's traceback printer; Hydra's own
    # config errors stay compact.
    os.environ.setdefault("HYDRA_FULL_ERROR", "1")
    try:
        main()
        _end_of_search()
    except (Exception, KeyboardInterrupt, Rejected) as caught:
        e = caught.error if isinstance(caught, Rejected) else caught  # refused before Hydra's run directory
        outcome = _outcome(e)
        if outcome is None:  # a crash: its traceback, after the sweep's list of failed jobs if any
            print(_failed_jobs(), file=sys.stderr)
            raise
        print(outcome[1], file=sys.stderr)
        sys.exit(outcome[0])


if __name__ == "__main__":
    cli()
