"""The tree is lint-clean and type-checks: ruff and mypy run here, so that CI's one ``pytest``
holds them (their settings: ``[tool.ruff]`` and ``[tool.mypy]`` in pyproject.toml). mypy keeps
its cache in ``.mypy_cache`` at the repository root: a rerun checks only what changed."""

from __future__ import annotations

import os

import pytest

from helpers.cli import run_cli
from helpers.config import ROOT

pytestmark = pytest.mark.multiprocess  # each runs a command line


@pytest.mark.timeout(120)
def test_ruff_finds_nothing():
    run_cli("check", "runner", "tests", "scripts", "bench", module="ruff", cwd=ROOT, timeout=100, check=True)


@pytest.mark.timeout(600)  # a cold cache (a clean clone, as CI's) takes about a minute on a quiet 2-core machine
def test_mypy_finds_nothing():
    # Two worker processes where there are two cores: cold, 44 -> 35 s on a quiet 2-core machine
    # (mypy checks the ~7,700 modules runner/ imports, transformers' and torch's most of them).
    workers = ["--num-workers", "2"] if len(os.sched_getaffinity(0)) >= 2 else []
    done = run_cli(*workers, module="mypy", cwd=ROOT, timeout=580, check=True)  # the files and options: [tool.mypy]
    assert "Success: no issues found" in done.stdout, done.stdout
