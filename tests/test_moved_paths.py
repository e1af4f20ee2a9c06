"""relayout: keep-file — the old import paths of issue #34's move, named on purpose.

Old runs keep working: the ``_target_``s that an older run's ``.hydra/config.yaml`` or Optuna sweep
directory names (conf/ and the schemas' defaults before runner/ became packages) resolve, through
small shims at the old paths, to the objects at the new ones; ``python -m runner.report`` is still
the command. In-process, no torch work."""

from __future__ import annotations

import importlib

import pytest
from hydra.utils import get_object

# Every _target_ of conf/ and of runner/config.py's defaults at 1ae84c8, and where each lives now.
OLD_TARGETS = {
    "runner.loggers.tensorboard.TensorBoardLogger": "runner.outputs.loggers.tensorboard.TensorBoardLogger",
    "runner.loggers.wandb.WandbLogger": "runner.outputs.loggers.wandb.WandbLogger",
    "runner.loggers.mlflow.MLflowLogger": "runner.outputs.loggers.mlflow.MLflowLogger",
    "runner.report.SweepReport": "runner.outputs.sweep_report.SweepReport",
    "runner.models.transformer": "runner.models.builtin.transformer",
    "runner.models.mlp": "runner.models.builtin.mlp",
    "runner.hf.causal_lm": "runner.models.hf.causal_lm",
    "runner.data.SyntheticData": "runner.data.datasets.SyntheticData",
    "runner.data.TextData": "runner.data.datasets.TextData",
    "runner.data.HFData": "runner.data.datasets.HFData",
    "runner.data.TokensData": "runner.data.datasets.TokensData",
    "runner.losses.cross_entropy": "runner.losses.cross_entropy",
    "runner.rundir.RunDirGuard": "runner.rundir.RunDirGuard",
    "runner.study.ResumeStudy": "runner.study.ResumeStudy",
}


@pytest.mark.parametrize("old", sorted(OLD_TARGETS))
def test_an_old_runs_target_resolves_to_the_object_at_its_new_path(old):
    assert get_object(old) is get_object(OLD_TARGETS[old])


def test_the_package_faces_answer_only_their_old_names():
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        importlib.import_module("runner.models").nope  # noqa: B018
    with pytest.raises(ImportError):
        get_object("runner.data.NopeData")


def test_python_m_runner_report_is_still_the_command(tmp_path, capsys):
    report = importlib.import_module("runner.report")
    assert report.main([str(tmp_path / "missing")]) == 2
    assert "usage: python -m runner.report" in capsys.readouterr().err
