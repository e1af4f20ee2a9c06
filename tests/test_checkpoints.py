"""Checkpoints that are poisoned, foreign, damaged, in use or half-written are never loaded
silently; a resume keeps the run's history. In-process, one rank (pp=1): every case trains a
few tiny steps or none, and damages real checkpoint files."""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import pickle
import re
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
import yaml
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from runner.checkpoint.checkpointer import Checkpointer, load_rng_state, save_rng_state
from runner.checkpoint.files import files_of, find_checkpoint, write_manifest
from runner.errors import CheckpointError, ConfigError, NonFiniteLossError
from runner.launch import launch
from runner.optim import build_optimizer, lr_factor
from runner.ranks.dist import DistEnv
from runner.rundir import hold_run_lock, run_in_progress
from runner.train import train
from runner.validate import validate

from helpers.config import TINY, compose

ONE = [*TINY, "parallel.pp=1", "parallel.microbatches=2", "train.batch_size=4"]
ENV = DistEnv(0, 1, torch.device("cpu"))


def _train(run_dir: Path, *overrides: str, resume: Path | None = None):
    cfg = compose(*ONE, *overrides)
    if resume is not None:
        cfg.checkpoint.resume = str(resume)
    run_dir.mkdir(parents=True, exist_ok=True)
    return train(validate(cfg, run_dir), cfg, ENV)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A finished run under outputs/<date>/<time>: checkpoints step-1 and step-2 of 2 steps."""
    run_dir = tmp_path_factory.mktemp("saved") / "outputs" / "day" / "first"
    _train(run_dir, "train.steps=2", "checkpoint.every=1")
    return run_dir


@pytest.fixture
def run_copy(saved, tmp_path) -> Path:
    """A copy of the saved run, free to damage."""
    copy = tmp_path / "outputs" / "day" / "first"
    shutil.copytree(saved, copy)
    return copy


def _all_files(step: Path) -> list[str]:
    return [p.name for p in step.iterdir() if not p.name.startswith("manifest-")]


class _Payload:
    """Unpickled without our allowlist, it creates ``marker``: code run by loading a file."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({str(self.marker)!r}, 'w').close()",)


def test_a_crafted_metadata_file_runs_no_code_even_with_a_matching_manifest(run_copy, tmp_path):
    step = run_copy / "checkpoints" / "step-2"
    marker = tmp_path / "pwned"
    (step / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    pickle.loads((step / ".metadata").read_bytes())  # the payload is live: plain pickle runs it
    assert marker.exists()
    marker.unlink()
    write_manifest(step, 0, _all_files(step))  # whoever can plant a file can rewrite the manifest
    # Refused before any rank starts (the resume's tensors are checked against the model's there).
    with pytest.raises(ConfigError, match=r"refused.*builtins\.exec.*not checkpoint metadata") as info:
        _train(tmp_path / "resume", "train.steps=3", resume=step)
    assert str(step) in str(info.value) and not marker.exists()


def test_a_crafted_non_tensor_entry_runs_no_code(run_copy, tmp_path):
    # The runner's own optimizer hyperparameters are pickled entries of the shard files.
    step = run_copy / "checkpoints" / "step-2"
    dcp_to_torch_save(step, tmp_path / "full.pt")
    state = torch.load(tmp_path / "full.pt", weights_only=True)
    key = next(k for k in state["optim"] if k.startswith("param_groups.") and k.endswith(".lr"))
    marker = tmp_path / "pwned"
    state["optim"][key] = _Payload(marker)
    evil = tmp_path / "evil"
    dcp.save(state, checkpoint_id=str(evil))
    for name in ("train_state.json", "rng-rank0.pt"):
        shutil.copy(step / name, evil / name)
    write_manifest(evil, 0, _all_files(evil))
    dcp_to_torch_save(evil, tmp_path / "check.pt")  # torch's default load planner runs the payload
    assert marker.exists()
    marker.unlink()
    refused = rf"refused.*entry 'optim\.{key}' refers to exec, which is not plain data"
    with pytest.raises(CheckpointError, match=refused):
        _train(tmp_path / "resume", "train.steps=3", resume=evil)
    assert not marker.exists()


def test_a_crafted_rng_state_runs_no_code_and_is_refused_as_metadata_is(run_copy, tmp_path):
    step = run_copy / "checkpoints" / "step-2"
    marker = tmp_path / "pwned"
    torch.save(_Payload(marker), step / "rng-rank0.pt")
    torch.load(step / "rng-rank0.pt", weights_only=False)  # the payload is live: an unguarded load runs it
    assert marker.exists()
    marker.unlink()
    write_manifest(step, 0, _all_files(step))
    refused = (rf"checkpoint {re.escape(str(step))} was refused: rng-rank0\.pt refers to \S*exec, which is not plain "
               r"data; loading it could run code, so it was not loaded\. Fix: use only checkpoints this runner wrote")
    with pytest.raises(ConfigError, match=refused):  # before any rank starts, as a crafted .metadata is
        _train(tmp_path / "resume", "train.steps=3", resume=step)
    torch.save({"not": "an RNG state"}, step / "rng-rank0.pt")
    write_manifest(step, 0, _all_files(step))
    with pytest.raises(ConfigError, match=r"was refused: rng-rank0\.pt holds \{'not': 'an RNG state'\}, not a CPU"):
        _train(tmp_path / "resume", "train.steps=3", resume=step)
    # A rank reads it through the same reader: a file planted after the check before launch.
    shutil.copy(run_copy / "checkpoints" / "step-1" / "rng-rank0.pt", step / "rng-rank0.pt")
    write_manifest(step, 0, _all_files(step))
    cfg = compose(*ONE, "train.steps=3", f"checkpoint.resume={step}")
    (tmp_path / "again").mkdir()
    resolved = validate(cfg, tmp_path / "again")
    (step / "rng-rank0.pt").write_bytes(pickle.dumps(_Payload(marker)))  # plain pickle, not torch.save's zip
    write_manifest(step, 0, _all_files(step))
    with pytest.raises(CheckpointError, match=r"was refused: rng-rank0\.pt is not plain data \(Unsupported operand"):
        train(resolved, cfg, ENV)
    assert not marker.exists()


def test_a_damaged_file_is_named_and_nothing_is_loaded(run_copy, tmp_path):
    step = run_copy / "checkpoints" / "step-2"
    shard = next(step.glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01  # one flipped bit in a tensor: DCP itself would load it
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=f"{shard} does not match the sha256 in manifest-rank0.json"):
        _train(tmp_path / "resume", "train.steps=3", resume=step)
    shard.write_bytes(bytes(data[:100]))  # truncated
    with pytest.raises(CheckpointError, match=f"{shard} has 100 bytes, its manifest"):
        _train(tmp_path / "resume", "train.steps=3", resume=step)


def test_an_incomplete_newest_checkpoint_is_skipped_and_named(run_copy, caplog):
    (run_copy / "checkpoints" / "step-2" / ".metadata").unlink()
    with caplog.at_level(logging.WARNING, logger="runner.checkpoint"):
        assert find_checkpoint(str(run_copy), run_copy) == run_copy / "checkpoints" / "step-1"
    assert f"skipping checkpoint {run_copy / 'checkpoints' / 'step-2'}: it has no .metadata" in caplog.text
    (run_copy / "checkpoints" / "step-1" / "manifest-rank0.json").unlink()
    with pytest.raises(ConfigError, match="no complete checkpoint"):
        find_checkpoint(str(run_copy), run_copy)
    assert "step-1: it has no manifest-rank0.json" in caplog.text


def test_a_garbage_train_state_names_its_file(run_copy):
    step = run_copy / "checkpoints" / "step-2"
    (step / "train_state.json").write_text("{not json")
    with pytest.raises(ConfigError, match=f"{step / 'train_state.json'} is unreadable or corrupt"):
        find_checkpoint(str(step), run_copy)


def _saved_at(checkpoint: Path, when: float) -> None:
    """Date every file of ``checkpoint`` as if it was saved at ``when`` (copies keep the original's)."""
    for f in checkpoint.rglob("*"):
        os.utime(f, (when, when))


def test_latest_looks_only_under_its_root_and_skips_runs_in_progress(saved, tmp_path, caplog):
    root = tmp_path / "outputs"
    # The newest checkpoint is neither the first (as ties would give), the last name, nor the highest step.
    older, newer = root / "day" / "a-older", root / "day" / "b-newer"
    shutil.copytree(saved, older)
    shutil.copytree(saved, newer)
    planted = tmp_path / "planted" / "checkpoints"  # outside the root, and the newest of all
    shutil.copytree(saved / "checkpoints", planted)
    now = time.time()
    for age, step in enumerate([planted / "step-2", newer / "checkpoints" / "step-1", older / "checkpoints" / "step-2",
                                newer / "checkpoints" / "step-2", older / "checkpoints" / "step-1"]):
        _saved_at(step, now - 100 * age)
    custom_run = tmp_path / "x" / "run"  # a custom hydra.run.dir: its parents are not searched
    custom_run.mkdir(parents=True)
    assert find_checkpoint("latest", custom_run, root) == newer / "checkpoints" / "step-1"
    with pytest.raises(ConfigError, match=f"no complete checkpoint in the runs under {custom_run.parent}"):
        find_checkpoint("latest", custom_run, custom_run.parent)
    with hold_run_lock(newer), caplog.at_level(logging.WARNING, logger="runner.checkpoint"):
        assert run_in_progress(newer)
        assert find_checkpoint("latest", custom_run, root) == older / "checkpoints" / "step-2"
        assert f"skipping the checkpoints of {newer}: that run is still in progress" in caplog.text
        with pytest.raises(ConfigError, match="in use by another run"):
            with hold_run_lock(newer):
                pass
    assert not run_in_progress(newer)


def test_a_full_disk_during_a_save_says_so_and_leaves_no_partial_directory(tmp_path, monkeypatch, caplog):
    run_dir = tmp_path / "run"
    stale = run_dir / "checkpoints" / ".partial-step-7-deadbeef"  # left by a save that crashed
    stale.mkdir(parents=True)
    (stale / "__0_0.distcp").write_bytes(b"x" * 1000)
    import torch.distributed.checkpoint.filesystem as dcp_fs

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(run_dir / "checkpoints" / "__0_0.distcp"))

    monkeypatch.setattr(dcp_fs, "_write_item", full)
    with caplog.at_level(logging.WARNING, logger="runner.checkpoint"), pytest.raises(CheckpointError) as info:
        _train(run_dir, "train.steps=2", "checkpoint.every=2")
    message = str(info.value)
    assert "checkpoint step-2 was not saved in" in message and str(run_dir / "checkpoints") in message
    assert "no space left on device" in message and "__0_0.distcp" in message
    assert "partial checkpoint was removed" in message
    assert f"removed {stale}" in caplog.text
    assert list((run_dir / "checkpoints").iterdir()) == []


def test_a_checkpoint_never_holds_a_non_finite_value(tmp_path):
    from runner.models.split import StageModule
    from runner.models.units import SequentialSpec

    whole = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    with torch.no_grad():
        whole[1].weight[0, 0] = float("inf")
    spec = SequentialSpec(whole)
    model = StageModule(spec, spec.unit_names, dict(whole.named_children()))
    optimizer, scheduler = build_optimizer([model], compose(*ONE).train)
    cfg = compose(*ONE, "checkpoint.every=1").checkpoint
    checkpointer = Checkpointer(cfg, tmp_path, ENV, [model], optimizer, scheduler)
    refused = r"step-1 was not written: non-finite values in model\.1\.weight \(rank 0\)"
    with pytest.raises(NonFiniteLossError, match=refused):
        checkpointer.save(1)
    assert not list(tmp_path.glob("checkpoints/*"))


def test_divergence_stops_before_the_optimizer_and_names_the_last_good_checkpoint(tmp_path):
    # lr=1e6: an update soon makes the loss or the gradient norm non-finite. Which step, and which
    # of the two, depends on the CPU's float path (a NaN gradient norm at step 2 on one machine, a
    # NaN loss at step 3 on another): the test holds what follows whichever step it is.
    with pytest.raises(NonFiniteLossError) as info:
        _train(tmp_path, "train.steps=8", "train.lr=1e6", "checkpoint.every=1", "checkpoint.keep=8")
    found = re.search(r"non-finite (loss|gradient norm) at step (\d+) \(loss (\S+), grad_norm (\S+)\)", str(info.value))
    assert found, str(info.value)
    what, step, loss, grad_norm = found.group(1), int(found.group(2)), float(found.group(3)), float(found.group(4))
    assert 2 <= step <= 8  # the first step starts from the finite initial weights
    assert not math.isfinite(loss if what == "loss" else grad_norm) and (what == "loss" or math.isfinite(loss))
    # Every step before it saved a checkpoint, and the diverged step did not (nor any after it).
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [f"step-{n}" for n in range(1, step)]
    last_good = tmp_path / "checkpoints" / f"step-{step - 1}"
    assert f"the last good checkpoint is {last_good}" in str(info.value)
    dcp_to_torch_save(last_good, tmp_path / "full.pt")
    state = torch.load(tmp_path / "full.pt", weights_only=True)
    tensors = [v for group in state.values() for v in group.values() if isinstance(v, torch.Tensor)]
    assert len(tensors) > 20 and all(torch.isfinite(t).all() for t in tensors)


def test_the_checkpoint_a_resume_names_is_resolved_into_the_plan_and_the_resolved_config(saved, tmp_path):
    cfg = compose(*ONE, "train.steps=3", f"checkpoint.resume={saved}")  # a run directory: its newest checkpoint
    resolved = validate(cfg, tmp_path)
    assert resolved.resume == (saved / "checkpoints" / "step-2").resolve() and cfg.checkpoint.resume == str(saved)
    assert len(train(resolved, cfg, ENV).losses) == 1
    written = yaml.safe_load((tmp_path / "resolved_config.yaml").read_text())
    assert written["checkpoint"]["resume"] == str(resolved.resume) and written["device"] == "cpu"
    assert written["launch"]["threads_per_rank"] == resolved.threads_per_rank and cfg.launch.threads_per_rank is None


@pytest.mark.parametrize("changed, saved_value", [("train.batch_size=8", 4), ("train.seq_len=8", 16),
                                                   ("train.seed=1", 0)])
def test_a_resume_that_would_not_read_on_where_the_data_stopped_is_refused_unless_allowed(saved, tmp_path, caplog,
                                                                                           changed, saved_value):
    # Step N's batch is samples (N - 1) * batch_size on, in an order the seed draws, as windows of
    # seq_len + 1 tokens: resumed at batch 8 from a batch-4 run, step 2 read samples 8-15 of an
    # epoch whose samples 4-7 it never trained on.
    key = changed.split("=")[0]
    position_table = ["model.max_seq_len=16"]  # the checkpoint's (a shorter sequence reads the same model)
    cfg = compose(*ONE, "train.steps=3", changed, *position_table, f"checkpoint.resume={saved}")
    with pytest.raises(ConfigError, match=rf"was saved at step 2 with {key}={saved_value}; this run has {changed}, so "
                       rf"its step 3 would not read the samples after .* Fix: {key}={saved_value}, or "
                       r"checkpoint\.allow_data_change=true"):
        validate(cfg, tmp_path)
    cfg.checkpoint.allow_data_change = True
    with caplog.at_level(logging.WARNING, logger="runner.checkpoint"):
        assert validate(cfg, tmp_path).resume == (saved / "checkpoints" / "step-2").resolve()
    assert "checkpoint.allow_data_change=true: continuing" in caplog.text


@pytest.mark.timeout(120)
def test_a_resume_on_token_data_of_another_length_is_refused_unless_allowed_and_on_the_same_data_reads_on(
        tmp_path, monkeypatch, caplog):
    # Sample n of an epoch is window perm(n mod W) under a permutation drawn for W, the training
    # split's windows: with 500 tokens appended to the corpus (or another data.val_fraction), W
    # changed and the resumed steps read another permutation, silently (one epoch of 560 samples,
    # resumed halfway on the longer corpus, read 132 samples twice and skipped as many).
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # the id ranges TokensData keeps
    ids = ((np.arange(3000) * 7) % 48).astype(np.uint16)
    ids.tofile(tmp_path / "ids.bin")
    tokens = ["data=tokens", f"data.path={tmp_path}/ids.bin", "data.val_fraction=0.1"]
    whole = _train(tmp_path / "whole", *tokens, "train.steps=3").losses
    _train(tmp_path / "first", *tokens, "train.steps=1", "checkpoint.every=1")
    saved = tmp_path / "first" / "checkpoints" / "step-1"
    assert json.loads((saved / "train_state.json").read_text())["data_position"]["train_windows"] == 2700 // 17
    assert _train(tmp_path / "resumed", *tokens, "train.steps=3", resume=saved).losses == whole[1:]
    np.concatenate([ids, ids[:500]]).tofile(tmp_path / "ids.bin")  # the corpus grew
    for changed, windows in [((), 3150 // 17), (("data.val_fraction=0.2",), 2400 // 17)]:
        if not changed:
            cfg = compose(*ONE, *tokens, "train.steps=3", f"checkpoint.resume={saved}")
        else:
            ids.tofile(tmp_path / "ids.bin")
            cfg = compose(*ONE, *tokens, *changed, "train.steps=3", f"checkpoint.resume={saved}")
        with pytest.raises(ConfigError, match=rf"was saved at step 1 from data of 158 training windows of "
                           rf"train.seq_len \+ 1 tokens; this run's data holds {windows} \(data.path=.*ids.bin' "
                           r"changed, or data.val_fraction.*so its step 2 would not read the samples after .* Fix: "
                           r"the data and data.val_fraction the checkpoint was trained on, or "
                           r"checkpoint\.allow_data_change=true"):
            validate(cfg, tmp_path / "refused")
    cfg.checkpoint.allow_data_change = True
    with caplog.at_level(logging.WARNING, logger="runner.checkpoint"):
        assert validate(cfg, tmp_path / "refused").resume == saved.resolve()
    assert "checkpoint.allow_data_change=true: continuing" in caplog.text
    # Another train.seq_len is named alone: its windows are of another length, so another number.
    cfg = compose(*ONE, *tokens, "train.seq_len=8", "train.steps=3", f"checkpoint.resume={saved}")
    with pytest.raises(ConfigError, match=r"was saved at step 1 with train.seq_len=16; this run has train.seq_len=8, "
                                          r"so its step 2 .* Fix: train.seq_len=16, or checkpoint"):
        validate(cfg, tmp_path / "refused")


def test_a_gpu_ranks_checkpoint_holds_its_devices_generator_and_a_resume_restores_it(tmp_path, monkeypatch):
    # Dropout draws from the device's generator on a GPU; a checkpoint held the CPU's alone, so a
    # resumed GPU run drew its first steps' masks again. Here with a stand-in for CUDA's generator.
    generator = {"state": torch.arange(16, dtype=torch.uint8)}
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device: generator["state"].clone())
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device: generator.update(state=state.clone()))
    gpu = torch.device("cuda", 0)
    save_rng_state(tmp_path, 1, gpu)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cuda-rng-rank1.pt", "rng-rank1.pt"]
    assert "cuda-rng-rank1.pt" in files_of(tmp_path, 1, False)  # in the rank's manifest
    saved_cpu, generator["state"] = torch.get_rng_state(), torch.zeros(16, dtype=torch.uint8)
    torch.rand(3)  # both generators move on
    load_rng_state(tmp_path, 1, gpu)
    assert torch.equal(generator["state"], torch.arange(16, dtype=torch.uint8))
    assert torch.equal(torch.get_rng_state(), saved_cpu)
    (tmp_path / "cpu").mkdir()
    save_rng_state(tmp_path / "cpu", 0, torch.device("cpu"))
    assert [p.name for p in (tmp_path / "cpu").iterdir()] == ["rng-rank0.pt"]  # a CPU rank: as before


# The CPU case keeps the GPU one from rotting between GPU runs (until 2026-11-28 only the stand-in
# above had held the device generator's part).
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.timeout(120)
def test_a_resumed_run_with_dropout_trains_on_as_the_uninterrupted_run_did(device, tmp_path):
    # Dropout after every block, drawn on the run's device: resumed from step 2's checkpoint, steps 3
    # and 4 draw the masks, and so reach the losses, of a run that never stopped.
    dropout = ["model=mlp", "model._target_=helpers.models.recorded_dropout_mlp", "model.n_layers=4",
               f"device={device}"]
    env = DistEnv(0, 1, torch.device(device, 0) if device == "cuda" else torch.device("cpu"))

    def run(name: str, steps: int, *more: str, resume: Path | None = None) -> list[float]:
        (tmp_path / f"masks-{name}").mkdir()
        cfg = compose(*ONE, *dropout, f"+model.masks={tmp_path / f'masks-{name}'}", f"train.steps={steps}", *more)
        if resume is not None:
            cfg.checkpoint.resume = str(resume)
        (tmp_path / name).mkdir()
        return train(validate(cfg, tmp_path / name), cfg, env).losses

    whole = run("whole", 4)
    run("first", 2, "checkpoint.every=2")
    resumed = run("resumed", 4, resume=tmp_path / "first" / "checkpoints" / "step-2")
    assert len(whole) == 4 and resumed == whole[2:], (whole, resumed)
    # (the masks do differ between steps: a resume that drew step 1's again would not match)
    assert len(set(whole)) == 4


def test_resume_with_an_empty_parameter_group(tmp_path):
    # train.no_decay=[]: the no-decay group is empty (as on a stage without biases or norms).
    full = _train(tmp_path / "full", "train.steps=3", "train.no_decay=[]", "checkpoint.every=2").losses
    resumed = _train(tmp_path / "resumed", "train.steps=3", "train.no_decay=[]",
                     resume=tmp_path / "full" / "checkpoints" / "step-2").losses
    assert resumed == pytest.approx(full[2:], rel=1e-6, abs=0)


def test_a_resume_trains_with_its_own_lr_weight_decay_and_betas_at_the_checkpoints_schedule_position(
        saved, tmp_path, caplog):
    # The loaded optimizer and LR schedule carried the saving run's values: resumed with
    # train.lr=0.03 (saved: 3e-3) it trained at the old rate, its config and summary saying 0.03.
    changed = ["train.lr=0.03", "train.weight_decay=0.5", "train.betas=[0.8,0.9]"]
    with caplog.at_level(logging.WARNING, logger="runner.checkpoint"):
        _train(tmp_path / "run", "train.steps=4", *changed, resume=saved / "checkpoints" / "step-1")
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    t = compose(*ONE, "train.steps=4", *changed).train
    want = [(s + 1, 0.03 * lr_factor(s, steps=4, warmup_steps=t.warmup_steps, min_lr_ratio=t.min_lr_ratio))
            for s in (1, 2, 3)]
    assert [(r["step"], r["lr"]) for r in records] == want
    said = " ".join(r.getMessage() for r in caplog.records if "other optimizer settings" in r.getMessage())
    for part in ("train.lr: 0.003 there, 0.03 here", "train.weight_decay: 0.1 there, 0.5 here",
                 "train.betas: [0.9, 0.95] there, [0.8, 0.9] here"):
        assert part in said
    # The same settings resume as before: the uninterrupted run's losses, and no warning.
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="runner.checkpoint"):
        again = _train(tmp_path / "again", "train.steps=2", resume=saved / "checkpoints" / "step-1").losses
    assert again == json.loads((saved / "summary.json").read_text())["losses"][1:]
    assert not [r for r in caplog.records if "other optimizer settings" in r.getMessage()]


def test_resuming_into_its_own_run_directory_keeps_its_history(tmp_path):
    run_dir = tmp_path / "run"
    common = [*ONE, "train.steps=4", "checkpoint.every=2", "checkpoint.keep=3", "eval.every=1"]
    first = launch(compose(*common), run_dir)
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3, 4]
    # Resume from step-2 into the same directory, for 6 steps: 1-2 kept, 3-4 replaced, 5-6 added.
    resumed = launch(compose(*common, "train.steps=6", f"checkpoint.resume={run_dir}/checkpoints/step-2"), run_dir)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert records[:2] == [json.loads(line) for line in lines[:2]]
    assert [r["loss"] for r in records[:4]] == pytest.approx(first["losses"], rel=1e-6, abs=0)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary == resumed and summary["first_step"] == 3 and summary["steps"] == 6
    assert summary["losses"] == [r["loss"] for r in records]
    assert [v["step"] for v in summary["val_losses"]] == [1, 2, 3, 4, 5, 6]


def test_an_asynchronous_save_returns_before_its_files_are_written_and_commits_after_them(tmp_path, monkeypatch):
    import threading

    import torch.distributed.checkpoint.filesystem as dcp_fs

    from runner.train import Trainer

    written, release = [], threading.Event()
    write_item = dcp_fs._write_item

    def held(*args, **kwargs):  # DCP's writes wait until the test lets them go
        assert threading.current_thread() is not threading.main_thread()
        assert release.wait(60)
        written.append(1)
        return write_item(*args, **kwargs)

    monkeypatch.setattr(dcp_fs, "_write_item", held)
    cfg = compose(*ONE, "train.steps=2", "checkpoint.every=1", "checkpoint.async_save=true")
    trainer = Trainer(validate(cfg, tmp_path), cfg, ENV)
    trainer.setup()
    trainer.step(0)
    trainer.checkpoint(1)  # returns with the writes still held
    checkpoints = tmp_path / "checkpoints"
    [partial] = list(checkpoints.iterdir())
    names = {p.name for p in partial.iterdir()}  # DCP may have opened its shard file, not written to it
    assert partial.name.startswith(".partial-step-1-") and not written
    assert {"rng-rank0.pt", "train_state.json"} <= names and not {".metadata", "manifest-rank0.json"} & names
    trainer.step(1)  # the next step does not wait for the save either
    release.set()
    trainer.checkpointer.wait()
    assert [p.name for p in checkpoints.iterdir()] == ["step-1"] and written
    assert (checkpoints / "step-1" / "manifest-rank0.json").is_file()
    state = json.loads((checkpoints / "step-1" / "train_state.json").read_text())
    assert state["step"] == 1 and state["lr_scheduler"]["last_epoch"] == 1  # as of the save, not of its commit
    trainer.checkpoint(2)
    trainer.checkpointer.wait()
    trainer.checkpointer.close()
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-1", "step-2"]
    assert find_checkpoint(str(tmp_path), tmp_path) == checkpoints / "step-2"
