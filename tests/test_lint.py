"""The tree is lint-clean and type-checks: ruff and mypy run here, so that CI's one ``pytest``
holds them (their settings: ``[tool.ruff]`` and ``[tool.mypy]`` in pyproject.toml). mypy keeps
its cache in ``.mypy_cache`` at the repository root: a rerun checks only what changed. It runs in
the background from the session's collection on, niced, and its test comes last (``helpers.lint``)."""

from __future__ import annotations

import pytest

from helpers import lint
from helpers.cli import run_cli
from helpers.config import ROOT

pytestmark = pytest.mark.multiprocess  # each runs a command line


@pytest.mark.timeout(120)
def test_ruff_finds_nothing():
    run_cli("check", "runner", "tests", "scripts", "bench", module="ruff", cwd=ROOT, timeout=100, check=True)


@pytest.mark.timeout(600)  # a cold cache (a clean clone, as CI's) takes about a minute on a quiet 2-core machine
def test_mypy_finds_nothing():
    # Started in the background when the session collected this test, run last (helpers.lint).
    done = lint.verdict(timeout=580)
    assert "Success: no issues found" in done.stdout, done.stdout
