"""The runner as users install it: a wheel built from this tree, installed (not editable) into a
fresh environment, and its ``runner`` console script run from a directory that is not a checkout.
The environment sees this one's packages (torch, Hydra) so that nothing is downloaded."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT


def _run(*args: str, cwd: Path, env: dict, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> tuple[Path, dict]:
    """(the environment's bin directory, an environment for its commands)."""
    tmp = tmp_path_factory.mktemp("packaging")
    source = tmp / "source"  # a copy: building writes build/ and *.egg-info next to the sources
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    for name in ("runner", "conf"):
        shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "HYDRA_FULL_ERROR")}
    built = _run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp / "dist"),
                 str(source), cwd=tmp, env=env)
    assert built.returncode == 0, built.stderr
    [wheel] = (tmp / "dist").glob("runner-*.whl")
    venv = tmp / "venv"
    created = _run(sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv), cwd=tmp, env=env)
    assert created.returncode == 0, created.stderr
    bin_dir = venv / "bin"
    done = _run(str(bin_dir / "python"), "-m", "pip", "install", "--no-deps", "--no-index", str(wheel), cwd=tmp,
                env=env)
    assert done.returncode == 0, done.stderr
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    return bin_dir, env


@pytest.mark.timeout(180)
def test_the_installed_console_script_runs_from_any_directory_with_the_shipped_configs(installed, tmp_path):
    bin_dir, env = installed
    version = _run("runner", "--version", cwd=tmp_path, env=env)
    assert version.returncode == 0, version.stderr
    site = bin_dir.parent / "lib"
    import hydra
    import torch

    line = version.stdout.strip()
    assert line.startswith("runner 0.1.0 (torch ") and torch.__version__ in line and hydra.__version__ in line
    assert f"Python {sys.version.split()[0]}" in line and f"configs: {site}" in line  # inside the installed package

    done = _run("runner", "experiment=smoke", "train.steps=2", "profile.enabled=false", cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stderr
    [run_dir] = tmp_path.glob("outputs/*/*")
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["runner_version"] == "0.1.0"
    assert summary["git_commit"] is None  # an installed package is no checkout
    assert Path(summary["config"]) == run_dir.resolve() / "resolved_config.yaml"
    assert "name: 1f1b" in Path(summary["config"]).read_text()


@pytest.mark.timeout(60)
def test_shell_completion_through_the_console_script_offers_groups_options_and_keys(installed, tmp_path):
    _, env = installed
    # What bash does on <TAB>: the function the install script defines, on the words typed so far.
    script = """
eval "$(runner -sc install=bash)"
for line in "runner sched" "runner schedule=z" "runner train.st" "runner experiment=sm"; do
    COMP_LINE="$line"; COMP_POINT=${#line}; read -a COMP_WORDS <<< "$line"; COMP_CWORD=$((${#COMP_WORDS[@]} - 1))
    hydra_bash_completion
    echo "${COMPREPLY[*]}"
done
"""
    done = _run("bash", "-c", script, cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stderr
    groups, options, keys, experiments = done.stdout.splitlines()
    assert (groups, options, keys) == ("schedule. schedule=", "schedule=zbv", "train.steps=")
    assert {"experiment=smoke", "experiment=smoke_zbv"} <= set(experiments.split())
