"""Optuna searches that persist and resume (``hparams_search=optuna``).

The study lives in a sqlite database at a path that does not change between invocations
(``hydra.sweeper.storage``; the sweep directory is timestamped, and does not exist yet when the
sweeper creates the study). Running the search again continues the same study: Hydra's optuna
sweeper loads it, and this callback lowers ``hydra.sweeper.n_trials`` by the trials already
finished, so that ``n_trials`` is the study's total, not a count per invocation, and offsets
``hydra.sweeper.sampler.seed`` by the same count: the sweeper builds its sampler afresh in every
invocation, and under the same seed its random draws (all of TPE's first ``n_startup_trials``)
replayed the earlier invocations' parameters, measuring them again instead of trying new ones.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, open_dict, read_write

__all__ = ["ResumeStudy", "finished_trials"]

log = logging.getLogger(__name__)

_SQLITE = "sqlite:///"


def finished_trials(study_name: str, storage: str) -> int:
    """Trials of the study that ended (complete, failed or pruned); 0 for a study not yet created."""
    import optuna

    try:
        study = optuna.load_study(study_name=study_name, storage=storage)
    except KeyError:  # no such study in this storage
        return 0
    return sum(t.state.is_finished() for t in study.trials)


class ResumeStudy(Callback):
    """Registered by ``conf/hparams_search/optuna.yaml`` under ``hydra.callbacks``; runs before
    Hydra instantiates the sweeper from the same config."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        sweeper = config.hydra.sweeper
        storage = sweeper.get("storage")
        if not storage:
            return  # an in-memory study: nothing to resume
        if storage.startswith(_SQLITE):  # sqlite creates the file, not its directory
            Path(storage[len(_SQLITE):]).parent.mkdir(parents=True, exist_ok=True)
        done = finished_trials(sweeper.study_name, storage)
        with read_write(sweeper), open_dict(sweeper):
            total, sweeper.n_trials = sweeper.n_trials, max(0, sweeper.n_trials - done)
            seed = sweeper.get("sampler", {}).get("seed")
            if done and seed is not None:  # new draws, still a pure function of (seed, trials done)
                sweeper.sampler.seed = seed + done
        log.info("optuna study %r in %s: %d of n_trials=%d done, %d to run (sampler seed %s)", sweeper.study_name,
                 storage, done, total, sweeper.n_trials, sweeper.get("sampler", {}).get("seed"))
