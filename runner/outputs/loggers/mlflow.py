"""MLflow (``logger=mlflow``): a database in the run directory (``<run dir>/mlflow.db``, artifacts
under ``<run dir>/mlruns``), or a shared store (``tracking_uri=http://host:5000``) to compare runs
in one UI. Through ``MlflowClient`` rather than mlflow's process-wide active run, so a run that
fails before it finishes leaves nothing behind for the next one in this process."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from runner.outputs.loggers import Logger
from runner.outputs.provenance import git_commit


def _local_sqlite(uri: str | None) -> bool:
    return uri is None or uri.startswith("sqlite:")


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        out: dict[str, Any] = {}
        for k, v in tree.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: tree}


def _param_value(value: Any, limit: int) -> str:
    """Config values as they would be written on the command line; too long → cut, marked."""
    text = value if isinstance(value, str) else json.dumps(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


class MLflowLogger(Logger):
    EXTRA = "mlflow"

    @staticmethod
    def requires(options) -> list[str]:
        # mlflow-skinny; its local store (sqlite) also needs sqlalchemy and alembic, a server does not.
        return ["mlflow", "sqlalchemy", "alembic"] if _local_sqlite(options.get("tracking_uri")) else ["mlflow"]

    def __init__(self, *, run_dir: Path, hparams: dict, name: str, group: str | None,
                 tracking_uri: str | None = None, experiment: str = "runner"):
        from mlflow.entities import Metric, Param  # optional extra: runner[mlflow]
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient
        from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH, MAX_PARAMS_TAGS_PER_BATCH

        self._metric = Metric
        local = tracking_uri is None
        if local:  # no server: a database in the run directory (mlflow 3 refuses a plain mlruns/)
            tracking_uri = f"sqlite:///{(run_dir / 'mlflow.db').resolve()}"
        self.client = MlflowClient(tracking_uri=tracking_uri)
        found = self.client.get_experiment_by_name(experiment)
        if found is not None:
            experiment_id = found.experiment_id
        else:
            artifacts = (run_dir / "mlruns").resolve().as_uri() if local else None
            try:
                experiment_id = self.client.create_experiment(experiment, artifact_location=artifacts)
            except MlflowException:  # another run sharing this store created it first
                found = self.client.get_experiment_by_name(experiment)
                if found is None:  # no: the store refused it for another reason
                    raise
                experiment_id = found.experiment_id
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

    def finish(self, final: dict[str, float], step: int, *, failed: bool, artifacts: list[Path]) -> None:
        self.log(final, step)
        for path in artifacts:
            self.client.log_artifact(self.run_id, str(path))
        self.client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")
