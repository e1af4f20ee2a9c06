"""What a resume (and the launcher, and export) reads from a checkpoint is bounded and checked
before any rank starts: sizes by what is on disk, tensors against the configured model; verify on
a resumed run compares against the checkpoint's weights; a command refused because its run
directory is in use writes nothing into it. In-process but for one command line."""

from __future__ import annotations

import json
import pickle
import shutil
import time
from pathlib import Path

import pytest
import torch

from runner._torch.dcp import SafeReader, read_model_tensors
from runner.checkpoint.files import find_checkpoint
from runner.errors import CheckpointError, ConfigError, Rejected
from runner.ranks.dist import DistEnv
from runner.rundir import RunDirGuard, hold_run_lock
from runner.train import train
from runner.validate import validate

from helpers.cli import run_cli
from helpers.config import ROOT, TINY, compose
from helpers.hf import write_model

ONE = [*TINY, "parallel.pp=1", "parallel.microbatches=2", "train.batch_size=4"]
ENV = DistEnv(0, 1, torch.device("cpu"))


def _train(run_dir: Path, *overrides: str, base: list[str] = ONE) -> dict:
    cfg = compose(*base, *overrides)
    run_dir.mkdir(parents=True, exist_ok=True)
    return train(validate(cfg, run_dir), cfg, ENV).summary


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A run of the tiny 6-block model: checkpoint step-2."""
    run_dir = tmp_path_factory.mktemp("guards") / "run"
    _train(run_dir, "train.steps=2", "checkpoint.every=2")
    return run_dir


@pytest.fixture
def step(saved, tmp_path) -> Path:
    """A copy of the saved checkpoint, free to damage."""
    copy = tmp_path / "run" / "checkpoints" / "step-2"
    shutil.copytree(saved / "checkpoints" / "step-2", copy)
    return copy


@pytest.mark.timeout(30)
def test_a_world_size_beyond_what_is_on_disk_is_refused_before_anything_is_sized_by_it(step):
    state = json.loads((step / "train_state.json").read_text())
    (step / "train_state.json").write_text(json.dumps({**state, "world_size": 10**12}))
    started = time.monotonic()
    with pytest.raises(ConfigError, match=r"world_size 1000000000000, but the directory holds the RNG state of "
                                          r"only 1 ranks") as info:
        find_checkpoint(str(step), step.parent.parent)
    assert str(step / "train_state.json") in str(info.value)
    with pytest.raises(ConfigError, match="no complete checkpoint"):  # the run directory: the step is skipped
        find_checkpoint(str(step.parent.parent), step.parent.parent)
    assert time.monotonic() - started < 5


@pytest.mark.timeout(30)
def test_metadata_describing_more_than_the_shards_hold_allocates_nothing(step):
    metadata = SafeReader(str(step)).read_metadata()
    key = next(k for k in metadata.state_dict_metadata if k.startswith("model."))
    metadata.state_dict_metadata[key].size = torch.Size([10**6, 10**6])  # 4 TB of float32
    (step / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(CheckpointError, match=r"describes \d+ bytes of model tensors, its shards hold \d+ bytes"):
        read_model_tensors(step)


def test_resuming_into_a_model_with_fewer_layers_is_refused_before_launch(saved, tmp_path):
    cfg = compose(*ONE, "model.n_layers=4", "train.steps=3", f"checkpoint.resume={saved}")
    with pytest.raises(ConfigError) as info:
        validate(cfg, tmp_path)
    text = str(info.value)
    assert "holds 24 tensors the configured model lacks: block4 (12 tensors), block5 (12 tensors);" in text
    assert "Fix: the model config the checkpoint was trained with" in text
    wider = compose(*ONE, "model.dim=48", "train.steps=3", f"checkpoint.resume={saved}")
    with pytest.raises(ConfigError, match=r"tensors of other shapes: .*\(the model's \(48"):
        validate(wider, tmp_path)


@pytest.mark.timeout(60)
def test_resuming_with_the_embedding_tie_changed_is_refused_before_launch(saved, tmp_path, caplog):
    """A tied weight is stored once, under the embedding's name: an untied checkpoint resumed with
    the tie loaded the embedding alone into both, its trained head dropped without a word (the
    loss went from 3.87 to 19.97 at the resume in a probe); a tied one resumed untied failed on
    every rank after the launch."""
    tied = compose(*ONE, "model.tie_embeddings=true", "train.steps=3", f"checkpoint.resume={saved}")
    with pytest.raises(ConfigError, match=r"holds head\.weight as a weight of its own, where the configured model "
                                          r"ties head\.weight to embed\.tok\.weight .*Fix: the checkpoint's untied "
                                          r"model \(model\.tie_embeddings=false"):
        validate(tied, tmp_path / "a")
    tied_run = tmp_path / "tied"
    _train(tied_run, "model.tie_embeddings=true", "train.steps=2", "checkpoint.every=2")
    validate(compose(*ONE, "model.tie_embeddings=true", "train.steps=3", f"checkpoint.resume={tied_run}"),
             tmp_path / "b")  # the tie kept: resumes
    untied = compose(*ONE, "train.steps=3", f"checkpoint.resume={tied_run}")
    with pytest.raises(ConfigError, match=r"lacks 1 tensor the configured model has: head\.weight .*Fix: the model "
                                          r"config the checkpoint was trained with \(the same model\.tie_embeddings"):
        validate(untied, tmp_path / "c")
    # Saved before checkpoints recorded their data position, a pp=1 tied run stored the copy too: warned, not refused.
    old = tmp_path / "old" / "checkpoints" / "step-2"
    shutil.copytree(saved / "checkpoints" / "step-2", old)
    state = json.loads((old / "train_state.json").read_text())
    (old / "train_state.json").write_text(json.dumps({k: v for k, v in state.items() if k != "data_position"}))
    validate(compose(*ONE, "model.tie_embeddings=true", "train.steps=3", f"checkpoint.resume={old}"), tmp_path / "d")
    assert "it may be a tied model's saved under both names" in caplog.text


@pytest.mark.timeout(30)
def test_a_resume_with_other_model_settings_of_the_same_shapes_is_warned_of(saved, tmp_path, caplog):
    """Another model.n_heads fits the checkpoint's tensors and computes something else from them
    (the losses after a probe's resume: 4.243, not 4.192): said before launch, naming the key and
    both values; the saving run's own settings are not."""
    validate(compose(*ONE, "train.steps=3", f"checkpoint.resume={saved}"), tmp_path / "same")
    assert "other model settings" not in caplog.text
    validate(compose(*ONE, "model.n_heads=2", "train.steps=3", f"checkpoint.resume={saved}"), tmp_path / "heads")
    assert "was trained with other model settings (model.n_heads=4 there, 2 here)" in caplog.text


@pytest.mark.parametrize("model", ["tiny", "gpt2"])
def test_verify_on_a_resumed_run_compares_against_the_checkpoints_weights(model, tmp_path):
    base = ONE if model == "tiny" else [  # GPT-2: its head tied to the embedding, stored once
        "device=cpu", "model=hf", f"model.path={write_model(tmp_path / 'gpt2', 'gpt2', weights=False)}",
        "model.pretrained=false", "data.vocab_size=64", "train.seq_len=16", "profile.enabled=false", *ONE[-3:]]
    _train(tmp_path / "first", "train.steps=2", "checkpoint.every=2", base=base)
    summary = _train(tmp_path / "resumed", "train.steps=3", "verify=true", f"checkpoint.resume={tmp_path / 'first'}",
                     base=base)
    assert summary["first_step"] == 3 and summary["verify"]["passed"], summary["verify"]["problems"]
    assert summary["verify"]["max_abs_diff"] < 1e-5
    # The reference updated from the checkpoint's AdamW state and LR schedule, as the run did.
    weights = summary["verify"]["steps"][0]["weights"]
    assert weights["passed"] and weights["max_lr_units"] < 0.01, weights


def _hydra_config(run_dir: Path):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return hydra_compose("config", overrides=[f"hydra.run.dir={run_dir}"], return_hydra_config=True)


def test_the_run_directory_guard_refuses_a_directory_in_use(tmp_path):
    run_dir = tmp_path / "live"
    run_dir.mkdir()
    config = _hydra_config(run_dir)
    RunDirGuard().on_run_start(config=config)  # not in use: nothing to say
    with hold_run_lock(run_dir):
        with pytest.raises(Rejected) as info:
            RunDirGuard().on_run_start(config=config)
    assert isinstance(info.value.error, ConfigError) and "is in use by another run" in str(info.value.error)


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_command_refused_because_its_run_directory_is_in_use_writes_nothing_into_it(tmp_path):
    live = tmp_path / "live"
    (live / ".hydra").mkdir(parents=True)
    for name in ("config.yaml", "overrides.yaml", "hydra.yaml"):
        (live / ".hydra" / name).write_text(f"the live run's {name}\n")
    (live / "runner.log").write_text("the live run's log\n")
    before = {p.name: p.read_bytes() for p in live.rglob("*") if p.is_file()}
    with hold_run_lock(live):  # the live run, in progress
        done = run_cli(*TINY, f"hydra.run.dir={live}", cwd=tmp_path, timeout=90)
    assert done.returncode == 2, done.stderr
    assert "is in use by another run that is still in progress; nothing was written into it" in done.stderr
    assert "Traceback" not in done.stderr
    after = {p.name: p.read_bytes() for p in live.rglob("*") if p.is_file()}
    assert after == {**before, ".runner.lock": b""}  # the lock file the live run holds, as it was


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_verify_on_a_pipelined_resume_reads_the_checkpoint_on_rank_0_alone(saved, tmp_path):
    from runner.launch import launch

    cfg = compose(*TINY, "parallel.pp=2", "parallel.microbatches=2", "train.batch_size=4", "train.steps=3",
                  "verify=true", f"checkpoint.resume={saved}")
    summary = launch(cfg, tmp_path / "pp2")
    assert summary is not None and summary["first_step"] == 3 and summary["verify"]["passed"]
