"""The optional loggers (TensorBoard, W&B offline, MLflow local), driven in-process through
``MetricsWriter`` and read back from what each one wrote; and their pre-spawn checks."""

from __future__ import annotations

import importlib.util
import json
import os
import socket
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from runner.errors import ConfigError
from runner.outputs.metrics import MetricsWriter
from runner.outputs.provenance import git_commit
from runner.validate import validate

from helpers.config import TINY, compose

pytestmark = pytest.mark.timeout(120)

RECORDS = [
    {"step": 0, "loss": 3.5, "lr": 1e-3, "grad_norm": 2.0, "step_time_s": 0.5, "tokens_per_s": 100.0},
    {"step": 1, "loss": 3.0, "lr": 2e-3, "grad_norm": 1.5, "step_time_s": 0.4, "tokens_per_s": 125.0},
    {"step": 2, "loss": 2.5, "lr": 3e-3, "grad_norm": 1.0, "step_time_s": 0.4, "tokens_per_s": 125.0,
     "val_loss": 2.75},
]
BUBBLE = {"mean": 0.25, "theoretical": 0.2, "theoretical_source": "test"}


def _run(run_dir: Path, *overrides: str, run_config=None, artifacts: list[Path] = ()) -> None:
    cfg = compose(*TINY, *overrides)
    writer = MetricsWriter(run_dir, run_config=cfg if run_config is None else run_config)
    for record in RECORDS:
        writer.write(record)
    writer.close(BUBBLE, artifacts=artifacts)
    assert [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()] == RECORDS


@pytest.fixture
def no_network(monkeypatch):
    """Fail any attempt from this process to resolve or reach a non-loopback address."""
    local = {"localhost", "127.0.0.1", "::1", None}
    real_getaddrinfo, real_connect = socket.getaddrinfo, socket.socket.connect

    def getaddrinfo(host, *args, **kwargs):
        if host not in local:
            raise AssertionError(f"network lookup of {host!r}")
        return real_getaddrinfo(host, *args, **kwargs)

    def connect(sock, address):
        if sock.family in (socket.AF_INET, socket.AF_INET6) and address[0] not in local:
            raise AssertionError(f"network connection to {address!r}")
        return real_connect(sock, address)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    monkeypatch.setattr(socket.socket, "connect", connect)


def test_tensorboard_logs_every_numeric_key_and_val_loss(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _run(tmp_path, "logger=tensorboard")
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [(0, 3.5), (1, 3.0), (2, 2.5)]
    assert [(e.step, e.value) for e in events.Scalars("val/loss")] == [(2, 2.75)]
    assert [e.value for e in events.Scalars("train/grad_norm")] == [2.0, 1.5, 1.0]
    assert [(e.step, e.value) for e in events.Scalars("pipeline/bubble")] == [(2, 0.25)]


def test_mlflow_local_store_holds_metrics_params_and_run(tmp_path, no_network):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient
    from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH

    cfg = compose(*TINY, "logger=mlflow")
    run_config = {**OmegaConf.to_container(cfg, resolve=True), "note": "x" * (MAX_PARAM_VAL_LENGTH + 50),
                  "many": {f"k{i}": i for i in range(150)}}  # > 100 params: logged in batches
    (tmp_path / "summary.json").write_text('{"final_loss": 2.5}')
    (tmp_path / "schedule.png").write_bytes(b"\x89PNG")
    _run(tmp_path, "logger=mlflow", run_config=run_config,
         artifacts=[tmp_path / "summary.json", tmp_path / "schedule.png"])

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("runner")
    assert experiment.artifact_location == (tmp_path / "mlruns").resolve().as_uri()
    [run] = client.search_runs([experiment.experiment_id])
    assert run.info.run_name == tmp_path.name and run.info.status == "FINISHED"
    history = client.get_metric_history(run.info.run_id, "train/loss")
    assert [(m.step, m.value) for m in history] == [(0, 3.5), (1, 3.0), (2, 2.5)]
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "val/loss")] == [(2, 2.75)]
    assert run.data.metrics["pipeline/bubble"] == 0.25 and run.data.metrics["train/tokens_per_s"] == 125.0
    params = run.data.params
    assert params["parallel.pp"] == "2" and params["train.betas"] == "[0.9, 0.95]"
    assert params["parallel.split_points"] == "null" and params["model.dim"] == "32"
    assert len(params["note"]) == MAX_PARAM_VAL_LENGTH and params["note"].endswith("...")
    assert params["many.k149"] == "149"
    # The code version as MLflow's own tag (the tests run from a checkout), and the files.
    assert run.data.tags["mlflow.source.git.commit"] == git_commit() and len(git_commit()) >= 40
    assert sorted(a.path for a in client.list_artifacts(run.info.run_id)) == ["schedule.png", "summary.json"]
    [stored] = (tmp_path / "mlruns").glob("*/artifacts/summary.json")
    assert stored.read_text() == '{"final_loss": 2.5}'


def test_a_failed_run_is_marked_failed_in_mlflow(tmp_path, no_network):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    writer = MetricsWriter(tmp_path, run_config=compose(*TINY, "logger=mlflow"))
    writer.write(RECORDS[0])
    writer.close(failed=True)  # what train() does when a step raises
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    [run] = client.search_runs([client.get_experiment_by_name("runner").experiment_id])
    assert run.info.status == "FAILED" and run.data.metrics["train/loss"] == 3.5


def _wandb_records(path: Path):
    """The records of a ``.wandb`` transaction log: a 7-byte header, then leveldb-log framing
    (32 KiB blocks; each chunk: crc32, 2-byte length, type full/first/middle/last)."""
    from wandb.proto import wandb_internal_pb2

    data, block, pos, pending = path.read_bytes(), 32768, 7, b""
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # too little left in the block for a header: padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # full, last
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def _items(items) -> dict:
    return {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in items}


@pytest.fixture
def wandb_quiet(monkeypatch, tmp_path):
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONSOLE", "off")  # no stdout/stderr wrapping inside pytest
    monkeypatch.setenv("WANDB__DISABLE_STATS", "true")  # no system-metrics sampler
    monkeypatch.setenv("WANDB_DISABLE_GIT", "true")
    monkeypatch.setenv("WANDB_DISABLE_CODE", "true")
    for var in ("WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):  # nothing under ~
        monkeypatch.setenv(var, str(tmp_path / "wandb-home" / var))
    # WANDB_CACHE_DIR is the logger's to set (the service's debug log): were it not, the user's cache
    # directory (~/.cache, as XDG_CACHE_HOME says) would get the log; here a directory of the test's.
    monkeypatch.delenv("WANDB_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "wandb-home" / "xdg-cache"))
    for var in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_BASE_URL"):
        monkeypatch.delenv(var, raising=False)
    had_service = "WANDB_SERVICE" in os.environ
    yield wandb
    wandb.teardown()  # stop the service process this test started
    if not had_service:
        os.environ.pop("WANDB_SERVICE", None)  # set by wandb; later tests' ranks must not inherit it


def test_wandb_offline_run_holds_history_summary_and_config(tmp_path, wandb_quiet, no_network, monkeypatch):
    run_dir = tmp_path / "multirun" / "2026-01-01" / "12-00-00" / "3"  # job 3 of a sweep
    (run_dir / ".hydra").mkdir(parents=True)
    (run_dir / ".hydra" / "overrides.yaml").write_text("- schedule=zbv\n- parallel.microbatches=8\n")
    monkeypatch.setenv("RUNNER_SWEEP_DIR", str(run_dir.parent))  # what the sweep callback exports
    _run(run_dir, "logger=wandb")
    # wandb's telemetry follows the process-wide mode: offline, it never starts (nor phones home at exit).
    from wandb.analytics.opentelemetry.opentelemetry_proxy import get_open_telemetry_proxy

    assert get_open_telemetry_proxy() is None
    wandb_quiet.teardown()  # finish() can return before wandb's service has flushed the run file
    # wandb's service wrote its debug log into the run directory, not the user's cache; the
    # process's environment is as it was.
    [core_log] = (run_dir / "wandb" / "cache").rglob("core-debug-*.log")
    assert core_log.stat().st_size > 0
    assert not list((tmp_path / "wandb-home" / "xdg-cache").rglob("*.log")) and "WANDB_CACHE_DIR" not in os.environ

    [offline] = (run_dir / "wandb").glob("offline-run-*")
    [log] = offline.glob("run-*.wandb")
    records = list(_wandb_records(log))
    [run] = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert run.display_name == "schedule=zbv parallel.microbatches=8" and run.project == "runner"
    assert run.run_group == "2026-01-01/12-00-00"  # the sweep's jobs together
    assert _items(run.config.update)["parallel"]["pp"] == 2
    history = [_items(r.history.item) for r in records if r.WhichOneof("record_type") == "history"]
    assert [(h["_step"], h["train/loss"]) for h in history] == [(0, 3.5), (1, 3.0), (2, 2.5)]
    assert [h.get("val/loss") for h in history] == [None, None, 2.75]
    summary: dict = {}
    for r in records:
        if r.WhichOneof("record_type") == "summary":
            summary.update(_items(r.summary.update))
    assert summary["train/loss"] == 2.5 and summary["val/loss"] == 2.75 and summary["pipeline/bubble"] == 0.25
    summary_file = offline / "files" / "wandb-summary.json"
    if summary_file.exists():  # wandb 0.31 writes it only when syncing; older versions offline too
        written = json.loads(summary_file.read_text())
        assert written["train/loss"] == 2.5 and written["pipeline/bubble"] == 0.25


@pytest.mark.parametrize("overrides, package", [
    (["logger=wandb"], "wandb"),
    (["logger=mlflow"], "mlflow"),
    (["logger=mlflow"], "sqlalchemy"),  # the local sqlite store's driver
    (["logger=tensorboard"], "tensorboard"),
    (["logger=[tensorboard,mlflow]"], "mlflow"),
])
def test_missing_logger_package_fails_before_spawn_naming_key_and_fix(monkeypatch, overrides, package):
    cfg = compose(*TINY, *overrides)
    name = package if package in ("wandb", "mlflow", "tensorboard") else "mlflow"
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == package else real(name, *a))
    with pytest.raises(ConfigError) as e:
        validate(cfg)
    message = str(e.value)
    assert f"logger={name} needs {package} (not installed)" in message
    assert "pip install" in message and f"leave {name} out of logger" in message


def test_mlflow_server_uri_needs_no_sqlite_driver(monkeypatch):
    pytest.importorskip("mlflow")
    cfg = compose(*TINY, "logger=mlflow", "logger.mlflow.tracking_uri=http://mlflow.example:5000")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "sqlalchemy" else real(name, *a))
    validate(cfg)


def test_bad_wandb_mode_fails_before_spawn():
    with pytest.raises(ConfigError, match=r"logger.wandb.mode='onlin' is not one of offline, online, disabled"):
        validate(compose(*TINY, "logger=wandb", "logger.wandb.mode=onlin"))


@pytest.mark.parametrize("override, fix", [
    ("logging.wandb=true", "Fix: logger=wandb"),
    ("logging.tensorboard=true", "Fix: logger=tensorboard"),
    ("logging.mlflow=true", "Fix: logger=mlflow"),
    ("logging.wandb=false", "Fix: leave logging.wandb out"),
    ("logging.wandb_mode=online", "Fix: logger=wandb logger.wandb.mode=online"),
    ("logging.wandb_project=p", "Fix: logger=wandb logger.wandb.project=p"),
    ("logging.mlflow_tracking_uri=http://h:5000", "Fix: logger=mlflow logger.mlflow.tracking_uri=http://h:5000"),
    ("logging.mlflow_experiment=e", "Fix: logger=mlflow logger.mlflow.experiment=e"),
])
def test_the_older_logging_spelling_is_refused_with_the_group_as_the_fix(override, fix):
    """One way to turn on each logger: ``logging.<name>=true`` and its options name the key, the
    value and the ``logger`` group's spelling."""
    with pytest.raises(ConfigError) as e:
        validate(compose(*TINY, override))
    assert str(e.value).startswith(f"{override} is no longer read") and fix in str(e.value)
    assert compose(*TINY).logging.wandb is None  # unset by default: nothing to refuse


def test_loggers_compose_as_a_group_of_targets(tmp_path, monkeypatch):
    pytest.importorskip("tensorboard")
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = compose(*TINY, "logger=[tensorboard,mlflow]", "logger.mlflow.experiment=grouped")
    assert cfg.logger.mlflow._target_ == "runner.outputs.loggers.mlflow.MLflowLogger"
    writer = MetricsWriter(tmp_path, run_config=cfg)
    assert [type(logger).__name__ for logger in writer.loggers] == ["TensorBoardLogger", "MLflowLogger"]
    for record in RECORDS:
        writer.write(record)
    writer.close(BUBBLE)
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [e.value for e in events.Scalars("train/loss")] == [3.5, 3.0, 2.5]
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    [run] = client.search_runs([client.get_experiment_by_name("grouped").experiment_id])
    assert run.data.metrics["val/loss"] == 2.75
    # The group spelling's checks name its own keys.
    with pytest.raises(ConfigError, match=r"logger.wandb.mode='onlin' is not one of offline, online, disabled"):
        validate(compose(*TINY, "logger=wandb", "logger.wandb.mode=onlin"))
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError, match=r"logger=wandb needs wandb \(not installed\).*leave wandb out of logger"):
        validate(compose(*TINY, "logger=wandb"))
