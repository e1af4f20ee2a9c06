"""The tests' own ranks (``helpers.ranks``): the ranks of 2 and 4 are spawned once per session and
serve every spawn of that size. A call must see what freshly spawned ranks would (the test
process's environment, working directory and import path of the moment), and a failing rank must
end its pool with its traceback, the next call getting ranks of its own."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from helpers import ranks


def _report(env, out: str, name: str) -> None:
    """Rank 0 writes what this call sees: its process, the variable, directory and path."""
    if env.is_main:
        seen = [str(os.getpid()), os.environ.get("RUNNER_TEST_POOL", "unset"), os.getcwd(), sys.path[0]]
        (Path(out) / name).write_text("\n".join(seen))


def _fail_on_rank_1(env, out: str) -> None:
    if env.rank == 1:
        raise ValueError("rank 1 fails on purpose")


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_pooled_ranks_run_each_call_as_fresh_ranks_would_and_a_failure_ends_them(tmp_path, monkeypatch):
    ranks.spawn(2, _report, str(tmp_path), "before")
    monkeypatch.setenv("RUNNER_TEST_POOL", "set")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path / "first"))
    ranks.spawn(2, _report, str(tmp_path), "during")
    monkeypatch.undo()
    ranks.spawn(2, _report, str(tmp_path), "after")
    before, during, after = ((tmp_path / n).read_text().splitlines() for n in ("before", "during", "after"))
    assert before[0] == during[0] == after[0]  # the same live process, three calls
    assert during[1:] == ["set", str(tmp_path), str(tmp_path / "first")]
    assert before[1:] == after[1:] == ["unset", os.getcwd(), sys.path[0]]

    with pytest.raises(AssertionError, match=r"(?s)2 pooled ranks failed in .*_fail_on_rank_1.*rank 1: "
                                             r"Traceback.*ValueError: rank 1 fails on purpose"):
        ranks.spawn(2, _fail_on_rank_1, str(tmp_path))
    assert 2 not in ranks._pools  # ended: its ranks were killed
    ranks.spawn(2, _report, str(tmp_path), "next")
    assert (tmp_path / "next").read_text().splitlines()[0] != before[0]  # new ranks
