"""mypy over ``runner/`` (test_lint's ``test_mypy_finds_nothing``), started in the background when
the session has collected that test, at the lowest priority (``nice`` 19): it type-checks on the
cycles the rest of the suite leaves idle (single-threaded in-process tests, ranks waiting on each
other, command lines starting), and the test, run last (conftest.py), takes its verdict. A cold
check (a clean clone, CI's) is about a minute of CPU; only what it has not finished by then is
waited for. Without the test in the session nothing starts."""

from __future__ import annotations

import os
import subprocess

from helpers.cli import finish, start_cli
from helpers.config import ROOT

TEST = "test_lint.py::test_mypy_finds_nothing"

_started: list[subprocess.Popen] = []


def _workers() -> list[str]:
    # Run now (no background check): two worker processes where there are two cores, cold 44 -> 35 s
    # on a quiet 2-core machine (mypy checks the ~7,700 modules runner/ imports, transformers' and
    # torch's most of them). Not in the background: niced workers starved by the suite miss mypy's
    # deadline to connect ("Failed to establish connection with worker", an internal error), and each
    # parses every module again (about 52 CPU-s against one process's 45, cold).
    return ["--num-workers", "2"] if len(os.sched_getaffinity(0)) >= 2 else []


def start_in_background(items: list) -> list:
    """When ``items`` (the session's tests, in order) hold the mypy test: start mypy, niced, and
    return the items with that test last; else ``items`` as they are."""
    mine = [item for item in items if item.nodeid.endswith(TEST)]
    if not mine or _started:
        return items
    _started.append(start_cli(module="mypy", cwd=ROOT, nice=19))  # one process; files and options: [tool.mypy]
    return [item for item in items if item not in mine] + mine


def verdict(timeout: float) -> subprocess.CompletedProcess:
    """The background check's output (waited for, at most ``timeout`` s), or a check run now."""
    proc = _started.pop() if _started else start_cli(*_workers(), module="mypy", cwd=ROOT)
    return finish(proc, timeout=timeout, check=True)


def stop() -> None:
    """At the session's end: a check the session never asked for (it stopped first) is ended."""
    while _started:
        proc = _started.pop()
        proc.kill()
        proc.communicate()
