"""Every command the README and the docs/ pages show runs as written, so the documentation cannot
drift from the code. Commands are taken from the pages themselves (code blocks and inline code):
`python -m runner`, `runner`, `python -m runner.plan`, `python -m runner.export` and `python -m
runner.generate`. A `...` the
page leaves for the reader is filled with a small config (``FILL``); `<...>` placeholders with a
stand-in. The commands' relative paths and `~` resolve as a user's would: from a working directory
holding what the pages assume (a corpus.jsonl, a finished run under outputs/; no examples/: the
pages name the shipped example schedules and text, which resolve from any directory), with a home
directory holding the Hugging Face model ~/models/llama-1b.

Each command composes, and passes the pre-launch checks (sweeps expanded as Hydra's basic sweeper
expands them; the planner's own keys as the planner checks them; a sampling command's settings as
``runner.generate`` checks them before loading anything); nothing is spawned there. The
Hugging Face command and the export after it really run, through the shell, as written (with the
steps, the sequence length and the checkpoint interval made small)."""

from __future__ import annotations

import json
import re
import shlex
import sys
from pathlib import Path

import pytest
from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from hydra._internal.config_loader_impl import ConfigLoaderImpl
from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra._internal.utils import create_config_search_path
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import open_dict

from runner.exits import expand_home
from runner.launch import launch
from runner.plan.planner import check_plan_keys
from runner.validate import validate

from helpers.cli import run_cli
from helpers.config import ROOT, TINY, compose

# What a user supplies, and what stands in for it here.
PLACEHOLDERS = {
    "<run>/schedule.csv": "gpipe_pp2_m4",  # a run's recorded order (pp=2, m=4): a shipped example, by name
    "outputs/<date>/<time>": "outputs/day/time",  # a finished run (the `workdir` fixture's)
    "mypkg.models.build": "runner.models.builtin.transformer",  # the user's factory
    "<run dir or checkpoint>": "outputs/day/time", "<run dir>": "outputs/day/time",  # runner.generate's
    " [key=value ...]": "",  # the settings a syntax line leaves open
}
FILL = "experiment=smoke"  # for a `...` standing for the rest of a command
# What follows `runner`, `python -m runner`, `python -m runner.plan` or `python -m runner.export`.
_COMMAND = re.compile(r"^(?:.*&&\s*|srun\s+|torchrun\s.*?-m\s+)?"  # a shell prefix
                      r"(?:python -m (runner(?:\.plan|\.export|\.generate)?)|(runner))(?=\s|$)(.*)$")
# The real run's small values: seconds on 2 cores instead of a 1B model's training.
SMALL = {"train.seq_len=1024": "train.seq_len=16", "checkpoint.every=10": "checkpoint.every=2"}
SHORT = " train.steps=2"


def _shell_commands(text: str) -> list[str]:
    """Commands in the pages: lines of fenced code blocks (a line ending in `\\` continues on the
    next), and inline code spans."""
    commands, fenced, continued = [], False, ""
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
            continue
        if fenced:
            line = continued + line.split("  #")[0].strip()  # a trailing comment
            continued = line[:-1] + " " if line.endswith("\\") else ""
            if not continued:
                commands.append(line)
        else:
            commands += re.findall(r"`([^`]*\brunner\b[^`]*)`", line)
    return commands


def _filled(shown: str) -> str:
    """The command with its `...` (a word of its own) filled and its placeholders stood in for."""
    command = re.sub(r"(?<=\s)\.\.\.(?=\s|$)", FILL, shown)
    for placeholder, value in PLACEHOLDERS.items():
        command = command.replace(placeholder, value)
    return command


def readme_commands() -> list[tuple[str, str, str]]:
    """(the command as shown, the module it runs, its arguments as the shell would pass them) of
    every command in the README and docs/, once each."""
    found: dict[str, tuple[str, str, str]] = {}
    pages = [p for p in sorted((ROOT / "docs").glob("*.md")) if p.name != "failure-modes.md"]  # its commands
    text = "\n".join(p.read_text() for p in [ROOT / "README.md", *pages])  # fail on purpose: test_failure_modes
    for shown in _shell_commands(text):
        match = _COMMAND.search(_filled(shown))
        if match is None:
            continue
        module, rest = match.group(1) or "runner", match.group(3)
        if module in ("runner.export", "runner.generate") and not rest.strip():  # named in a sentence, not run
            continue
        found.setdefault(shown, (shown, module, rest))
    return list(found.values())


COMMANDS = readme_commands()


def test_the_pages_show_the_commands_this_test_checks():
    shown = [c for c, _, _ in COMMANDS]
    assert len(shown) >= 30  # the extraction found them
    for expected in ("python -m runner schedule=zbv parallel.microbatches=8",
                     "python -m runner -m hparams_search=optuna",
                     "runner experiment=smoke",
                     "python -m runner.plan ... plan.costs=outputs/<date>/<time>",  # elided: filled
                     "srun python -m runner ...",
                     "python -m runner.export outputs/<date>/<time> ~/models/llama-1b-trained",
                     'python -m runner.generate outputs/<date>/<time> prompt="The pipeline"'):
        assert expected in shown, expected
    assert {module for _, module, _ in COMMANDS} == {"runner", "runner.plan", "runner.export", "runner.generate"}
    assert len(_hugging_face_commands()) == 1  # the README's and models.md's are the same command


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> tuple[Path, Path]:
    """(a working directory as the pages assume one, a home directory with ~/models/llama-1b)."""
    from helpers.hf import write_model, write_tokenizer

    root = tmp_path_factory.mktemp("readme")
    home, work = root / "home", root / "work"
    # As a real Llama takes the README's train.seq_len=1024 (checked against config.json before launch).
    write_tokenizer(write_model(home / "models" / "llama-1b", "llama", weights=True, max_position_embeddings=2048))
    # docs/rehearsal.md's 256-rank layout: a 0.5B Llama shape, its config.json alone (model.pretrained=false).
    write_model(home / "models" / "llama-0.5b", "llama", weights=False, hidden_size=1024, intermediate_size=4864,
                num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=8, vocab_size=32000,
                max_position_embeddings=2048)
    work.mkdir()
    # Nothing of the checkout (no examples/, no README.md): shipped examples resolve by name.
    (work / "corpus.jsonl").write_text("\n".join(
        json.dumps({"text": "the pipeline stage runs forward and backward " * 40}) for _ in range(20)))
    # A finished run (one rank, in this process) for `plan.costs=outputs/<date>/<time>`.
    launch(compose(*TINY, "parallel.pp=1", "parallel.microbatches=2", "train.batch_size=4", "train.steps=2",
                   "profile.enabled=true"), work / "outputs" / "day" / "time")
    return work, home


def _jobs(args: list[str]) -> list[list[str]]:
    """The overrides of each job the command runs: one, or a sweep's, expanded by Hydra."""
    if "-m" not in args and "--multirun" not in args:
        return [args]
    overrides = [a for a in args if a not in ("-m", "--multirun")]
    loader = ConfigLoaderImpl(config_search_path=create_config_search_path(str(ROOT / "conf")))
    parsed = OverridesParser.create(config_loader=loader).parse_overrides(overrides)
    [batch] = BasicSweeper.split_arguments(parsed, max_batch_size=None)
    return batch


_CONFIG_COMMANDS = [c for c in COMMANDS if c[1] not in ("runner.export", "runner.generate")]
_GENERATE_COMMANDS = [c for c in COMMANDS if c[1] == "runner.generate"]


@pytest.mark.parametrize("shown,module,rest", _GENERATE_COMMANDS, ids=[c for c, _, _ in _GENERATE_COMMANDS])
def test_every_sampling_command_names_a_run_or_checkpoint_and_settings_generate_takes(shown, module, rest):
    from runner.generate import parse_settings

    source, *words = shlex.split(rest)
    assert not any(re.search(r"<[^>]*>", a) for a in words), f"a placeholder with no stand-in: {shown}"
    assert re.fullmatch(r"outputs/day/time(/checkpoints/step-\d+)?", source), shown
    parse_settings(words).check()  # what runner.generate checks before it loads anything


@pytest.mark.parametrize("shown,module,rest", _CONFIG_COMMANDS, ids=[c for c, _, _ in _CONFIG_COMMANDS])
def test_every_command_passes_the_pre_launch_checks(shown, module, rest, workdir, monkeypatch, tmp_path):
    work, home = workdir
    monkeypatch.chdir(work)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # tokenized data goes here, not in the home
    args = shlex.split(rest)  # as the shell passes them: `~` after `key=` stays (its own word: see below)
    assert not any(re.search(r"<[^>]*>", a) for a in args), f"a placeholder with no stand-in: {shown}"
    if set(args) & {"--version", "--help", "-sc", "--hydra-help"}:  # prints, runs nothing: Hydra's or ours
        return
    args = expand_home(args)  # what the command line does first
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        for job in _jobs(args):
            cfg = hydra_compose("config", overrides=job, return_hydra_config=True)
            with open_dict(cfg):
                del cfg["hydra"]
            if module == "runner.plan":
                check_plan_keys(cfg)
            validate(cfg)


def _hugging_face_commands() -> list[str]:
    """The command that trains a Hugging Face model on a local dataset (others only name model=hf)."""
    return sorted({c for c, module, rest in COMMANDS
                   if module == "runner" and "model=hf" in rest and "data=hf" in rest})


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_the_hugging_face_command_and_the_export_run_as_written(workdir, tmp_path):
    from transformers import AutoModelForCausalLM

    work, model_home = workdir
    home = tmp_path / "home"  # the export writes ~/models/llama-1b-trained here
    (home / "models").mkdir(parents=True)
    (home / "models" / "llama-1b").symlink_to(model_home / "models" / "llama-1b")
    (tmp_path / "corpus.jsonl").symlink_to(work / "corpus.jsonl")
    env = {"HOME": str(home), "PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "XDG_CACHE_HOME": str(tmp_path)}
    [trained] = _hugging_face_commands()
    for value, small in SMALL.items():
        assert value in trained, f"{value}: the README's command changed; update SMALL"
        trained = trained.replace(value, small)
    done = run_cli("-c", trained + SHORT, program=["bash"], cwd=tmp_path, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    [run_dir] = tmp_path.glob("outputs/*/*")
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["verify"]["passed"] and summary["pp"] == 4
    assert (run_dir / "checkpoints" / "step-2").is_dir()

    [export] = [c for c, module, _ in COMMANDS if module == "runner.export"]
    done = run_cli("-c", export.replace("outputs/<date>/<time>", str(run_dir.relative_to(tmp_path))),
                   program=["bash"], cwd=tmp_path, env=env, timeout=200)
    assert done.returncode == 0, done.stderr[-3000:]
    out = home / "models" / "llama-1b-trained"  # `~` is the shell's: its own word
    assert (out / "config.json").is_file() and (out / "tokenizer.json").is_file()
    exported = AutoModelForCausalLM.from_pretrained(out)
    initial = AutoModelForCausalLM.from_pretrained(model_home / "models" / "llama-1b")
    weight = "model.embed_tokens.weight"
    assert exported.state_dict()[weight].shape == initial.state_dict()[weight].shape
    assert not exported.state_dict()[weight].equal(initial.state_dict()[weight])  # trained, then exported
