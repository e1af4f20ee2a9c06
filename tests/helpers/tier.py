"""The in-process tier (``pytest -m "not multiprocess"``) starts no process. conftest.py tells
this module which test runs; a test that starts ranks, a forked helper or a command line without
the ``multiprocess`` marker fails, naming the fix. It holds from the test's setup on, so a
module-scoped spawn a test's fixture starts is checked against the test that needs it."""

from __future__ import annotations

import multiprocessing.process

_unmarked: list[str] = []  # the id of the running test while it is not marked multiprocess
_start = multiprocessing.process.BaseProcess.start


def begin(nodeid: str, marked: bool) -> None:
    _unmarked[:] = [] if marked else [nodeid]


def end() -> None:
    _unmarked.clear()


def check(what: str) -> None:
    if _unmarked:
        raise RuntimeError(f"{_unmarked[0]} {what} but is not marked multiprocess. "
                           "Fix: @pytest.mark.multiprocess on the test, or pytestmark on its module.")


def _checked_start(self) -> None:
    check("starts a process")
    _start(self)


def install() -> None:
    """Check every ``multiprocessing`` start (rank spawns and forks) in this process."""
    multiprocessing.process.BaseProcess.start = _checked_start  # type: ignore[method-assign]
