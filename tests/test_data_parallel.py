"""Data parallelism around the pipeline, and checkpoints that resume exactly, across layouts.

One 4-process spawn (a module-scoped fixture) runs pp=2 x dp=2 for every schedule with ddp and
fsdp, then saves and resumes checkpoints under other layouts; each case is asserted in its own
test. The unsplit pp=1 dp=1 reference runs once in this process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from runner.checkpoint.files import find_checkpoint
from runner.errors import ConfigError, RunnerError
from runner.pipeline.schedule import schedule_order
from runner.ranks.dist import DistEnv
from runner.train import train
from runner.validate import validate

from helpers.cli import run_cli
from helpers.config import TINY, compose, resolved
from helpers.parity import CLIP, SCHEDULES, assert_close_at_bf16, assert_matches, reference
from helpers.ranks import run_cases, stages_left

BATCH = ["parallel.microbatches=4", "train.batch_size=16"]
MODES = ["ddp", "fsdp"]
BF16 = ["fsdp-bf16-1f1b", "ddp-bf16-zbv"]
# Resumed from the `save` case's step-3 under its own and other layouts: the same layout to 1e-6,
# the others to 1e-4.
RESUMES = {
    "resume-same": ["schedule=1f1b", "parallel.pp=2", "parallel.dp=2", "parallel.dp_mode=ddp"],
    "resume-pp4-interleaved": ["schedule=interleaved_1f1b", "parallel.pp=4"],
    "resume-fsdp-zbv": ["schedule=zbv", "parallel.pp=2", "parallel.dp=2", "parallel.dp_mode=fsdp"],
}


# The cases held to the unsplit model (every schedule x dp mode, plain dp, bf16), and their
# references, with 2 blocks, not TINY's 6: held there is dp around each placement, not depth (5
# units fill the 4 stages of a V or interleaved placement). The checkpoints keep TINY: one resumes
# at pp=4 interleaved, 8 stages.
SHALLOW = ["model.n_layers=2"]


def _resolved(*overrides: str) -> dict:
    return resolved(*TINY, *CLIP, *BATCH, *overrides)


@pytest.fixture(scope="module")
def dp(tmp_path_factory) -> tuple[Path, dict[str, dict]]:
    """The 4-rank spawn. Returns the directory of the cases' run directories and their records."""
    out = tmp_path_factory.mktemp("data-parallel") / "spawn"
    cases = {f"{mode}-{name}": _resolved(*SHALLOW, f"schedule={name}", "parallel.pp=2", "parallel.dp=2",
                                         f"parallel.dp_mode={mode}")
             for mode in MODES for name in SCHEDULES}
    for mode in MODES:  # pp=1: plain data parallelism over 4 replicas
        cases[f"dp-only-{mode}"] = _resolved(*SHALLOW, "parallel.pp=1", "parallel.dp=4", f"parallel.dp_mode={mode}")
    # bf16: FSDP's mixed-precision policy (bf16 parameters in compute, fp32 reduction), and
    # replicate with autocast.
    # Evaluation runs on the replicas too.
    cases["fsdp-bf16-1f1b"] = _resolved(*SHALLOW, "schedule=1f1b", "parallel.pp=2", "parallel.dp=2",
                                        "parallel.dp_mode=fsdp", "train.precision=bf16", "eval.every=3")
    cases["ddp-bf16-zbv"] = _resolved(*SHALLOW, "schedule=zbv", "parallel.pp=2", "parallel.dp=2",
                                      "parallel.dp_mode=ddp", "train.precision=bf16", "eval.every=3")
    saved = out / "save" / "checkpoints" / "step-3"
    # train.no_decay=[]: an empty parameter group on every rank, which DCP's loading trips over.
    cases["save"] = _resolved("schedule=1f1b", "parallel.pp=2", "parallel.dp=2", "parallel.dp_mode=ddp",
                              "train.steps=6", "checkpoint.every=3", "train.no_decay=[]")
    for name, overrides in RESUMES.items():
        cases[name] = _resolved(*overrides, "train.steps=6", "train.no_decay=[]", f"checkpoint.resume={saved}")
    # The same save in the background (checkpoint.async_save), and the same resume from it.
    cases["save-async"] = _resolved("schedule=1f1b", "parallel.pp=2", "parallel.dp=2", "parallel.dp_mode=ddp",
                                    "train.steps=6", "checkpoint.every=3", "train.no_decay=[]",
                                    "checkpoint.async_save=true")
    cases["resume-from-async"] = _resolved(*RESUMES["resume-same"], "train.steps=6", "train.no_decay=[]",
                                           f"checkpoint.resume={out / 'save-async' / 'checkpoints' / 'step-3'}")
    cases["keep"] = _resolved("schedule=gpipe", "parallel.pp=4", "train.steps=3", "checkpoint.every=1",
                              "checkpoint.keep=2")
    return out, run_cases(out, 4, cases, more_hooks=stages_left)


@pytest.fixture(scope="module")
def ref(tmp_path_factory) -> dict:
    return reference(tmp_path_factory.mktemp("data-parallel-reference"), *SHALLOW, *BATCH)


@pytest.fixture(scope="module")
def ref_bf16(tmp_path_factory) -> dict:
    return reference(tmp_path_factory.mktemp("data-parallel-reference-bf16"), *SHALLOW, *BATCH, "train.precision=bf16",
                     "eval.every=3")


@pytest.mark.multiprocess
@pytest.mark.timeout(420)
@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.parametrize("mode", MODES)  # ids: <mode>-<schedule>, the case's name
def test_pp2_dp2_matches_the_unsplit_model(dp, ref, mode, name):
    got = dp[1][f"{mode}-{name}"]
    assert_matches(got, ref, f"{mode}-{name}")
    assert got["summary"]["dp"] == 2


@pytest.mark.multiprocess
@pytest.mark.timeout(420)
def test_the_executed_schedule_is_one_pipeline_of_the_first_replica(dp):
    # pp=2 x dp=2: replica 0's pipeline is ranks 0 and 2 (runner.parallel.dims); ranks 0 and 1 hold stage 0 twice.
    rows = (dp[0] / "ddp-1f1b" / "schedule.csv").read_text().splitlines()
    order = schedule_order("1f1b", 2, 4, 1)
    assert rows == [",".join(op.name for op in order[r]) for r in range(2)]


@pytest.mark.multiprocess
@pytest.mark.timeout(420)
@pytest.mark.parametrize("mode", MODES)
def test_plain_data_parallelism_over_4_replicas_matches_the_unsplit_model(dp, ref, mode):
    assert_matches(dp[1][f"dp-only-{mode}"], ref, f"dp-only-{mode}")


@pytest.mark.multiprocess
@pytest.mark.timeout(420)
@pytest.mark.parametrize("case", BF16)
def test_bf16_with_fsdp_and_with_replicate_matches_the_unsplit_bf16_run(dp, ref_bf16, case):
    got = dp[1][case]
    assert_close_at_bf16(got, ref_bf16, case)
    assert got["summary"]["val_losses"] == [
        {"step": v["step"], "val_loss": pytest.approx(v["val_loss"], rel=1e-2)}
        for v in ref_bf16["summary"]["val_losses"]], case


@pytest.mark.multiprocess
@pytest.mark.timeout(420)
def test_no_finished_run_leaves_its_stages_alive_evaluations_included(dp):
    # An evaluation at pp=2 x dp=2 ran the stages' forward with autograd on (torch's schedule.eval
    # leaves it on): the graph and FSDP's backward hooks kept the stage modules, and with them their
    # process groups and threads, alive after the run (before the fix: 1 of rank 0's stage modules
    # under fsdp-bf16-1f1b, 2 under ddp-bf16-zbv; the pool's later cases hid it at its exit).
    alive = {case: record.get("stages_alive") for case, record in dp[1].items() if "error" not in record}
    assert alive["fsdp-bf16-1f1b"] == alive["ddp-bf16-zbv"] == 0, alive
    assert set(alive.values()) == {0}, alive


@pytest.mark.multiprocess
@pytest.mark.timeout(420)
@pytest.mark.parametrize("case", RESUMES)
def test_a_checkpoint_resumes_exactly_under_its_own_and_other_layouts(dp, case):
    results = dp[1]
    full = results["save"]["losses"]
    assert "error" not in results["save"] and len(full) == 6
    got = results[case]
    assert "error" not in got, got.get("traceback")
    if case == "resume-same":
        assert got["summary"]["first_step"] == 4  # resumed from step-3
    assert got["losses"] == pytest.approx(full[3:], rel=1e-6 if case == "resume-same" else 1e-4, abs=0), case


def _checkpoint_state(step: Path, out: Path) -> dict:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(step, out)
    return torch.load(out, weights_only=True)


@pytest.mark.multiprocess
@pytest.mark.timeout(420)
def test_asynchronous_saves_hold_what_synchronous_ones_do_and_resume_alike(dp, tmp_path):
    out, results = dp
    assert "error" not in results["save-async"], results["save-async"].get("traceback")
    assert results["save-async"]["losses"] == results["save"]["losses"]
    # Both saves committed (the last one by the run's end), nothing left partial; the final weights
    # and optimizer state are the synchronous run's, and step-3 resumes as the synchronous one does.
    assert sorted(p.name for p in (out / "save-async" / "checkpoints").iterdir()) == ["step-3", "step-6"]
    sync = _checkpoint_state(out / "save" / "checkpoints" / "step-6", tmp_path / "sync.pt")
    done = _checkpoint_state(out / "save-async" / "checkpoints" / "step-6", tmp_path / "async.pt")
    assert sync.keys() == done.keys() and sync["model"].keys() == done["model"].keys()
    for group in sync:
        for key, value in sync[group].items():
            other = done[group][key]
            assert torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other, (group, key)
    assert (json.loads((out / "save" / "checkpoints" / "step-6" / "train_state.json").read_text())
            == json.loads((out / "save-async" / "checkpoints" / "step-6" / "train_state.json").read_text()))
    resumed = results["resume-from-async"]
    assert "error" not in resumed, resumed.get("traceback")
    assert resumed["summary"]["first_step"] == 4 and resumed["losses"] == results["resume-same"]["losses"]


@pytest.mark.multiprocess
@pytest.mark.timeout(420)
def test_checkpoint_keep_holds_the_newest_two(dp):
    kept = sorted(p.name for p in (dp[0] / "keep" / "checkpoints").iterdir())
    assert kept == ["step-2", "step-3"]


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
def test_a_kill_between_shard_writes_and_commit_leaves_the_previous_checkpoint_to_resume(tmp_path):
    common = [*TINY, *CLIP, "parallel.pp=2", "parallel.microbatches=4", "train.batch_size=8", "train.steps=6"]
    killed = run_cli(*common, "checkpoint.every=2", "hydra.run.dir=killed", cwd=tmp_path,
                     env={"RUNNER_FAULT": "checkpoint-commit-step-4"})
    assert killed.returncode != 0 and "SIGKILL" in killed.stderr
    ckpts = tmp_path / "killed" / "checkpoints"
    assert [p.name for p in ckpts.glob("step-*")] == ["step-2"]
    partial = list(ckpts.glob(".partial-step-4-*"))
    assert len(partial) == 1 and list(partial[0].glob("*.distcp"))  # shards written, never committed
    lines = (tmp_path / "killed" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3, 4]

    run_cli(*common, "checkpoint.resume=killed", "hydra.run.dir=resumed", cwd=tmp_path, check=True)
    summary = json.loads((tmp_path / "resumed" / "summary.json").read_text())
    assert summary["first_step"] == 3  # resumed from step-2
    ref = reference(tmp_path, "parallel.microbatches=4", "train.batch_size=8", "train.steps=6")
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
