"""Hydra multirun: sweeps with failing jobs, parallel jobs (joblib), every smoke config, a tiny
optuna study, and the SLURM rank mapping."""

from __future__ import annotations

import csv
import json
import os
import subprocess
from pathlib import Path

import pytest
import yaml
from hydra import compose as hydra_compose
from hydra import initialize_config_dir

from runner.errors import ConfigError
from runner.outputs import sweep_report as report
from runner.ranks.env import adopt_slurm_ranks, slurm_rank_env

from helpers.cli import run_cli
from helpers.config import ROOT

QUIET = ["profile.enabled=false"]


def _sweep(*args: str, cwd: Path, timeout: int = 240, sweep_dir: str = "sweep",
           env: dict | None = None) -> subprocess.CompletedProcess:
    return run_cli("-m", *args, *QUIET, f"hydra.sweep.dir={sweep_dir}", cwd=cwd, env=env, timeout=timeout)


def _rows(sweep: Path) -> list[dict]:
    with open(sweep / "sweep.csv") as f:
        return list(csv.DictReader(f))


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_a_sweep_runs_every_job_reports_each_and_fails_listing_the_failures(tmp_path):
    # m=3 does not divide the batch of 8: two of the four jobs are rejected before spawning.
    done = _sweep("experiment=smoke", "schedule=gpipe,zbv", "parallel.microbatches=4,3", cwd=tmp_path)
    assert done.returncode == 2
    assert "2 of 4 jobs failed or rejected" in done.stderr and "Traceback" not in done.stderr
    sweep = tmp_path / "sweep"
    rows = _rows(sweep)
    assert [(r["job"], r["status"]) for r in rows] == [("0", "ok"), ("1", "rejected"), ("2", "ok"), ("3", "rejected")]
    assert "schedule=zbv parallel.microbatches=3" in rows[3]["overrides"] and "train.batch_size=8" in rows[3]["error"]
    for row in (rows[0], rows[2]):
        summary = json.loads((sweep / row["job"] / "summary.json").read_text())
        assert float(row["tokens_per_s"]) == pytest.approx(summary["tokens_per_s"], rel=1e-3)
        assert float(row["final_loss"]) == pytest.approx(summary["final_loss"], abs=1e-5)
        assert 0 <= float(row["bubble"]) < 1 and float(row["peak_mem_mib"]) > 1
    assert "4 jobs, 2 ok, 2 rejected before launch, 0 failed" in (sweep / "sweep.md").read_text()
    assert (sweep / "sweep.png").read_bytes()[:4] == b"\x89PNG"
    (sweep / "sweep.md").unlink()
    assert report.main([str(sweep)]) == 1  # rebuilt by hand; non-zero: the sweep had failures
    assert (sweep / "sweep.md").is_file()


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_ranks_of_several_threads_start_after_the_launcher_or_an_earlier_job_computed(tmp_path):
    # OpenMP's thread team does not survive a fork: ranks of 2 threads hung in their first op when
    # forked from a launcher that had computed on 2 (its checks), and would after a pp=1 job that
    # trained in the sweep's process. Job 0 forks from a launcher kept on one thread; job 1 trains
    # here on 2; job 2 spawns, saying why.
    done = _sweep("experiment=smoke", "parallel.pp=2,1,2", "train.steps=2", "launch.threads_per_rank=2",
                  "launch.pin_cpus=false", "launch.timeout_s=60", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    sweep = tmp_path / "sweep"
    assert [r["status"] for r in _rows(sweep)] == ["ok", "ok", "ok"]
    logs = [(sweep / str(job) / "runner.log").read_text() for job in range(3)]
    assert "starting 2 rank processes (fork)" in logs[0]
    assert "starting 2 rank processes (spawn: this process ran torch on several threads" in logs[2]
    losses = [json.loads((sweep / str(job) / "summary.json").read_text())["losses"] for job in range(3)]
    assert losses[0] == pytest.approx(losses[2]) and len(losses[1]) == 2


@pytest.mark.multiprocess
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


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_every_experiment_config_runs(tmp_path):
    experiments = sorted(p.stem for p in (ROOT / "conf" / "experiment").glob("*.yaml"))
    done = _sweep("experiment=glob(*)", "train.steps=2", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    rows = _rows(tmp_path / "sweep")
    assert sorted(r["overrides"].split("=")[1].split()[0] for r in rows) == experiments
    assert all(r["status"] == "ok" for r in rows)
    sweep = (tmp_path / "sweep").resolve()  # where it is, said at the end
    assert done.stdout.splitlines()[-2:] == [f"sweep report  {sweep}/sweep.md (and sweep.csv, sweep.png)",
                                             f"job run dirs  {sweep}/<job number>/"], done.stdout


def test_the_shipped_optuna_search_tries_combinations_the_runner_runs():
    """Every schedule x microbatch count of conf/hparams_search/optuna.yaml passes the checks before
    launch on the default config, but for DualPipeV's at 2 microbatches (torch wants 2 x pp): a
    stages-per-rank axis there had most trials rejected (13 of 20) without running anything."""
    from omegaconf import OmegaConf

    from runner.pipeline.schedule import stage_layout
    from runner.validate import check_config

    space = yaml.safe_load((ROOT / "conf" / "hparams_search" / "optuna.yaml").read_text())["hydra"]["sweeper"]
    choices = {key: value.removeprefix("choice(").removesuffix(")").replace(" ", "").split(",")
               for key, value in space["params"].items()}
    assert sorted(choices) == ["parallel.microbatches", "schedule"]
    refused = []
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        for schedule in choices["schedule"]:
            cfg = hydra_compose("config", overrides=[f"schedule={schedule}"])
            for m in choices["parallel.microbatches"]:
                OmegaConf.update(cfg, "parallel.microbatches", int(m))
                try:  # the checks of the values, then torch's schedule rules (validate's, without the model)
                    check_config(cfg)
                    stage_layout(cfg.schedule.name, cfg.parallel, None, compiled=False)
                except ConfigError:
                    refused.append((schedule, int(m)))
    assert len(choices["schedule"]) * len(choices["parallel.microbatches"]) >= space["n_trials"]
    assert refused == [("dualpipev", 2)]


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_optuna_study_persists_resumes_up_to_n_trials_and_its_exit_status_says_trials_failed(tmp_path):
    # 4 samples a step: seed 0's second trial (looped_bfs, 8 microbatches) cannot split them, and is rejected.
    done = _sweep("hparams_search=optuna", "experiment=smoke", "train.batch_size=4", "hydra.sweeper.n_trials=3",
                  cwd=tmp_path)
    assert done.returncode == 0, done.stderr  # invalid combinations are no failure of the search
    rows = _rows(tmp_path / "sweep")
    assert [r["status"] for r in rows] == ["ok", "rejected", "ok"], rows
    assert "train.batch_size=4" in rows[1]["error"] and "parallel.microbatches=8" in rows[1]["overrides"]
    assert "1 of 3 jobs rejected" in done.stderr
    best = yaml.safe_load((tmp_path / "sweep" / "optimization_results.yaml").read_text())
    assert best["best_value"] == pytest.approx(max(float(r["tokens_per_s"]) for r in rows if r["status"] == "ok"),
                                               rel=1e-3)
    # Again, from the same directory: the same study, one trial to go of n_trials=4. It crashes
    # (an injected fault): the study goes on and ends, and the exit status says a trial failed.
    again = _sweep("hparams_search=optuna", "experiment=smoke", "hydra.sweeper.n_trials=4", cwd=tmp_path,
                   sweep_dir="sweep-again", env={"RUNNER_FAULT": "raise:1:2"})
    assert again.returncode == 3 and "1 of 1 jobs failed" in again.stderr and "injected fault" in again.stderr
    assert [r["status"] for r in _rows(tmp_path / "sweep-again")] == ["failed"]
    import optuna

    study = optuna.load_study(study_name="pipeline_schedule",
                              storage=f"sqlite:///{tmp_path / 'multirun' / 'studies' / 'pipeline_schedule.db'}")
    states = [t.state.name for t in study.trials]
    assert len(states) == 4 and states.count("COMPLETE") == 2 and states.count("FAIL") == 2
    # The sampler's seed moved on by the 3 trials done: the new trial is not trial 0's draw again.
    assert study.trials[3].params != study.trials[0].params, [t.params for t in study.trials]


def test_a_resumed_study_counts_its_finished_trials_and_draws_from_a_seed_moved_on_by_them(tmp_path):
    import optuna
    from omegaconf import OmegaConf

    from runner.study import ResumeStudy

    storage = f"sqlite:///{tmp_path / 'studies' / 'search.db'}"

    def start(seed):
        config = OmegaConf.create({"hydra": {"sweeper": {"storage": storage, "study_name": "search", "n_trials": 5,
                                                         "sampler": {"seed": seed}}}})
        ResumeStudy().on_multirun_start(config)
        return config.hydra.sweeper

    assert (start(0).n_trials, start(0).sampler.seed) == (5, 0)  # a new study: as configured
    study = optuna.create_study(study_name="search", storage=storage, direction="maximize")
    for value in (1.0, None):  # one complete, one failed: both finished
        trial = study.ask()
        study.tell(trial, value, state=optuna.trial.TrialState.COMPLETE if value else optuna.trial.TrialState.FAIL)
    study.ask()  # running (an invocation killed mid-trial): not finished
    assert (start(0).n_trials, start(0).sampler.seed) == (3, 2)
    assert start(None).sampler.seed is None  # unseeded: nothing to move on


RANK_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def test_srun_tasks_become_torch_ranks_with_the_first_host_as_slurm_expands_it(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scontrol = bin_dir / "scontrol"  # prints what SLURM's own expansion of the node list would
    scontrol.write_text('#!/bin/sh\necho "$@" > "$(dirname "$0")/asked"\n'
                        'printf "node001-ib\\nnode002-ib\\nnode003-ib\\nnode004-ib\\n"\n')
    scontrol.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    env = {"SLURM_NTASKS": "8", "SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_TASKS_PER_NODE": "3(x2),2",
           "SLURM_NODEID": "2", "SLURM_JOB_NODELIST": "node[001-004]-ib", "SLURM_JOB_ID": "123456"}
    assert slurm_rank_env(env) == {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                                   "MASTER_ADDR": "node001-ib", "MASTER_PORT": "23456"}
    assert (bin_dir / "asked").read_text().split() == ["show", "hostnames", "node[001-004]-ib"]
    assert slurm_rank_env({**env, "SLURM_NODEID": "1"})["LOCAL_WORLD_SIZE"] == "3"  # 3 tasks on nodes 0 and 1
    assert slurm_rank_env({**env, "MASTER_ADDR": "given"})["MASTER_ADDR"] == "given"
    assert slurm_rank_env({**env, "SLURM_NTASKS": "1"}) == {}  # one task: the runner spawns its ranks
    assert slurm_rank_env({**env, "RANK": "0"}) == {}  # torchrun inside SLURM wins
    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))  # outside an allocation: no scontrol
    with pytest.raises(ConfigError, match="scontrol show hostnames.*Fix: .*MASTER_ADDR"):
        slurm_rank_env(env)
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = hydra_compose("config", overrides=["hydra/launcher=runner_slurm", "parallel.pp=2", "parallel.dp=2"],
                            return_hydra_config=True)
    assert cfg.hydra.launcher.tasks_per_node == 4 and cfg.hydra.launcher.nodes == 1


def test_submitit_jobs_take_their_ranks_from_submitit_and_keep_cuda_visible_devices(tmp_path, monkeypatch):
    job = {"SUBMITIT_EXECUTOR": "slurm", "SLURM_JOB_ID": "77", "SLURM_NTASKS": "4", "SLURM_JOB_NUM_NODES": "2",
           "SLURM_NODEID": "1", "SLURM_JOB_NODELIST": "gpu[03-04]-ib", "SLURM_PROCID": "3", "SLURM_LOCALID": "1",
           "CUDA_VISIBLE_DEVICES": "0,1", "PATH": str(tmp_path)}  # no scontrol: submitit's own environment
    for key, value in job.items():
        monkeypatch.setenv(key, value)
    for key in RANK_VARS:  # set first, so that the test's end removes what adopt_slurm_ranks sets
        monkeypatch.setenv(key, "")
        monkeypatch.delenv(key)
    adopt_slurm_ranks()
    assert {k: os.environ[k] for k in RANK_VARS[:5]} == {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1",
                                                        "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "gpu03-ib"}
    assert 20000 <= int(os.environ["MASTER_PORT"]) <= 60000  # submitit's port for this job
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0,1"  # the runner picks each rank's GPU by LOCAL_RANK
