"""Data parallelism around the pipeline, and checkpoints that resume exactly, across layouts.

One 4-process spawn runs pp=2 x dp=2 for every schedule with ddp and fsdp, then saves and resumes
checkpoints under other layouts; the unsplit pp=1 dp=1 reference runs once in this process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from runner.checkpoint_files import find_checkpoint
from runner.dist import DistEnv
from runner.errors import ConfigError, RunnerError
from runner.train import train
from runner.validate import validate

from _ranks import spawn, train_cases
from conftest import ROOT, TINY, compose
from test_features import _assert_close_at_bf16
from test_parity import CLIP, SCHEDULES, _assert_matches, _reference

TESTS = Path(__file__).parent
BATCH = ["parallel.microbatches=4", "train.batch_size=16"]


def _resolved(*overrides: str) -> dict:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(compose(*TINY, *CLIP, *BATCH, *overrides), resolve=True)


@pytest.mark.timeout(420)
def test_pp2_dp2_matches_the_unsplit_model_and_checkpoints_resume_across_layouts(tmp_path):
    out = tmp_path / "spawn"
    cases = {f"{mode}-{name}": _resolved(f"schedule={name}", "parallel.pp=2", "parallel.dp=2",
                                         f"parallel.dp_mode={mode}")
             for mode in ("ddp", "fsdp") for name in SCHEDULES}
    for mode in ("ddp", "fsdp"):  # pp=1: plain data parallelism over 4 replicas
        cases[f"dp-only-{mode}"] = _resolved("parallel.pp=1", "parallel.dp=4", f"parallel.dp_mode={mode}")
    # bf16: FSDP's mixed-precision policy (bf16 parameters in compute, fp32 reduction), and
    # replicate with autocast.
    # Evaluation runs on the replicas too.
    cases["fsdp-bf16-1f1b"] = _resolved("schedule=1f1b", "parallel.pp=2", "parallel.dp=2", "parallel.dp_mode=fsdp",
                                        "train.precision=bf16", "eval.every=3")
    cases["ddp-bf16-zbv"] = _resolved("schedule=zbv", "parallel.pp=2", "parallel.dp=2", "parallel.dp_mode=ddp",
                                      "train.precision=bf16", "eval.every=3")
    saved = out / "save" / "checkpoints" / "step-3"
    # train.no_decay=[]: an empty parameter group on every rank, which DCP's loading trips over.
    cases["save"] = _resolved("schedule=1f1b", "parallel.pp=2", "parallel.dp=2", "parallel.dp_mode=ddp",
                              "train.steps=6", "checkpoint.every=3", "train.no_decay=[]")
    resumes = {
        "resume-same": ["schedule=1f1b", "parallel.pp=2", "parallel.dp=2", "parallel.dp_mode=ddp"],
        "resume-pp4-interleaved": ["schedule=interleaved_1f1b", "parallel.pp=4"],
        "resume-fsdp-zbv": ["schedule=zbv", "parallel.pp=2", "parallel.dp=2", "parallel.dp_mode=fsdp"],
    }
    for name, overrides in resumes.items():
        cases[name] = _resolved(*overrides, "train.steps=6", "train.no_decay=[]", f"checkpoint.resume={saved}")
    cases["keep"] = _resolved("schedule=gpipe", "parallel.pp=4", "train.steps=3", "checkpoint.every=1",
                              "checkpoint.keep=2")
    spawn(4, train_cases, str(out), cases)
    results = {name: torch.load(out / f"{name}.pt", weights_only=False) for name in cases}

    ref = _reference(tmp_path, *BATCH)
    for mode in ("ddp", "fsdp"):
        for name in SCHEDULES:
            _assert_matches(results[f"{mode}-{name}"], ref, f"{mode}-{name}")
            assert results[f"{mode}-{name}"]["summary"]["dp"] == 2
        _assert_matches(results[f"dp-only-{mode}"], ref, f"dp-only-{mode}")
    (tmp_path / "bf16").mkdir()
    ref_bf16 = _reference(tmp_path / "bf16", *BATCH, "train.precision=bf16", "eval.every=3")
    for case in ("fsdp-bf16-1f1b", "ddp-bf16-zbv"):
        _assert_close_at_bf16(results[case], ref_bf16, case)
        assert results[case]["summary"]["val_losses"] == [
            {"step": v["step"], "val_loss": pytest.approx(v["val_loss"], rel=1e-2)}
            for v in ref_bf16["summary"]["val_losses"]], case

    full = results["save"]["losses"]
    assert "error" not in results["save"] and len(full) == 6
    same = results["resume-same"]
    assert same["summary"]["first_step"] == 4  # resumed from step-3
    assert same["losses"] == pytest.approx(full[3:], rel=1e-6, abs=0)
    for name in ("resume-pp4-interleaved", "resume-fsdp-zbv"):
        assert "error" not in results[name], results[name].get("traceback")
        assert results[name]["losses"] == pytest.approx(full[3:], rel=1e-4, abs=0), name
    kept = sorted(p.name for p in (out / "keep" / "checkpoints").iterdir())
    assert kept == ["step-2", "step-3"]


def _cli(*args: str, cwd: Path, env_extra: dict | None = None):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), str(ROOT)]), **(env_extra or {})}
    return subprocess.run([sys.executable, "-m", "runner", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.timeout(200)
def test_a_kill_between_shard_writes_and_commit_leaves_the_previous_checkpoint_to_resume(tmp_path):
    common = [*TINY, *CLIP, "parallel.pp=2", "parallel.microbatches=4", "train.batch_size=8", "train.steps=6"]
    killed = _cli(*common, "checkpoint.every=2", "hydra.run.dir=killed", cwd=tmp_path,
                  env_extra={"RUNNER_FAULT": "checkpoint-commit-step-4"})
    assert killed.returncode != 0 and "SIGKILL" in killed.stderr
    ckpts = tmp_path / "killed" / "checkpoints"
    assert [p.name for p in ckpts.glob("step-*")] == ["step-2"]
    partial = list(ckpts.glob(".partial-step-4-*"))
    assert len(partial) == 1 and list(partial[0].glob("*.distcp"))  # shards written, never committed
    lines = (tmp_path / "killed" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3, 4]

    resumed = _cli(*common, "checkpoint.resume=killed", "hydra.run.dir=resumed", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    summary = json.loads((tmp_path / "resumed" / "summary.json").read_text())
    assert summary["first_step"] == 3  # resumed from step-2
    ref = _reference(tmp_path, "parallel.microbatches=4", "train.batch_size=8", "train.steps=6")
    assert summary["losses"] == pytest.approx(ref["losses"][2:], rel=1e-4, abs=0)
    assert [json.loads(line)["loss"] for line in lines] == pytest.approx(ref["losses"][:4], rel=1e-4, abs=0)


def test_bad_resume_targets_are_clear_errors(tmp_path):
    run_dir = tmp_path / "outputs" / "day" / "now"
    run_dir.mkdir(parents=True)
    with pytest.raises(ConfigError, match="no such directory"):
        find_checkpoint(str(tmp_path / "nope"), run_dir)
    with pytest.raises(ConfigError, match="latest: no complete checkpoint"):
        find_checkpoint("latest", run_dir, tmp_path / "outputs")
    with pytest.raises(ConfigError, match="not a complete checkpoint"):
        find_checkpoint(str(run_dir), run_dir)

    # A real checkpoint (one process), then damage it in the ways a crash or a disk can.
    cfg = compose(*TINY, "parallel.pp=1", "parallel.microbatches=2", "train.batch_size=4", "train.steps=2",
                  "checkpoint.every=2")
    env = DistEnv(0, 1, torch.device("cpu"))
    train(validate(cfg, run_dir), cfg, env)
    step = run_dir / "checkpoints" / "step-2"
    assert find_checkpoint(str(run_dir), run_dir) == step
    assert find_checkpoint("latest", tmp_path / "outputs" / "day" / "later", tmp_path / "outputs") == step
    shard = next(step.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])  # truncated
    cfg.train.steps, cfg.checkpoint.every, cfg.checkpoint.resume = 3, 0, str(step)
    with pytest.raises(RunnerError, match=f"checkpoint {step} is damaged: {shard} has 100 bytes"):
        train(validate(cfg, tmp_path / "resume"), cfg, env)
    (step / "train_state.json").write_text("{not json")
    with pytest.raises(ConfigError, match="train_state.json is unreadable or corrupt"):
        find_checkpoint(str(step), run_dir)
    (step / ".metadata").unlink()
    with pytest.raises(ConfigError, match="not a complete checkpoint: it has no .metadata"):
        find_checkpoint(str(step), run_dir)
