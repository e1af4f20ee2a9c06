"""Every command the README and the docs/ pages show composes and passes the pre-launch checks, so
the documentation cannot drift from the code. Commands are taken from the pages themselves (code
blocks and inline code); sweeps are expanded as Hydra's basic sweeper expands them; nothing is
spawned."""

from __future__ import annotations

import re
import shlex

import pytest
from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from hydra._internal.config_loader_impl import ConfigLoaderImpl
from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra._internal.utils import create_config_search_path
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import open_dict

from runner.validate import validate

from helpers.config import EXAMPLES, ROOT

# Placeholders the README uses for what a user supplies, and what stands in for them here.
PLACEHOLDERS = {
    "<run>/schedule.csv": str(EXAMPLES / "gpipe_pp2_m4.csv"),  # a run's recorded order (pp=2, m=4)
    "mypkg.models.build": "runner.models.transformer",  # the user's factory
}


def _hugging_face_stand_ins() -> dict[str, str]:
    """The README's Hugging Face model directory and dataset: a tiny Llama with a tokenizer, and a
    jsonl file, written into a temporary directory (nothing is downloaded)."""
    import json
    import tempfile
    from pathlib import Path

    from helpers.hf import write_model, write_tokenizer

    root = Path(tempfile.mkdtemp(prefix="readme-"))
    model = write_tokenizer(write_model(root / "llama-1b", "llama", weights=True))
    corpus = root / "corpus.jsonl"
    corpus.write_text("\n".join(json.dumps({"text": "the pipeline stage runs forward and backward " * 40})
                                for _ in range(20)))
    return {"~/models/llama-1b": str(model), "data.path=corpus.jsonl": f"data.path={corpus}"}
# What follows `runner`/`python -m runner` in a shell command (the runner's own arguments).
_COMMAND = re.compile(r"^(?:.*&&\s*|srun\s+|torchrun\s.*?-m\s+)?"  # a shell prefix
                      r"(?:python -m (runner(?:\.plan)?)|(runner))(?=\s|$)(.*)$")


def _shell_commands(text: str) -> list[str]:
    """Commands in the README: lines of fenced code blocks, and inline code spans."""
    commands, fenced, continued = [], False, ""
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
            continue
        if fenced:
            line = continued + line.split("  #")[0].strip()  # a trailing comment
            continued = line[:-1] + " " if line.endswith("\\") else ""  # a command continued on the next line
            if not continued:
                commands.append(line)
        else:
            commands += re.findall(r"`([^`]*\brunner\b[^`]*)`", line)
    return commands


def readme_commands() -> list[tuple[str, str, list[str]]]:
    """(the command as shown, the module it runs: runner or runner.plan, its arguments)."""
    found, placeholders = [], dict(PLACEHOLDERS)
    text = "\n".join(p.read_text() for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))])
    if "model=hf" in text:
        placeholders.update(_hugging_face_stand_ins())
    for shown in _shell_commands(text):
        match = _COMMAND.search(shown)
        if not match or "..." in shown:  # `...` marks a fragment of a command, not one to run
            continue
        rest = match.group(3)
        if set(shlex.split(rest)) & {"--version", "--help", "-sc", "--hydra-help"}:  # runs nothing
            continue
        for placeholder, value in placeholders.items():
            rest = rest.replace(placeholder, value)
        found.append((shown, match.group(1) or "runner", shlex.split(rest)))
    return found


def _jobs(args: list[str]) -> list[list[str]]:
    """The overrides of each job the command runs: one, or a sweep's, expanded by Hydra."""
    if "-m" not in args and "--multirun" not in args:
        return [args]
    overrides = [a for a in args if a not in ("-m", "--multirun")]
    loader = ConfigLoaderImpl(config_search_path=create_config_search_path(str(ROOT / "conf")))
    parsed = OverridesParser.create(config_loader=loader).parse_overrides(overrides)
    [batch] = BasicSweeper.split_arguments(parsed, max_batch_size=None)
    return batch


COMMANDS = readme_commands()


def test_the_readme_shows_the_commands_this_test_checks():
    shown = [c for c, _, _ in COMMANDS]
    assert len(shown) >= 15  # the extraction found them
    for expected in ("python -m runner schedule=zbv parallel.microbatches=8",
                     "python -m runner -m hparams_search=optuna",
                     "runner experiment=smoke"):
        assert any(c.startswith(expected) for c in shown), expected
    assert any(module == "runner.plan" for _, module, _ in COMMANDS)


@pytest.mark.parametrize("shown,module,args", COMMANDS, ids=[c for c, _, _ in COMMANDS])
def test_every_readme_command_passes_the_pre_launch_checks(shown, module, args, monkeypatch, tmp_path):
    monkeypatch.chdir(ROOT)  # the README's relative paths (examples/, README.md) are from the checkout
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # tokenized data goes here, not in the home
    assert not any(re.search(r"<[^>]*>", a) for a in args), f"a placeholder with no stand-in: {shown}"
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        for job in _jobs(args):
            cfg = hydra_compose("config", overrides=job, return_hydra_config=True)
            with open_dict(cfg):
                del cfg["hydra"]
            validate(cfg)
