"""The terminal during a run: one progress bar that log lines do not break, a plain line per step
off a terminal, other ranks' lines through the launcher, and every rank's lines in runner.log."""

from __future__ import annotations

import io
import logging
import multiprocessing
import sys
import warnings
from pathlib import Path

import pytest

from runner.ranks.console import Console, console_for_run, console_listener, rank_logging, step_record


def _logger(console: Console) -> logging.Logger:
    log = logging.getLogger("runner.test_console")
    log.handlers[:] = [console]
    log.propagate = False
    log.setLevel(logging.INFO)
    return log


def _steps(log: logging.Logger, steps: int, *, warn_at: int) -> None:
    for step in range(1, steps + 1):
        step_record(log, step, steps, 4.0 - step / 100, f"loss {4.0 - step / 100:.4f}")
        if step == warn_at:
            log.warning("a warning from rank 1", extra={"rank": 1})


def test_on_a_terminal_steps_move_one_bar_and_log_lines_print_whole_above_it():
    stream = io.StringIO()
    console = Console(stream, tty=True)
    _steps(_logger(console), 30, warn_at=10)
    console.close()
    out = stream.getvalue()
    # What the terminal shows of each line is what follows its last carriage return.
    shown = [line.rsplit("\r", 1)[-1] for line in out.split("\n")]
    warning = [line for line in shown if "a warning from rank 1" in line]
    assert len(warning) == 1 and warning[0].startswith("[")
    assert "][rank 1][runner.test_console][WARNING] - " in warning[0]
    assert "30/30" in out and "loss=3.7000" in out  # the bar, at its end
    # A step line every tenth of the run stays in the scrollback; the others only move the bar.
    kept = [line.split(" - ")[1] for line in shown if " - step " in line]
    assert [k.split()[1] for k in kept] == [f"{s}/30" for s in range(3, 31, 3)]


def test_off_a_terminal_every_step_is_a_plain_line():
    stream = io.StringIO()
    console = Console(stream, tty=False)
    _steps(_logger(console), 12, warn_at=5)
    out = stream.getvalue()
    assert "\r" not in out
    lines = out.splitlines()
    steps = [line.split(" - ")[1].split()[1] for line in lines if " - step " in line]
    assert steps == [f"{s}/12" for s in range(1, 13)]
    assert lines[5].endswith("a warning from rank 1")  # in order: after step 5's line


def _rank_one(run_dir: str, queue) -> None:
    rank_logging(1, Path(run_dir), queue)
    log = logging.getLogger("runner.some_module")
    log.info("an info line of rank 1")
    log.warning("a warning of rank 1")
    warnings.warn("a Python warning in rank 1", UserWarning, stacklevel=1)


@pytest.mark.multiprocess
def test_other_ranks_reach_the_console_through_the_launcher_and_runner_log_holds_all_their_lines(tmp_path):
    context = multiprocessing.get_context("fork")  # as the launcher starts CPU ranks
    queue = context.Queue()
    rank = context.Process(target=_rank_one, args=(str(tmp_path), queue))
    rank.start()
    stream = io.StringIO()
    with console_listener(queue, stream):
        rank.join(timeout=30)
    assert rank.exitcode == 0
    console = stream.getvalue()
    assert "[rank 1][runner.some_module][WARNING] - a warning of rank 1" in console
    assert "an info line" not in console  # other ranks' INFO lines stay off the console...
    assert "a Python warning in rank 1" not in console  # and so do the libraries' Python warnings...
    log = (tmp_path / "runner.log").read_text()
    assert "[rank 1][runner.some_module][INFO] - an info line of rank 1" in log  # ...which go to runner.log
    assert "a warning of rank 1" in log
    assert "[rank 1][py.warnings][WARNING]" in log and "a Python warning in rank 1" in log


def test_a_run_in_this_process_keeps_python_warnings_off_the_console_and_in_its_log(tmp_path, capsys):
    root = logging.getLogger()
    console, file = logging.StreamHandler(sys.stderr), logging.FileHandler(tmp_path / "runner.log")
    for handler in (console, file):
        root.addHandler(handler)
    level = root.level
    root.setLevel(logging.INFO)
    try:
        with console_for_run():
            logging.getLogger("runner.some_module").warning("the runner's own warning")
            warnings.warn("a library's warning during the run", UserWarning, stacklevel=1)
        with pytest.warns(UserWarning, match="after the run"):  # the caller's warnings are its own again
            warnings.warn("a warning after the run", UserWarning, stacklevel=1)
    finally:
        for handler in (console, file):
            root.removeHandler(handler)
            handler.close()
        root.setLevel(level)
    err = capsys.readouterr().err
    assert "the runner's own warning" in err and "a library's warning" not in err
    log = (tmp_path / "runner.log").read_text()
    assert "the runner's own warning" in log and "UserWarning: a library's warning during the run" in log
