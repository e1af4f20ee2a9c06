"""The tree is lint-clean and type-checks: ruff and mypy run here, so that CI's one ``pytest``
holds them (their settings: ``[tool.ruff]`` and ``[tool.mypy]`` in pyproject.toml). mypy keeps
its cache in ``.mypy_cache`` at the repository root: a rerun checks only what changed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(*args: str, timeout: int) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


@pytest.mark.timeout(120)
def test_ruff_finds_nothing():
    done = _run("ruff", "check", "runner", "tests", "scripts", "bench", timeout=100)
    assert done.returncode == 0, f"ruff check runner tests scripts bench:\n{done.stdout}{done.stderr}"


@pytest.mark.timeout(600)  # a cold cache takes about a minute on a quiet 2-core machine
def test_mypy_finds_nothing():
    done = _run("mypy", timeout=580)  # the files and options: [tool.mypy]
    assert done.returncode == 0, f"mypy (on runner/):\n{done.stdout}{done.stderr}"
    assert "Success: no issues found" in done.stdout, done.stdout
