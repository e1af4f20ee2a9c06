"""The command line as users run it: a few real jobs, each a real multi-process run."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose as hydra_compose
from hydra import initialize_config_dir

from runner.launch import launch
from runner.outputs.provenance import git_commit

from helpers.cli import finish, run_cli, start_cli
from helpers.config import ROOT, TINY, compose
from helpers.profiled import check_profiled_run

WARNS = "+callbacks.warns._target_=helpers.hooks.LibraryWarning"  # a library's warnings.warn in every rank


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
def test_two_runs_started_together_both_train_and_write_every_output(tmp_path):
    # One forks its ranks (the default on CPU), one spawns fresh interpreters: the same run.
    # The spawned one also logs to MLflow: from rank 0 only, one run.
    procs = [start_cli("experiment=smoke", "verify=true", "launch.pin_cpus=true", *extra, cwd=tmp_path)
             for extra in ([], ["launch.start_method=spawn", "logger=mlflow", WARNS])]
    for done in [finish(p) for p in procs]:
        _check_console(done)
    run_dirs = sorted(tmp_path.glob("outputs/*/*"))
    assert len(run_dirs) == 2  # same second, distinct directories, no port to collide on
    for run_dir in run_dirs:
        _check_run_dir(run_dir)
    _check_the_two_differ_only_as_asked(run_dirs, tmp_path)
    check_profiled_run(run_dirs[0], pp=2, microbatches=4, active_steps=[2, 3, 4])
    plot = tmp_path / "timeline.png"
    run_cli(str(run_dirs[0]), "-o", str(plot), program=[sys.executable, "-m", "runner.outputs.plot_timeline"],
            cwd=tmp_path, timeout=60, check=True)
    assert plot.read_bytes()[:4] == b"\x89PNG"


def _check_console(done) -> None:
    """What a run prints: a line per step and per startup phase, where its outputs are, no noise."""
    out, err = done.stdout, done.stderr
    assert done.returncode == 0, err
    assert "throughput" in out
    assert re.search(r"^verify +passed \(gradients at most [0-9.e+-]+% of their tolerance, max abs grad diff ", out,
                     re.M), out
    # Not a terminal: a plain line per step (numbered from 1), printed by the launcher.
    assert [line.split(" - step ")[1].split()[0] for line in err.splitlines() if " - step " in line] == [
        "1/4", "2/4", "3/4", "4/4"]
    # While it starts, a line per phase (with the seconds since the launch); at the end, where things are.
    assert [re.sub(r" \([0-9.]+ s\)$", "", line.split("[runner.startup][INFO] - ")[1])
            for line in (out + err).splitlines() if "[runner.startup]" in line] == [  # launcher's, rank 0's
        "config checked", "data ready", "ranks started: 2 processes", "model built", "first step done"]
    run_dir = Path(re.search(r"^run dir +(\S+)$", out, re.M).group(1))
    for row in [f"summary      {run_dir}/summary.json, metrics.jsonl",
                f"traces       {run_dir}/timeline.json, traces/",
                f"pictures     {run_dir}/timeline.png, schedule.png"]:
        assert row in out.splitlines(), out
    assert (run_dir / "timeline.png").read_bytes()[:4] == b"\x89PNG"  # drawn by the run itself
    # Quiet: no library's INFO lines (MLflow's), progress bars or warnings on the console.
    for noise in ("INFO mlflow", "INFO alembic", "UserWarning", "font cache", "it/s]"):
        assert noise not in out + err, (noise, out, err)


def _check_run_dir(run_dir: Path) -> None:
    """One run's files: its summary, metrics, log, provenance and startup phases."""
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["schedule"] == "1f1b" and summary["pp"] == 2 and summary["dp"] == 1
    assert summary["microbatches"] == 4 and summary["steps"] == 4
    assert len(summary["losses"]) == 4 and summary["final_loss"] == summary["losses"][-1]
    assert summary["losses"][-1] < summary["losses"][0]
    assert summary["step_time_s"] > 0 and summary["tokens_per_s"] > 0 and summary["startup_s"] > 0
    assert len(summary["peak_mem_bytes"]) == 2 and min(summary["peak_mem_bytes"]) > 2**20
    assert summary["verify"]["passed"] and summary["verify"]["max_abs_diff"] < 4e-5
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2, 3, 4]  # numbered from 1, as in the log
    assert [m["loss"] for m in lines] == summary["losses"]
    assert all(m["lr"] > 0 and m["step_time_s"] > 0 and m["tokens_per_s"] > 0 for m in lines)
    assert (run_dir / ".hydra" / "config.yaml").is_file()
    log = (run_dir / "runner.log").read_text()
    assert "[rank 0][runner.train][INFO] - step 4/4" in log
    assert "[rank 1][runner.pipeline][INFO] - stage 1: " in log  # every rank's lines
    assert sorted(_cores_of_each_rank(log)) == sorted(_cores_given(log))  # launch.pin_cpus=true
    summary_provenance = {k: summary[k] for k in ("runner_version", "host", "torch_version", "hydra_version")}
    assert None not in summary_provenance.values() and summary["git_commit"] == git_commit()
    assert summary["device_names"][0].startswith("CPU") and len(summary["device_names"]) == 2
    assert (run_dir / "resolved_config.yaml").resolve() == Path(summary["config"])
    assert not list(run_dir.glob(".rendezvous*"))
    phases = summary["startup_phases_s"]
    assert list(phases) == ["compose", "imports", "validate", "spawn", "process_group", "build", "setup",
                            "first_step"]
    assert min(phases.values()) >= 0
    assert sum(phases.values()) - phases["first_step"] == pytest.approx(summary["startup_s"], abs=1e-3)


def _check_the_two_differ_only_as_asked(run_dirs: list[Path], tmp_path: Path) -> None:
    """Forked and spawned ranks train the same losses; only the spawned run warned (into its log)
    and logged to MLflow."""
    from mlflow.tracking import MlflowClient

    logs = [(d / "runner.log").read_text() for d in run_dirs]
    assert {re.search(r"starting 2 rank processes \((\w+)\)", log).group(1) for log in logs} == {"fork", "spawn"}
    warned = [log for log in logs if "UserWarning: a library's UserWarning on rank 0" in log]
    assert len(warned) == 1  # the library's warning is in the run's log file (it was not on the console)
    summaries = [json.loads((d / "summary.json").read_text()) for d in run_dirs]
    assert summaries[0]["losses"] == summaries[1]["losses"]
    [db] = tmp_path.glob("outputs/*/*/mlflow.db")
    client = MlflowClient(f"sqlite:///{db}")
    [run] = client.search_runs([client.get_experiment_by_name("runner").experiment_id])
    history = client.get_metric_history(run.info.run_id, "train/loss")
    assert [m.value for m in history] == pytest.approx(summaries[0]["losses"]) and run.info.status == "FINISHED"


@pytest.mark.multiprocess
@pytest.mark.timeout(90)
def test_unknown_options_exit_2_with_hydras_message_and_no_traceback(tmp_path):
    # Hydra's unknown option (an OSError inside Hydra), in a single run and in a sweep: exit 2 (a
    # configuration error), before anything runs; ours and Hydra's typos are in the test below.
    runs = {
        "option": (["schedule=nope"], ["Could not find 'schedule/nope'", "Available options in 'schedule'", "zbv"]),
        "sweep": (["-m", "experiment=smoke", "schedule=1f1b,nope", "hydra.sweep.dir=sweep"],
                  ["Could not find 'schedule/nope'", "1f1b"]),
    }
    procs = {name: start_cli(*args, cwd=tmp_path) for name, (args, _) in runs.items()}
    for name, proc in procs.items():
        done = finish(proc)
        rc, err = done.returncode, done.stderr
        assert rc == 2 and all(text in err for text in runs[name][1]), (name, rc, err)
        assert "Traceback" not in err and "cannot write the run directory" not in err, (name, err)
    assert not list(tmp_path.glob("outputs/*/*/metrics.jsonl")) and not list(tmp_path.glob("sweep/*/summary.json"))


def test_an_unknown_config_name_is_a_configuration_error():
    # `--config-name nope` raises the same Hydra error (also an OSError) at the same place as
    # `schedule=nope` above: exit 2 with Hydra's message, not "cannot write the run directory".
    from hydra.errors import MissingConfigException

    from runner.exits import outcome

    with pytest.raises(MissingConfigException) as info:
        with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
            hydra_compose(config_name="nope")
    code, message = outcome(info.value, started=False)
    assert code == 2 and "Cannot find primary config 'nope'" in message


def test_the_groups_options_are_the_yaml_files_only():
    """What --help and completion list of a group is the config store's and conf/'s options of that
    group: the schemas are stored outside every group (held through the CLI below)."""
    from hydra.core.config_store import ConfigStore

    from runner.compose import SCHEMAS, config_dir

    store = ConfigStore.instance()
    for group in {group for group, _ in SCHEMAS.values()}:
        assert sorted(store.list(group) if store.repo.get(group) else []) == [], group
        assert not [p for p in (config_dir() / group).glob("*.yaml") if p.stem.startswith(("base_", "schema_"))]
    assert not [name for name in store.list("") if name.startswith("base_") and name != "base_config.yaml"]


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_help_and_tab_completion_offer_no_internal_schema(tmp_path):
    """The schemas the group options extend (``runner.compose.SCHEMAS``) are no options: neither
    ``--help`` nor tab completion lists them (nor any ``base_*``), and every user-facing option is there."""
    from runner.compose import SCHEMAS

    internal = re.compile(r"\b(base_\w+|schema_\w+)")
    done = run_cli("--help", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    groups = done.stdout.split("== Config ==")[0]
    assert not internal.search(groups), groups
    assert "schedule: 1f1b, csv, dualpipev" in groups and "model: hf, mlp, transformer" in groups
    assert "data: hf, synthetic, text, tokens" in groups and "rehearse: on\n" in groups
    for line, expected in [("runner ", "schedule="), ("runner schedule=", "schedule=zbv"),
                           ("runner schedule=b", ""), ("runner model=", "model=transformer"),
                           ("runner data=", "data=tokens"), ("runner rehearse=", "rehearse=on"),
                           ("runner sch", "schedule=")]:
        done = run_cli("-sc", "query=bash", cwd=tmp_path, env={"COMP_LINE": line})
        assert done.returncode == 0, done.stderr
        offered = done.stdout.split()
        assert not any(internal.search(word) for word in offered), (line, offered)
        assert (expected in offered) if expected else offered == [], (line, offered)
    assert set(SCHEMAS) and all(name.startswith("schema_") for name in SCHEMAS)


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_config_errors_are_reported_before_torch_is_imported(tmp_path):
    """A misspelt key (Hydra), a value the runner does not know, a rejected combination: found
    before the heavy imports, so they are reported in a fraction of a second (the time is in
    BENCHMARKS.md, startup section)."""
    cases = ["trian.steps=5", "train.precision=fp16", "parallel.dp=2"]
    procs = {case: start_cli(case, cwd=tmp_path, env={"PYTHONPROFILEIMPORTTIME": "1"}) for case in cases}
    for case, proc in procs.items():
        done = finish(proc)
        rc, err = done.returncode, done.stderr
        imported = {line.rsplit("|", 1)[-1].strip() for line in err.splitlines() if line.startswith("import time:")}
        assert rc == 2 and case.split("=")[0] in err and "Traceback" not in err, err  # a configuration error
        assert case != "trian.steps=5" or "Did you mean train.steps" in err  # one round trip for a typo
        assert "hydra" in imported and not {"torch", "runner.launch", "runner.train"} & imported, case
    done = run_cli("experiment=smoke", "model=mlp", "model._target_=helpers.models.exploding_mlp", cwd=tmp_path,
                   timeout=80)
    rc, err = done.returncode, done.stderr
    assert rc == 3  # a failed run
    assert "rank 1 failed" in err and "Traceback" in err and "boom from the user's model" in err
    assert "runner: in pipeline stage(s) [1]" in err  # where in the pipeline it happened


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_torchrun_ranks_share_one_run_directory(tmp_path):
    done = run_cli("--standalone", "--nproc-per-node", "2", "-m", "runner", "experiment=smoke", cwd=tmp_path,
                   module="torch.distributed.run", timeout=110, check=True)
    run_dirs = list(tmp_path.glob("outputs/*/*"))
    assert len(run_dirs) == 1
    summary = json.loads((run_dirs[0] / "summary.json").read_text())
    assert summary["pp"] == 2 and len(summary["losses"]) == 4 and len(summary["peak_mem_bytes"]) == 2
    assert not list(tmp_path.glob("*.log"))  # rank 1 wrote no outputs of its own
    log = (run_dirs[0] / "runner.log").read_text()
    assert "[rank 1][runner.pipeline][INFO] - stage 1: " in log
    assert not _cores_of_each_rank(log)  # torchrun placed its ranks: the runner pins none
    for out in (log, done.stdout, done.stderr):  # each rank ended its groups' threads before exiting
        assert "still running after destroy_process_group" not in out and "terminate called" not in out


@pytest.mark.slow  # two torchrun jobs, four worker interpreters each: ~30 CPU-s
@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_a_job_torchrun_restarts_resumes_in_its_first_run_directory(tmp_path):
    # Rank 1 is killed as step 3 begins in the first attempt: torchrun (--max-restarts 1) restarts
    # both workers, which resume from checkpoints/step-2 of the first attempt's run directory (rank
    # 0 composes its config again: a new timestamped directory otherwise), and end with the losses
    # of the same job uninterrupted.
    (tmp_path / "restarted").mkdir()
    common = ("--standalone", "--nproc-per-node", "2")
    restarted = start_cli(*common, "--max-restarts", "1", "-m", "runner", "experiment=smoke", "checkpoint.every=2",
                          cwd=tmp_path / "restarted", module="torch.distributed.run",
                          env={"RUNNER_FAULT": "kill:1:3:0"})
    run_cli(*common, "-m", "runner", "experiment=smoke", cwd=tmp_path, module="torch.distributed.run", timeout=110,
            check=True)
    [run_dir] = list(tmp_path.glob("outputs/*/*"))
    summary = json.loads((run_dir / "summary.json").read_text())
    finish(restarted, timeout=200, check=True)
    [again] = list((tmp_path / "restarted").glob("outputs/*/*"))
    resumed = json.loads((again / "summary.json").read_text())
    assert resumed["first_step"] == 3 and resumed["losses"] == summary["losses"] and len(summary["losses"]) == 4
    assert "resumed from " + str(again / "checkpoints" / "step-2") in (again / "runner.log").read_text()
    assert not (again / "error.txt").exists()  # the first attempt's failure: not this run's outcome


def _cores_given(log: str) -> list[str]:
    """The cores the launcher gave the two ranks."""
    return list(re.search(r"ranks pinned to cores (\S+) \| (\S+)\)", log).groups())


def _cores_of_each_rank(log: str) -> list[str]:
    """The cores each rank found itself on (in the order the ranks logged them)."""
    return re.findall(r"\]\[INFO\] - on cores (\S+)", log)


def test_pp1_trains_the_unsplit_model_in_this_process_with_tensorboard_scalars(tmp_path):
    summary = launch(compose(*TINY, "parallel.pp=1", "parallel.microbatches=2", "train.batch_size=4",
                             "logger=tensorboard"), tmp_path)
    assert summary["pp"] == 1 and summary["num_stages"] == 1 and len(summary["losses"]) == 5
    assert summary["bubble"]["theoretical"] == 0 and (tmp_path / "schedule.csv").read_text() == "0F0,0B0,0F1,0B1\n"
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [e.value for e in events.Scalars("train/loss")] == pytest.approx(summary["losses"])
    assert {"train/lr", "train/tokens_per_s", "train/step_time_s", "pipeline/bubble"} <= set(events.Tags()["scalars"])


@pytest.mark.gpu
def test_cuda_run_matches_cpu(tmp_path):
    cpu = launch(compose(*TINY, "parallel.pp=1", "train.batch_size=8"), tmp_path / "cpu")
    cuda_cfg = compose(*TINY, "parallel.pp=1", "train.batch_size=8")
    cuda_cfg.device = "cuda"
    cuda = launch(cuda_cfg, tmp_path / "cuda")
    torch.testing.assert_close(torch.tensor(cuda["losses"]), torch.tensor(cpu["losses"]), rtol=1e-3, atol=1e-3)
    assert cuda["peak_mem_bytes"][0] > 0


# The CPU case keeps the GPU one from rotting between GPU runs.
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.timeout(120)
def test_verify_holds_a_run_on_its_device_to_the_unsplit_model_and_reruns_it_in_float64_on_the_host(
        device, tmp_path, monkeypatch):
    # verify=true at pp=1, in this process: the run on its device against the unsplit reference on rank
    # 0's CPU. Its first step is also held to exactness (tolerances 0) beside the real check, so that
    # on CUDA, whose kernels round otherwise than the CPU's, the float64 rerun (runner.verify.exact)
    # runs during a CUDA run: the rerun reproduces the reference's loss, and the real verdict passes.
    import runner.verify.hook as hook

    real, exactly = hook.compare, []

    def compare(got, ref, loss, ref_loss, *, rtol, atol, exact=None):
        if exact is not None and not exactly:  # the first step's (the rerun is cached: one for both)
            exactly.append(real(got, ref, loss, ref_loss, rtol=0.0, atol=0.0, exact=exact))
        return real(got, ref, loss, ref_loss, rtol=rtol, atol=atol, exact=exact)

    monkeypatch.setattr(hook, "compare", compare)
    summary = launch(compose(*TINY, f"device={device}", "parallel.pp=1", "parallel.microbatches=2",
                             "train.batch_size=8", "verify=true"), tmp_path)
    assert summary is not None and summary["verify"]["passed"] and len(exactly) == 1
    rounding = exactly[0]["rounding"]
    if device == "cuda":  # some value differs from the CPU's in its last bits
        assert rounding is not None and rounding["float64"] == "rerun", rounding
        assert rounding["admitted"] or rounding["beyond"]
    if rounding is not None:  # what the rerun found: figures, each at rounding scale
        assert rounding["float64"] == "rerun", rounding
        figures = [*rounding["admitted"].values(), *rounding["beyond"].values()]
        assert all(0 <= f["unsplit_off"] < 1e-3 and 0 < f["run_off"] < 1e-3 for f in figures), figures


def test_fork_asked_for_where_its_ranks_would_hang_is_refused_before_they_start(tmp_path, monkeypatch):
    import runner.ranks.processes as processes
    from runner.errors import ConfigError

    monkeypatch.setattr(processes, "_ran_threaded", [True])  # as after a sweep's in-process pp=1 job
    cfg = compose(*TINY, "launch.start_method=fork", "launch.threads_per_rank=2", "launch.pin_cpus=false")
    with pytest.raises(ConfigError, match=r"launch.start_method=fork: .* ranks of 2 threads would hang .* Fix: "
                                          r"launch.start_method=auto"):
        launch(cfg, tmp_path)  # no rank started: this test is not in the multiprocess tier (its check would fail it)


def test_ranks_are_forked_only_where_forking_is_safe(monkeypatch):
    import threading

    import runner.ranks.processes as launch_module

    alone = [threading.current_thread()]
    monkeypatch.setattr(launch_module.threading, "enumerate", lambda: alone)
    monkeypatch.setattr(launch_module.sys, "platform", "linux")
    assert launch_module.start_method("auto", "cpu") == "fork"
    assert launch_module.start_method("auto", "cuda") == "spawn"  # CUDA state does not survive a fork
    assert launch_module.start_method("spawn", "cpu") == "spawn"
    # OpenMP's team does not survive a fork: after torch ran on several threads here, ranks of
    # several threads (None: torch's default) spawn; single-threaded ones still fork.
    monkeypatch.setattr(launch_module, "_ran_threaded", [False])
    assert launch_module.start_method("auto", "cpu", threads=4) == "fork"  # this test runs on one thread
    monkeypatch.setattr(launch_module, "_ran_threaded", [True])
    assert [launch_module.start_method("auto", "cpu", threads=t) for t in (1, 4, None)] == ["fork", "spawn", "spawn"]
    assert "OpenMP" in launch_module.spawn_reason("cpu", threads=4)
    helper = threading.Thread(name="loky-helper")  # e.g. inside a joblib worker
    monkeypatch.setattr(launch_module.threading, "enumerate", lambda: [*alone, helper])
    assert launch_module.start_method("auto", "cpu") == "spawn"
    assert "loky-helper" in launch_module.spawn_reason("cpu")
    monkeypatch.setattr(launch_module.sys, "platform", "darwin")
    monkeypatch.setattr(launch_module.threading, "enumerate", lambda: alone)
    assert launch_module.start_method("auto", "cpu") == "spawn"
