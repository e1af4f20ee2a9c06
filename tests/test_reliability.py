"""What happens when things go wrong at run time: every fault ends the whole job in bounded time,
names the rank, shows the root cause, and leaves no process and no half-written file behind."""

from __future__ import annotations

import ipaddress
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from conftest import ROOT, TINY

TESTS = Path(__file__).parent
RUN = [*TINY, "parallel.pp=2", "parallel.microbatches=4", "train.batch_size=8", "launch.timeout_s=10",
       "launch.grace_s=5"]


def _start(*args: str, run_dir: Path, fault: str | None = None) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), str(ROOT)])}
    env.pop("RUNNER_FAULT", None)
    if fault:
        env["RUNNER_FAULT"] = fault
    return subprocess.Popen([sys.executable, "-m", "runner", *RUN, *args, f"hydra.run.dir={run_dir}"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _rank_processes(run_dir: Path, launcher: subprocess.Popen) -> list[psutil.Process]:
    """Live rank processes of this job, forked or spawned, orphaned or not: every process but the
    launcher that holds the run's runner.log open (each rank logs there)."""
    log_file = str(run_dir / "runner.log")
    found = []
    for proc in psutil.process_iter():
        try:
            if (proc.pid != launcher.pid and proc.status() != psutil.STATUS_ZOMBIE
                    and any(f.path == log_file for f in proc.open_files())):
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return found


def _metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fault,failing_rank,symptom", [
    ("raise:1:3", 1, "injected fault on rank 1 at step 3"),  # steps are numbered from 1
    ("kill:1:3", 1, "SIGKILL"),
    ("stall:1:3", 0, "timed out|Timeout|timeout"),  # rank 1 sleeps: rank 0's collective times out
])
def test_a_failing_rank_ends_the_job_in_bounded_time(tmp_path, fault, failing_rank, symptom):
    run_dir = tmp_path / "run"
    proc = _start("train.steps=50", run_dir=run_dir, fault=fault)
    _, err = proc.communicate(timeout=100)
    assert proc.returncode == 2, err
    assert f"rank {failing_rank}" in err and re.search(symptom, err), err
    if fault.startswith("raise"):
        assert "Traceback" in err  # the root cause, with its traceback
    assert [m["step"] for m in _metrics(run_dir)] == [1, 2]
    deadline = time.monotonic() + 10
    while _rank_processes(run_dir, proc) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _rank_processes(run_dir, proc), "no rank may outlive the job"


@pytest.mark.timeout(120)
def test_non_finite_loss_stops_every_rank_at_the_same_step_without_a_later_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    proc = _start("train.steps=50", "checkpoint.every=1", "checkpoint.keep=5", "logging.mlflow=true",
                  run_dir=run_dir, fault="nan:1:3")
    _, err = proc.communicate(timeout=100)
    assert proc.returncode == 2 and "non-finite loss at step 3" in err, err
    assert [m["step"] for m in _metrics(run_dir)] == [1, 2]
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("step-*")) == ["step-1", "step-2"]
    from mlflow.tracking import MlflowClient  # the logger's run is marked failed, not left running

    client = MlflowClient(f"sqlite:///{run_dir / 'mlflow.db'}")
    [run] = client.search_runs([client.get_experiment_by_name("runner").experiment_id])
    assert run.info.status == "FAILED" and len(client.get_metric_history(run.info.run_id, "train/loss")) == 2


@pytest.mark.timeout(150)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_the_launcher_stops_every_rank_and_leaves_whole_files(tmp_path, sig):
    run_dir = tmp_path / "run"
    proc = _start("train.steps=100000", "profile.enabled=true", run_dir=run_dir)
    try:
        deadline = time.monotonic() + 90
        while len(_metrics(run_dir)) < 8 and time.monotonic() < deadline:  # past the profiled steps
            time.sleep(0.2)
        ranks = _rank_processes(run_dir, proc)
        assert len(ranks) == 2
        # A single-host job listens on loopback only (no TCP store; gloo bound to lo).
        listening = [c.laddr for r in ranks for c in r.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]
        assert all(ipaddress.ip_address(a.ip).is_loopback for a in listening), listening
        sent = time.monotonic()
        proc.send_signal(sig)
        proc.communicate(timeout=60)
    finally:  # a failed assertion must not leave a 100000-step job running
        if proc.poll() is None:
            proc.kill()
        for rank in _rank_processes(run_dir, proc):
            rank.kill()
    assert proc.returncode == 128 + sig
    assert time.monotonic() - sent < 5 + 10  # launch.grace_s plus slack
    assert not _rank_processes(run_dir, proc)
    assert len(_metrics(run_dir)) >= 8  # every line parses
    for trace in (run_dir / "traces").glob("*.json"):
        json.loads(trace.read_text())  # whole, or not there at all
    assert not list((run_dir / "traces").glob("*.partial"))


@pytest.mark.timeout(60)
def test_bad_output_dir_and_taken_port_are_refused_before_any_rank_starts(tmp_path):
    proc = _start(run_dir=Path("/proc/runner-test/run"))
    _, err = proc.communicate(timeout=50)
    assert proc.returncode == 2 and "hydra.run.dir" in err and "Traceback" not in err
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = _start(f"launch.port={port}", run_dir=tmp_path / "run")
        _, err = proc.communicate(timeout=50)
    assert proc.returncode == 2 and f"launch.port={port}" in err and "Traceback" not in err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_every_torch_load_is_weights_only():
    for path in (ROOT / "runner").glob("*.py"):
        for call in re.findall(r"torch\.load\([^)]*\)", path.read_text()):
            assert "weights_only=True" in call, f"{path.name}: {call}"
