"""Stress the rank exit path: many short 2-rank spawns (the tests' ``helpers.ranks`` way: spawn
start method, one tiny training case each), counting the ranks that do not exit cleanly. Run from
the repository root: ``python scripts/stress_rank_exit.py --runs 200 [--load] [--fork]``. Each
rank's stderr is kept in ``<out>/run-N.err`` for runs that failed (an abort's message and the
faulthandler stacks). Not part of the test suite: an intermittent abort needs hundreds of runs."""

from __future__ import annotations

import argparse
import multiprocessing
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from runner.ranks.processes import spawn  # noqa: E402

from helpers.config import TINY, resolved  # noqa: E402
from helpers.ranks import train_cases  # noqa: E402

# What a rank that exits uncleanly prints, even when its exit status is 0.
_UNCLEAN = ("terminate called", "still running after destroy_process_group", "Fatal Python error")


def _burn(parent: int) -> None:
    """Keep a core busy for as long as the stress run lives (however it ends)."""
    while os.getppid() == parent:
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            pass


def _one(out: Path, cases: dict, method: str) -> str | None:
    """One spawn; None when both ranks exited 0, else what went wrong."""
    out.mkdir(parents=True)
    try:
        with spawn(2, train_cases, str(out), cases, directory=out, timeout_s=60, method=method, threads=1) as ranks:
            ranks.join()
    except Exception as e:  # noqa: BLE001  (any failure is counted and kept)
        return f"{type(e).__name__}: {e}"
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--load", action="store_true", help="keep one more core busy (a spinning process)")
    parser.add_argument("--fork", action="store_true", help="fork the ranks (runs' default on Linux CPU)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="stress-rank-exit-"))
    out.mkdir(parents=True, exist_ok=True)
    cases = {"tiny": resolved(*TINY, "parallel.pp=2", "schedule=1f1b", "train.steps=2")}
    burner = None
    if args.load:
        burner = multiprocessing.Process(target=_burn, args=(os.getpid(),), daemon=True)
        burner.start()
    failures = 0
    err_fd = os.dup(2)
    try:
        for n in range(args.runs):
            log = out / f"run-{n}.err"
            with open(log, "w") as f:  # the ranks inherit this stderr
                os.dup2(f.fileno(), 2)
                problem = _one(out / f"run-{n}", cases, "fork" if args.fork else "spawn")
                os.dup2(err_fd, 2)
            shutil.rmtree(out / f"run-{n}", ignore_errors=True)
            if problem is None and any(sign in log.read_text() for sign in _UNCLEAN):
                problem = "a rank's stderr shows an unclean exit"
            if problem is None:
                log.unlink()
            else:
                failures += 1
                print(f"run {n}: {problem} (stderr: {log})", flush=True)
            if (n + 1) % 10 == 0:
                print(f"{n + 1} runs, {failures} failed", flush=True)
    finally:
        if burner is not None:
            burner.kill()
    print(f"{args.runs} runs, {failures} failed ({out})")


if __name__ == "__main__":
    main()
