"""A run directory in use: the lock a run's launcher holds on it while the run is in progress
(``hold_run_lock``; ``checkpoint.resume=latest`` passes over such runs), and a run directory that
belongs to a run in progress refused before Hydra writes into it.

Hydra creates the run directory, saves ``.hydra/`` (config, overrides) and opens the job's log
before the task function runs, so the run's own lock check (``hold_run_lock``,
taken by the launcher) comes too late to keep a rejected command out of a live run's directory.
``RunDirGuard`` (a Hydra callback, registered in ``conf/config.yaml``) checks the lock in
``on_run_start``, before any of that. Hydra turns an exception a callback raises into a warning,
so the refusal travels as ``Rejected``, which ``runner.exits.run_entry`` unwraps."""

from __future__ import annotations

import fcntl
import logging
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from runner.errors import ConfigError, Rejected
from runner.ranks.env import under_torchrun

__all__ = ["LOCK_FILE", "RunDirInUseError", "in_use_error", "hold_run_lock", "run_in_progress", "RunDirGuard"]

log = logging.getLogger("runner.checkpoint")  # its lines were the checkpoints' (runner.log reads as before)

LOCK_FILE = ".runner.lock"  # held (flock) by a run's launcher while the run is in progress


class RunDirInUseError(ConfigError):
    """The run directory belongs to a run in progress: nothing may be written into it."""


def in_use_error(run_dir: Path) -> RunDirInUseError:
    return RunDirInUseError(f"hydra.run.dir={str(run_dir)!r} is in use by another run that is still in progress; "
                            "nothing was written into it. Fix: another hydra.run.dir, or wait for that run to end.")


@contextmanager
def hold_run_lock(run_dir: Path) -> Iterator[None]:
    """Mark ``run_dir`` as in progress for as long as this block runs (and any forked rank
    lives: they inherit the lock). A second run in the same directory is refused."""
    with open(run_dir / LOCK_FILE, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise in_use_error(run_dir) from None
        except OSError as e:  # a filesystem without locks (some network mounts)
            log.warning("cannot lock %s (%s): checkpoint.resume=latest will not see this run as in progress",
                        f.name, e)
        yield


def run_in_progress(run_dir: Path) -> bool:
    lock = run_dir / LOCK_FILE
    if not lock.is_file():
        return False
    try:
        with open(lock) as f:
            fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:  # unreadable, or a filesystem without locks: nothing says it is running
        return False
    return False


class RunDirGuard(Callback):
    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        if under_torchrun() and os.environ.get("RANK") != "0":  # these ranks keep no run directory
            return
        try:
            run_dir = OmegaConf.select(config, "hydra.run.dir")
        except OmegaConfBaseException:  # an interpolation only the job can resolve: Hydra will say so
            return
        if run_dir is not None and run_in_progress(Path(str(run_dir)).expanduser().resolve()):
            raise Rejected(in_use_error(Path(str(run_dir))))
