"""The runner as users install it: a wheel built from this tree, installed (not editable) into a
fresh environment, and its ``runner`` console script run from a directory that is not a checkout.
The environment sees this one's packages (torch, Hydra) so that nothing is downloaded: whatever
this interpreter is (a system Python, or itself a virtual environment, whose base Python has no
Hydra: ``--system-site-packages`` would not see them), its site directories are added to the new
environment's, ``.pth`` files (editable installs) included."""

from __future__ import annotations

import json
import os
import shutil
import site
import sys
from pathlib import Path

import pytest

from helpers.cli import run_cli
from helpers.config import ROOT

pytestmark = pytest.mark.multiprocess


def _see_this_environment(venv: Path) -> None:
    """``venv`` sees this interpreter's packages after its own (its own wheel of the runner
    first): a ``.pth`` file adding this interpreter's site directories as Python's ``site`` adds
    them, so their ``.pth`` files run too. This checkout is not among them."""
    dirs = [*site.getsitepackages(), *([site.getusersitepackages()] if site.ENABLE_USER_SITE else [])]
    [own] = venv.glob("lib/python*/site-packages")
    (own / "zz_parent_environment.pth").write_text(
        "".join(f"import site; site.addsitedir({d!r})\n" for d in dirs if Path(d).is_dir()))


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> tuple[Path, dict]:
    """(the environment's bin directory, the variables its commands run with: its bin first on PATH)."""
    tmp = tmp_path_factory.mktemp("packaging")
    source = tmp / "source"  # a copy: building writes build/ and *.egg-info next to the sources
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    for name in ("runner", "conf", "examples"):
        shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
    # checkout=False: nothing of this checkout on PYTHONPATH; the installed package is what runs.
    run_cli("wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp / "dist"), str(source), module="pip",
            cwd=tmp, checkout=False, check=True)
    [wheel] = (tmp / "dist").glob("runner-*.whl")
    venv = tmp / "venv"
    run_cli("--without-pip", str(venv), module="venv", cwd=tmp, checkout=False, check=True)
    _see_this_environment(venv)
    bin_dir = venv / "bin"
    run_cli("install", "--no-deps", "--no-index", str(wheel), program=[str(bin_dir / "python"), "-m", "pip"], cwd=tmp,
            checkout=False, check=True)
    return bin_dir, {"PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}


@pytest.mark.timeout(180)
def test_the_installed_console_script_runs_from_any_directory_with_the_shipped_configs(installed, tmp_path):
    bin_dir, env = installed
    version = run_cli("--version", program=["runner"], cwd=tmp_path, env=env, checkout=False)
    assert version.returncode == 0, version.stderr
    site = bin_dir.parent / "lib"
    import hydra
    import torch

    line = version.stdout.strip()
    assert line.startswith("runner 0.1.0 (torch ") and torch.__version__ in line and hydra.__version__ in line
    assert f"Python {sys.version.split()[0]}" in line and f"configs: {site}" in line  # inside the installed package

    done = run_cli("experiment=smoke", "train.steps=2", "profile.enabled=false", program=["runner"], cwd=tmp_path,
                   env=env, checkout=False)
    assert done.returncode == 0, done.stderr
    [run_dir] = tmp_path.glob("outputs/*/*")
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["runner_version"] == "0.1.0"
    assert summary["git_commit"] is None  # an installed package is no checkout
    assert Path(summary["config"]) == run_dir.resolve() / "resolved_config.yaml"
    assert "name: 1f1b" in Path(summary["config"]).read_text()


@pytest.mark.timeout(60)
def test_the_installed_example_schedules_resolve_by_name_from_any_directory(installed, tmp_path):
    """``schedule.csv=<name>`` reads the example the wheel ships (runner/examples), with no examples/
    in the working directory: the pre-launch check that reads it (the file's microbatch count
    against the config's) is enough, nothing is spawned."""
    bin_dir, env = installed
    done = run_cli("experiment=smoke", "schedule=csv", "schedule.csv=zero_bubble_pp2_m4", "parallel.pp=2",
                   "parallel.microbatches=2", program=["runner"], cwd=tmp_path, env=env, checkout=False)
    assert done.returncode == 2, done.stderr
    [shipped] = (bin_dir.parent / "lib").glob("python*/site-packages/runner/examples/zero_bubble_pp2_m4.csv")
    assert f"schedule.csv={str(shipped)!r} schedules 4 microbatches" in done.stderr
    assert "Fix: parallel.microbatches=4" in done.stderr
    # The installed runner-schedule-csv writes the order the example holds.
    done = run_cli("gpipe", "--pp", "2", "--microbatches", "4", program=[str(bin_dir / "runner-schedule-csv")],
                   cwd=tmp_path, env=env, checkout=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout == (shipped.parent / "gpipe_pp2_m4.csv").read_text()
    assert (bin_dir / "runner-timeline").is_file() and (bin_dir / "runner-generate").is_file()
    assert (shipped.parent / "example_corpus.txt").is_file()  # data.path=example_corpus.txt, by name


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
    done = run_cli("-c", script, program=["bash"], cwd=tmp_path, env=env, checkout=False)
    assert done.returncode == 0, done.stderr
    groups, options, keys, experiments = done.stdout.splitlines()
    assert (groups, keys) == ("schedule. schedule=", "train.steps=")
    assert options == "schedule=zbh1 schedule=zbh2 schedule=zbv"
    assert {"experiment=smoke", "experiment=smoke_zbv"} <= set(experiments.split())
