"""The Python API: ``runner.run(["parallel.pp=2", ...])`` does what ``python -m runner parallel.pp=2 ...``
does, from a plain Python process (a notebook, a script), and returns the summary;
``runner.plan([...])`` does what ``python -m runner.plan ...`` does and returns the plan.

The config is composed with Hydra's compose API from the same tree (``runner.compose.config_dir``)
and the same overrides (``~`` expanded as on the command line), checked by the same checks before
anything is imported that a run needs, and launched by ``runner.launch.launch``, the command line's
own launcher. The run directory is named as the command line names it (``hydra.run.dir``:
``outputs/<date>/<time>`` under the current directory) unless ``run_dir=`` names one; its
``.hydra/config.yaml`` and ``.hydra/overrides.yaml`` are written as Hydra writes them, and the
run's log lines go to its ``runner.log``. Errors are raised, never turned into exit codes: a
``ConfigError`` (the configuration cannot run, Hydra's own errors included), or another
``RunnerError`` (the run failed). Nothing here imports torch until a run is launched.
"""

from __future__ import annotations

import logging
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Sequence

from omegaconf import DictConfig, OmegaConf, open_dict

from runner.compose import config_dir  # also registers the config schemas
from runner.errors import ConfigError
from runner.exits import expand_home, outcome
from runner.rundir import in_use_error, run_in_progress
from runner.validate import check_config

__all__ = ["run", "plan", "compose_run"]


def compose_run(overrides: Sequence[str] | None = None, *, config_name: str = "config",
                run_dir: str | os.PathLike | None = None) -> tuple[DictConfig, Path]:
    """The composed config (without its ``hydra`` node, as the command line's task receives it) and
    the absolute run directory; Hydra's errors (a misspelt key) as ``ConfigError``."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    args = expand_home(list(overrides or []))
    try:
        with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3", job_name="runner"):
            cfg = compose(config_name=config_name, overrides=args, return_hydra_config=True)
        hydra_run_dir = str(cfg.hydra.run.dir)  # ${now:...} resolved now, as the command line's is
    except (HydraException, OmegaConfBaseException) as e:
        ended = outcome(e, started=False)
        raise ConfigError(ended[1] if ended else str(e)) from e
    if cfg.hydra.mode is not None and str(cfg.hydra.mode).endswith("MULTIRUN"):
        raise ConfigError("hydra.mode=MULTIRUN: runner.run runs one job. Fix: call runner.run once per job, or "
                          "sweep on the command line (python -m runner -m ...).")
    with open_dict(cfg):
        cfg.pop("hydra")
    directory = Path(run_dir if run_dir is not None else hydra_run_dir).expanduser().absolute()
    return cfg, directory


def _save_hydra_files(cfg: DictConfig, run_dir: Path, overrides: list[str]) -> None:
    """``.hydra/config.yaml`` and ``.hydra/overrides.yaml``, as a command-line run has them (the
    loggers name a run by its overrides: ``runner.outputs.metrics.run_identity``)."""
    saved = run_dir / ".hydra"
    saved.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(cfg, saved / "config.yaml")
    OmegaConf.save(OmegaConf.create(overrides), saved / "overrides.yaml")


@contextmanager
def _run_log(run_dir: Path) -> Iterator[None]:
    """The runner's log lines (INFO and up) into ``runner.log`` in the run directory while it runs, as
    Hydra's job logging does on the command line; the caller's own logging is left as it is."""
    logger = logging.getLogger("runner")
    handler = logging.FileHandler(run_dir / "runner.log")
    handler.setFormatter(logging.Formatter("[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"))
    level = logger.level
    logger.addHandler(handler)
    if level == logging.NOTSET or level > logging.INFO:
        logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        handler.close()


def run(overrides: Sequence[str] | None = None, *, config_name: str = "config",
        run_dir: str | os.PathLike | None = None) -> dict:
    """Run the config that ``python -m runner <overrides>`` would, in this process's launcher (one
    rank here, several spawned), and return rank 0's summary (``summary.json``'s entries) with
    ``run_dir``, the run directory's absolute path (a string), added.

    ``config_name``: another primary config of the tree; ``run_dir``: the run directory (else
    ``hydra.run.dir``'s, ``outputs/<date>/<time>``). Raises ``ConfigError`` when the configuration
    cannot run, another ``RunnerError`` when the run failed."""
    cfg, directory = compose_run(overrides, config_name=config_name, run_dir=run_dir)
    check_config(cfg)  # before torch is imported: a wrong value fails at once
    if cfg.rehearse.enabled:
        raise ConfigError("rehearse=on is the command line's (it prints its table). "
                          "Fix: python -m runner rehearse=on <overrides>, or leave rehearse out.")
    if run_in_progress(directory):  # another run's directory: nothing is written into it
        raise in_use_error(directory)
    _save_hydra_files(cfg, directory, expand_home(list(overrides or [])))
    from runner.launch import launch  # torch, the pipelining runtime, DCP: what a run needs

    with _run_log(directory):
        summary = launch(cfg, directory)
    if summary is None:  # a torchrun rank other than 0
        return {"run_dir": str(directory)}
    return {**summary, "run_dir": str(directory)}


def plan(overrides: Sequence[str] | None = None, *, config_name: str = "config",
         plan_dir: str | os.PathLike | None = None) -> dict:
    """Plan the config that ``python -m runner.plan <overrides>`` would (the same table and lines
    printed, the same files written into ``plan_dir``, else ``outputs/<date>/<time>``) and return
    ``plan_dir`` (absolute), ``candidates`` (``plan.json``'s, fastest first), ``recommended`` (the
    chosen candidate) and ``command`` (the ``python -m runner ...`` line that runs it; its overrides
    are ``recommended["overrides"]`` after the ones given here). Raises ``ConfigError`` when the
    configuration (or every candidate) cannot run, another ``RunnerError`` when none fits the memory
    limit."""
    cfg, directory = compose_run(overrides, config_name=config_name, run_dir=plan_dir)
    check_config(cfg)  # before torch is imported: a wrong value fails at once
    directory.mkdir(parents=True, exist_ok=True)
    args = expand_home(list(overrides or []))
    _save_hydra_files(cfg, directory, args)
    from runner.plan.__main__ import plan_in  # torch, the launcher (the probe runs)

    with _run_log(directory):
        return plan_in(cfg, directory, args)
