"""The Python API (``runner.run``, ``runner.api``): the command line's config, checks, run directory
and launcher, from this process; errors raised, never exit codes. And the config's ``callbacks``
(``runner.callbacks``): the user's hooks on every rank, refused before launch when they cannot run."""

from __future__ import annotations

import json
import math
import os
import re
import resource
import sys
import threading
from pathlib import Path

import pytest
import torch
import yaml

import runner
import runner.api
from runner.errors import ConfigError

from helpers.cli import run_cli
from helpers.config import ROOT, TINY

ONE = [*TINY, "parallel.pp=1", "parallel.microbatches=2", "train.batch_size=4", "train.steps=3"]
RECORDER = "+callbacks.seen._target_=helpers.hooks.step_recorder"


@pytest.mark.multiprocess
@pytest.mark.timeout(90)
def test_import_runner_stays_light_until_run_is_called():
    code = ("import sys, runner; assert 'torch' not in sys.modules and 'hydra' not in sys.modules; "
            "run, plan = runner.run, runner.plan; assert 'torch' not in sys.modules and callable(plan); "
            "print(run.__module__, plan.__name__)")
    done = run_cli(program=[sys.executable, "-c", code], cwd=ROOT, timeout=60, check=True)
    assert done.stdout.strip() == "runner.api runner.plan" and runner.run is runner.api.run


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_plan_from_a_plain_python_process_returns_the_plan_and_prints_where_it_is(tmp_path):
    costs = tmp_path / "costs.yaml"  # a plan from a user's costs: no probe runs
    costs.write_text(yaml.safe_dump({"pp": 2, "microbatches": 4, "F": 1.0e-3, "B": 2.0e-3, "W": 1.0e-3,
                                     "comm_s": 1.0e-4, "weight_grad_fraction": 0.4, "memory_limit": "1f1b"}))
    code = ("import json, sys, runner; "
            f"result = runner.plan(['plan.costs={costs}', 'plan.search_budget=50'], plan_dir='planned'); "
            "print(json.dumps(result), file=sys.stderr)")
    done = run_cli(program=[sys.executable, "-c", code], cwd=tmp_path, timeout=100, check=True)
    result = json.loads(done.stderr.strip().splitlines()[-1])
    plan_dir = tmp_path / "planned"
    assert result["plan_dir"] == str(plan_dir) and result["candidates"] == json.loads(
        (plan_dir / "plan.json").read_text())
    [recommended] = [c for c in result["candidates"] if c["recommended"]]
    assert result["recommended"] == recommended and result["command"].startswith("python -m runner ")
    lines = done.stdout.splitlines()  # what python -m runner.plan prints, then where it is
    assert f"best: {result['command']}" in lines or f"best (tied): {result['command']}" in lines
    assert lines[-2:] == [f"plan dir  {plan_dir}",
                          "files     plan.json, synthesized_pp2_m4_loop1.csv, plan_timeline.json"]
    assert (plan_dir / "synthesized_pp2_m4_loop1.csv").is_file()  # the searched order, as the line says


def test_a_one_rank_run_in_process_returns_its_summary_run_dir_and_the_callbacks_steps(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the run directory is named as the command line's: outputs/<date>/<time>
    summary = runner.run([*ONE, RECORDER, "+callbacks.seen.key=recorded"])
    run_dir = Path(summary["run_dir"])
    assert run_dir.is_absolute() and run_dir.parent.parent == tmp_path / "outputs"
    assert re.fullmatch(r"\d{4}-\d\d-\d\d/\d\d-\d\d-\d\d-\d{6}", f"{run_dir.parent.name}/{run_dir.name}")
    assert summary["steps"] == 3 and summary["recorded"] == {"rank": 0, "steps": [1, 2, 3]}
    on_disk = json.loads((run_dir / "summary.json").read_text())
    assert on_disk["recorded"] == summary["recorded"] and "run_dir" not in on_disk
    assert yaml.safe_load((run_dir / ".hydra" / "overrides.yaml").read_text())[-1] == "+callbacks.seen.key=recorded"
    assert (run_dir / ".hydra" / "config.yaml").is_file() and "run directory" in (run_dir / "runner.log").read_text()


@pytest.mark.timeout(60)
def test_a_run_in_process_leaves_the_callers_random_draws_as_they_were(tmp_path):
    # The run seeds its own generators (train.seed) and its checks draw: the caller's next draws were
    # those of the run's seed, the same after every run (a sweep drawing its trials' values between
    # runs drew one value).
    torch.manual_seed(7)
    expected = torch.rand(4)
    torch.manual_seed(7)
    runner.run(ONE, run_dir=tmp_path / "run")
    assert torch.equal(torch.rand(4), expected)


@pytest.mark.timeout(60)
def test_a_run_that_fails_in_its_profile_window_stops_torchs_profiler_and_writes_no_trace(tmp_path):
    # torch's profiler is the process's: left on by the failed run, it recorded every op after it
    # (the caller's and the next runs': twice as slow, its memory growing without end).
    overrides = [*ONE, "train.steps=5", "profile.enabled=true", "+callbacks.fail._target_=helpers.hooks.fails_at",
                 "+callbacks.fail.step=4"]  # the window: step 1 skipped, 2 warm-up, 3-5 recorded
    with pytest.raises(RuntimeError, match="a user's hook failed at step 4"):
        runner.run(overrides, run_dir=tmp_path / "run")
    assert not torch.autograd.profiler._is_profiler_enabled and not torch._C._autograd._profiler_enabled()
    assert not list((tmp_path / "run").glob("traces/*")), "a half window's trace"
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines if "step" in r] == [1, 2, 3]  # step 4 failed before its record


@pytest.mark.timeout(60)
def test_a_run_that_fails_with_a_save_in_the_background_leaves_no_thread_and_its_checkpoints_whole(tmp_path):
    # While the failure is held (a notebook keeps the last one), the save thread stayed, and every
    # later launch of several ranks from this process spawned them (a thread in the launcher)
    # instead of forking; a save in flight went on after the run had raised.
    overrides = [*ONE, "train.steps=4", "checkpoint.every=1", "checkpoint.async_save=true",
                 "+callbacks.fail._target_=helpers.hooks.fails_at", "+callbacks.fail.step=3"]
    with pytest.raises(RuntimeError, match="a user's hook failed at step 3") as failed:
        runner.run(overrides, run_dir=tmp_path / "run")
    assert not [t.name for t in threading.enumerate() if t.name.startswith("checkpoint-commit")]
    saved = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())
    assert saved == ["step-1", "step-2"], saved  # step 2's save, in flight as step 3 failed, committed
    assert failed.value.__traceback__ is not None  # held to here, as a notebook holds it


@pytest.mark.timeout(60)
def test_ctrl_c_during_a_run_in_process_raises_keyboard_interrupt_not_an_exit(tmp_path):
    # The launcher's handler ended the run with SystemExit(130): a library call exiting the
    # caller's interpreter (a notebook's kernel reported a SystemExit). Now Python's own exception.
    overrides = [*ONE, "train.steps=5", "+callbacks.stop._target_=helpers.hooks.interrupts_at",
                 "+callbacks.stop.step=2"]
    with pytest.raises(KeyboardInterrupt):
        runner.run(overrides, run_dir=tmp_path / "run")
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines if "step" in r] in ([1], [1, 2])  # ended as step 2 did (every line whole)
    runner.run(ONE, run_dir=tmp_path / "again")  # the handlers are the caller's again: a run after it runs


@pytest.mark.timeout(60)
def test_a_run_in_process_leaves_no_progress_monitor_thread_so_later_launches_fork(tmp_path):
    # torch.compile's progress bars (a Hugging Face model's, datasets') start tqdm's monitor thread,
    # which outlives them: with it running, every later launch of several ranks spawned them.
    from tqdm import tqdm
    from tqdm.std import TMonitor

    with open(os.devnull, "w") as sink, tqdm(total=1, file=sink) as bar:  # as a library's bar does
        bar.update()
    assert any(isinstance(t, TMonitor) for t in threading.enumerate())
    runner.run(ONE, run_dir=tmp_path / "run")
    assert not [t.name for t in threading.enumerate() if isinstance(t, TMonitor)]


@pytest.mark.timeout(120)
def test_compiled_runs_in_one_process_each_compile_as_a_fresh_process_would(tmp_path, monkeypatch):
    # torch.compile keeps a model forward's programs for the process's life and stops compiling it
    # after recompile_limit (8) of them: the ninth compiled run of a sweep over shapes ran eagerly.
    # Here the limit is 1 (a recompile fails) and Dynamo hands its graphs to the eager backend (fast).
    compile_module = torch.nn.Module.compile
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self: compile_module(self, backend="eager"))
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 1)
    monkeypatch.setattr(torch._dynamo.config, "fail_on_recompile_limit_hit", True)
    overrides = [*ONE, "model.n_layers=1", "train.steps=1", "train.compile=true"]
    for seq_len in (8, 12):  # the position embedding's shape differs: its forward's guard fails
        summary = runner.run([*overrides, f"train.seq_len={seq_len}"], run_dir=tmp_path / f"seq{seq_len}")
        assert summary["steps"] == 1 and math.isfinite(summary["final_loss"])



@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the resident set's peak is reset on Linux")
@pytest.mark.timeout(60)
def test_a_run_in_process_reports_its_own_peak_memory_not_what_the_process_held_before(tmp_path):
    # A sweep's one-rank jobs run in one process (Hydra's basic launcher), as runner.run twice does:
    # each job's peak_mem_bytes was the process's lifetime high-water mark, an earlier job's peak.
    blob = b"\x01" * (1 << 30)  # 1 GiB resident, then freed: the process's peak, not the run's
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    del blob
    summary = runner.run([*ONE, "train.steps=1"], run_dir=tmp_path / "run")
    [peak] = summary["peak_mem_bytes"]
    assert 2**20 < peak < before - 512 * 2**20, (peak, before)


def test_on_a_gpu_a_runs_peak_memory_starts_from_its_setup(monkeypatch):
    # CUDA's allocator keeps its peak for the process's life: reset as a rank's setup begins.
    import torch

    from runner.outputs.metrics import reset_peak_memory

    calls = []
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", calls.append)
    reset_peak_memory(torch.device("cuda", 0))
    assert calls == [torch.device("cuda", 0)]


@pytest.mark.gpu
@pytest.mark.timeout(120)
def test_on_cuda_a_small_run_after_a_larger_one_in_the_same_process_reports_its_own_peak(tmp_path):
    # The real allocator: a run of 4 layers of 512 first, then the tiny run, whose peak must be what
    # the tiny run alone reports (it read the larger run's before the reset).
    small = [*ONE, "device=cuda", "train.steps=2"]
    alone = runner.run(small, run_dir=tmp_path / "alone")["peak_mem_bytes"][0]
    big = runner.run([*small, "model.dim=512", "model.n_layers=4"], run_dir=tmp_path / "big")["peak_mem_bytes"][0]
    after = runner.run(small, run_dir=tmp_path / "after")["peak_mem_bytes"][0]
    assert big > 4 * alone and after == pytest.approx(alone, rel=0.05), (alone, big, after)
    # and a generator the caller seeded is as it was (the run's own seeds the device's too)
    torch.cuda.manual_seed(3)
    expected = torch.rand(4, device="cuda")
    torch.cuda.manual_seed(3)
    runner.run(small, run_dir=tmp_path / "seeded")
    assert torch.equal(torch.rand(4, device="cuda"), expected)


@pytest.mark.parametrize("overrides, message", [
    (["parallel.ppp=2"], r"Did you mean parallel\.pp\?"),
    (["train.steps=0"], r"train\.steps=0 must be at least 1"),
    (["+callbacks.seen._target_=helpers.nowhere.Recorder"],
     r"callbacks\.seen\._target_='helpers\.nowhere\.Recorder' cannot be instantiated: .*Fix: a Hook subclass"),
    (["+callbacks.seen._target_=collections.OrderedDict"],
     r"callbacks\.seen\._target_='collections\.OrderedDict' made a OrderedDict, not a runner\.hooks\.Hook"),
    ([RECORDER, "+callbacks.seen.keys=x"], r"callbacks\.seen\._target_=.* cannot be instantiated: .*keys"),
    (["+callbacks.seen.key=x"], r"callbacks\.seen=.* names no _target_\. Fix: \+callbacks\.seen\._target_="),
])
def test_a_config_that_cannot_run_raises_config_error_before_launch(tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message):
        runner.run([*ONE, *overrides], run_dir=tmp_path / "run")
    assert not (tmp_path / "run" / "summary.json").exists()


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_a_two_rank_run_spawned_from_python_runs_the_callbacks_on_every_rank(tmp_path):
    summary = runner.run(["experiment=smoke", "profile.enabled=false", "train.steps=2", RECORDER],
                         run_dir=tmp_path / "pp2")
    assert summary["run_dir"] == str(tmp_path / "pp2") and summary["seen_steps"] == {"rank": 0, "steps": [1, 2]}
    assert json.loads((tmp_path / "pp2" / "summary.json").read_text())["steps"] == 2
