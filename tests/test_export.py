"""``python -m runner.export`` never writes over what a user handed it and never half-writes: it
writes beside the target and renames, refuses a non-empty target (unless ``--overwrite``) and any
run directory, the model and the tokenizer the run used, ships the tokenizer the run trained with,
writes the source dtype unless told otherwise, and answers with the main CLI's exit codes.
In-process: one tiny Llama run (bf16 pretrained weights, a tied head, trained with another tokenizer than its
model directory's), its checkpoint exported many times."""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path

import pytest
import torch

from runner.checkpoint.files import TOKENIZER_DIR
from runner.checkpoint.resume_check import tokenizer_record
from runner.errors import ConfigError
from runner.export import export, main
from runner.validate import validate

from helpers.trained import run_config


@pytest.fixture(scope="module")
def trained(trained_llama) -> Path:
    """The session's tiny Llama run (``helpers.trained.train_tiny_llama``), shared with test_generate."""
    return trained_llama


def _main(*argv: str) -> int:
    with pytest.raises(SystemExit) as exit_info:
        main([*argv])
    return exit_info.value.code  # type: ignore[return-value]


def _listing(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def test_a_checkpoint_records_the_tokenizer_the_run_trained_with_and_export_ships_it(trained, tmp_path):
    step = trained / "run" / "checkpoints" / "step-2"
    state = json.loads((step / "train_state.json").read_text())
    assert state["tokenizer"] == tokenizer_record(str(trained / "tokenizer-b"))
    assert state["model_path"] == str(trained / "model")
    trained_with = (trained / "tokenizer-b" / "tokenizer.json").read_bytes()
    assert (step / TOKENIZER_DIR / "tokenizer.json").read_bytes() == trained_with
    manifest = json.loads((step / "manifest-rank0.json").read_text())["files"]
    assert "tokenizer/tokenizer.json" in manifest  # damage to it is caught like any other file's
    out = export(trained / "run", tmp_path / "out")
    assert (out / "tokenizer.json").read_bytes() == (trained / "tokenizer-b" / "tokenizer.json").read_bytes()
    assert (out / "tokenizer.json").read_bytes() != (trained / "model" / "tokenizer.json").read_bytes()


def test_resuming_with_another_tokenizer_is_refused_unless_allowed(trained, tmp_path, caplog):
    common = ["train.steps=3", f"checkpoint.resume={trained / 'run'}"]
    with pytest.raises(ConfigError) as info:
        validate(run_config(trained, trained / "model", *common), tmp_path)
    text = str(info.value)
    assert f"trained with tokenizer {trained / 'tokenizer-b'}" in text
    assert f"data.tokenizer is {trained / 'model'}" in text
    assert "Fix: data.tokenizer=" in text and "checkpoint.allow_tokenizer_change=true" in text
    allowed = run_config(trained, trained / "model", *common, "checkpoint.allow_tokenizer_change=true")
    resolved = validate(allowed, tmp_path)
    assert resolved.resume == trained / "run" / "checkpoints" / "step-2"
    assert "allow_tokenizer_change=true: continuing" in caplog.text
    assert validate(run_config(trained, trained / "tokenizer-b", *common), tmp_path).resume == resolved.resume


def test_export_writes_the_source_dtype_unless_told_with_the_umasks_modes(trained, tmp_path, capsys):
    from safetensors import safe_open

    def dtypes(directory: Path) -> set:
        with safe_open(directory / "model.safetensors", framework="pt") as f:
            return {f.get_tensor(k).dtype for k in f.keys()}

    main([str(trained / "run"), str(tmp_path / "default")])
    out = capsys.readouterr().out
    assert "weights in bf16 (the source model's dtype" in out and dtypes(tmp_path / "default") == {torch.bfloat16}
    assert json.loads((tmp_path / "default" / "config.json").read_text())["dtype"] == "bfloat16"
    umask = os.umask(0o022)
    try:
        main([str(trained / "run"), str(tmp_path / "fp32"), "--dtype", "fp32"])
    finally:
        os.umask(umask)
    modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "fp32").iterdir()}
    assert modes and set(modes.values()) == {0o644}, modes  # safetensors alone writes 0600: not shareable
    assert "weights in fp32 (--dtype)" in capsys.readouterr().out and dtypes(tmp_path / "fp32") == {torch.float32}
    assert _main("--help") == 0
    assert "default: the source model's dtype" in capsys.readouterr().out


def test_a_non_empty_target_is_refused_and_overwrite_replaces_it_whole(trained, tmp_path, capsys):
    target = tmp_path / "other-model"
    shutil.copytree(trained / "model", target)
    (target / "model.safetensors.index.json").write_text("{}")  # a stale index of another model
    before = _listing(target)
    assert _main(str(trained / "run"), str(target)) == 2
    err = capsys.readouterr().err
    assert f"output directory {target} is not empty" in err and "--overwrite" in err and "Traceback" not in err
    assert _listing(target) == before
    main([str(trained / "run"), str(target), "--overwrite"])
    after = _listing(target)
    assert "model.safetensors.index.json" not in after  # nothing of the old directory is left
    assert after["tokenizer.json"] == (trained / "tokenizer-b" / "tokenizer.json").read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other-model"]  # no temporary or old directory left


# Where an export never writes, with or without --overwrite: the run (itself, anything inside it, a
# directory holding it), the model directory and the tokenizer it trained with, and any other run.
PROTECTED = {"model": ("model", "the run's own model.path"), "inside the model": ("model/exported", "model.path"),
             "tokenizer": ("tokenizer-b", "the tokenizer the run trained with"),
             "run": ("run", "the run directory"), "checkpoint": ("run/checkpoints/step-2", "the run directory"),
             "another checkpoint": ("run/checkpoints/step-1", "is inside the run directory"),
             "hydra": ("run/.hydra", "is inside the run directory"),
             "checkpoint's tokenizer": ("run/checkpoints/step-2/tokenizer", "is inside the run directory"),
             "above the run": (".", "holds the run directory"),
             "another run": ("other-run/exported", "is inside a run directory")}


@pytest.mark.parametrize("where", list(PROTECTED))
def test_export_never_writes_into_a_run_or_the_model_or_tokenizer_it_used(trained, where, capsys):
    (trained / "run" / ".hydra").mkdir(exist_ok=True)  # as Hydra's runs hold it
    (trained / "other-run").mkdir(exist_ok=True)
    (trained / "other-run" / "resolved_config.yaml").write_text("model: {}\n")
    relative, named = PROTECTED[where]
    target = (trained / relative).resolve()
    before = _listing(trained)
    for overwrite in ([], ["--overwrite"]):
        assert _main(str(trained / "run"), str(target), *overwrite) == 2
        err = capsys.readouterr().err
        assert named in err and "even with --overwrite" in err and "Fix: " in err and "Traceback" not in err, err
    assert _listing(trained) == before and not (trained / "model" / "exported").exists()


def test_bad_arguments_exit_2_before_anything_is_written(trained, tmp_path, capsys):
    assert _main(str(trained / "run"), str(tmp_path / "out"), "--max-shard-size", "banana") == 2
    assert "--max-shard-size='banana' is not a memory size" in capsys.readouterr().err
    (tmp_path / "file").write_text("x")
    assert _main(str(trained / "run"), str(tmp_path / "file")) == 2
    assert "is an existing file" in capsys.readouterr().err
    (tmp_path / "empty-run" / "checkpoints").mkdir(parents=True)
    assert _main(str(tmp_path / "empty-run"), str(tmp_path / "out")) == 2
    err = capsys.readouterr().err
    assert f"python -m runner.export {tmp_path / 'empty-run'}: the run has no complete checkpoint" in err
    assert "checkpoint.resume" not in err and "checkpoint.every" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty-run", "file"]


def test_a_failed_or_killed_export_leaves_the_target_as_it_was(trained, tmp_path, monkeypatch, capsys):
    import transformers

    target = tmp_path / "previous"
    export(trained / "run", target)
    before = _listing(target)

    def fail(self, directory, **kwargs):
        (Path(directory) / "config.json").write_text("{}")  # what a killed export left behind
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(transformers.PreTrainedModel, "save_pretrained", fail)
    assert _main(str(trained / "run"), str(target), "--overwrite") == 3
    err = capsys.readouterr().err
    assert "No space left on device" in err and "Traceback" not in err and f"Nothing was written to {target}" in err

    def killed(self, directory, **kwargs):
        (Path(directory) / "config.json").write_text("{}")
        os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(transformers.PreTrainedModel, "save_pretrained", killed)
    previous = signal.getsignal(signal.SIGTERM)
    try:
        assert _main(str(trained / "run"), str(tmp_path / "new"), "--overwrite") == 143
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert _listing(target) == before and sorted(p.name for p in tmp_path.iterdir()) == ["previous"]


def test_without_a_recorded_model_path_the_runs_resolved_config_names_it(trained, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(trained / "run", run)
    state_file = run / "checkpoints" / "step-2" / "train_state.json"
    state = json.loads(state_file.read_text())
    del state["model_path"]  # as saved before checkpoints recorded it
    state_file.write_text(json.dumps(state))
    assert f"path: {trained / 'model'}" in (run / "resolved_config.yaml").read_text()
    assert _main(str(run), str(trained / "model"), "--overwrite") == 2
    assert "is the run's own model.path" in capsys.readouterr().err
