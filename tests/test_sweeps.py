"""Hydra multirun: sweeps with failing jobs, parallel jobs (joblib), every smoke config, a tiny
optuna study, and the SLURM rank mapping."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hydra import compose as hydra_compose
from hydra import initialize_config_dir

from runner import report
from runner.launch import slurm_rank_env

from conftest import ROOT

QUIET = ["profile.enabled=false", "hydra.sweep.dir=sweep"]


def _sweep(*args: str, cwd: Path, timeout: int = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("HYDRA_FULL_ERROR", None)
    return subprocess.run([sys.executable, "-m", "runner", "-m", *args, *QUIET], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def _rows(sweep: Path) -> list[dict]:
    with open(sweep / "sweep.csv") as f:
        return list(csv.DictReader(f))


@pytest.mark.timeout(240)
def test_a_sweep_runs_every_job_reports_each_and_fails_listing_the_failures(tmp_path):
    # m=3 does not divide the batch of 8: two of the four jobs fail before spawning.
    done = _sweep("experiment=smoke", "schedule=gpipe,zbv", "parallel.microbatches=4,3", cwd=tmp_path)
    assert done.returncode == 2
    assert "2 of 4 jobs failed" in done.stderr and "Traceback" not in done.stderr
    sweep = tmp_path / "sweep"
    rows = _rows(sweep)
    assert [(r["job"], r["status"]) for r in rows] == [("0", "ok"), ("1", "failed"), ("2", "ok"), ("3", "failed")]
    assert "schedule=zbv parallel.microbatches=3" in rows[3]["overrides"] and "train.batch_size=8" in rows[3]["error"]
    for row in (rows[0], rows[2]):
        summary = json.loads((sweep / row["job"] / "summary.json").read_text())
        assert float(row["tokens_per_s"]) == pytest.approx(summary["tokens_per_s"], rel=1e-3)
        assert float(row["final_loss"]) == pytest.approx(summary["final_loss"], abs=1e-5)
        assert 0 <= float(row["bubble"]) < 1 and float(row["peak_mem_mib"]) > 1
    assert "4 jobs, 2 ok, 2 failed" in (sweep / "sweep.md").read_text()
    assert (sweep / "sweep.png").read_bytes()[:4] == b"\x89PNG"
    (sweep / "sweep.md").unlink()
    assert report.main([str(sweep)]) == 1  # rebuilt by hand; non-zero: the sweep had failures
    assert (sweep / "sweep.md").is_file()


@pytest.mark.timeout(240)
def test_joblib_runs_two_jobs_at_once_without_collisions(tmp_path):
    done = _sweep("experiment=smoke", "schedule=gpipe,1f1b", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2",
                  cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    rows = _rows(tmp_path / "sweep")
    assert [r["status"] for r in rows] == ["ok", "ok"]
    summaries = [json.loads((tmp_path / "sweep" / r["job"] / "summary.json").read_text()) for r in rows]
    assert max(s["started_at"] for s in summaries) < min(s["finished_at"] for s in summaries)  # overlapped
    assert summaries[0]["losses"] == summaries[1]["losses"]  # both computed the same training run


@pytest.mark.timeout(240)
def test_every_experiment_config_runs(tmp_path):
    experiments = sorted(p.stem for p in (ROOT / "conf" / "experiment").glob("*.yaml"))
    done = _sweep("experiment=glob(*)", "train.steps=2", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    rows = _rows(tmp_path / "sweep")
    assert sorted(r["overrides"].split("=")[1].split()[0] for r in rows) == experiments
    assert all(r["status"] == "ok" for r in rows)


@pytest.mark.timeout(240)
def test_optuna_study_survives_failed_trials_and_finds_the_fastest(tmp_path):
    done = _sweep("hparams_search=optuna", "experiment=smoke", "hydra.sweeper.n_trials=3", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    rows = _rows(tmp_path / "sweep")
    assert len(rows) == 3 and any(r["status"] == "failed" for r in rows)  # seed 0 draws an invalid trial
    best = yaml.safe_load((tmp_path / "sweep" / "optimization_results.yaml").read_text())
    assert best["best_value"] == pytest.approx(max(float(r["tokens_per_s"]) for r in rows if r["status"] == "ok"),
                                               rel=1e-3)


def test_slurm_tasks_become_torch_ranks():
    env = {"SLURM_NTASKS": "8", "SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_TASKS_PER_NODE": "4(x2)",
           "SLURM_JOB_NODELIST": "gpu[03-05,09],cpu1", "SLURM_JOB_ID": "123456"}
    assert slurm_rank_env(env) == {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
                                   "MASTER_ADDR": "gpu03", "MASTER_PORT": "23456"}
    assert slurm_rank_env({**env, "SLURM_JOB_NODELIST": "node7"})["MASTER_ADDR"] == "node7"
    assert slurm_rank_env({**env, "SLURM_NTASKS": "1"}) == {}  # one task: the runner spawns its ranks
    assert slurm_rank_env({**env, "RANK": "0"}) == {}  # torchrun inside SLURM wins
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = hydra_compose("config", overrides=["hydra/launcher=runner_slurm", "parallel.pp=2", "parallel.dp=2"],
                            return_hydra_config=True)
    assert cfg.hydra.launcher.tasks_per_node == 4 and cfg.hydra.launcher.nodes == 1
