"""The terminal during a run: one process writes it.

Spawned ranks do not write the console themselves: every rank sends its console records (rank 0's
INFO and up, the others' WARNING and up) through a queue to the launcher, whose ``Console`` handler
prints them. On a terminal, rank 0's per-step records drive one progress bar instead, and other
lines print above it (tqdm's ``write``), so nothing breaks the bar; elsewhere (a file, a pipe, CI)
each step is a plain line. Each rank also writes all of its own INFO lines to ``runner.log``. A run
in the launcher's own process (pp=1, torchrun's rank 0) swaps the console handler for a ``Console``
for the duration of the run; torchrun's other ranks keep their own consoles and write their INFO
lines to rank 0's ``runner.log``.

Quiet by default: Python warnings (the libraries': torch's, transformers'; the runner logs its own)
go to ``runner.log`` only, and the libraries' progress bars and INFO chatter (datasets', the Hugging
Face hub's, MLflow's, matplotlib's font cache line) are turned off (``quiet_libraries``). Imports no
torch.
"""

from __future__ import annotations

import logging
import logging.handlers
import os
import sys
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, TextIO

if TYPE_CHECKING:
    from tqdm import tqdm

__all__ = ["Console", "step_record", "rank_logging", "console_listener", "console_for_run", "torchrun_rank_log",
           "RANK_FORMAT", "quiet_libraries"]

RANK_FORMAT = "[%(asctime)s][rank %(rank)s][%(name)s][%(levelname)s] - %(message)s"
STEP_LOGGER = "runner.steps"  # rank 0's record of each finished step


# The libraries' progress bars and INFO lines, off unless the user's environment sets these: read
# when each library is imported, so set before (the ranks inherit them).
_QUIET_ENV = {
    "HF_DATASETS_DISABLE_PROGRESS_BARS": "1",  # datasets: "Generating train split", "Map"
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",  # huggingface_hub's, which transformers' bars follow
    "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
    "MLFLOW_LOGGING_LEVEL": "WARNING",  # "INFO mlflow.store.db.utils: Creating initial MLflow database tables"
}
WARNINGS_LOGGER = "py.warnings"  # where logging.captureWarnings sends warnings.warn


def quiet_libraries() -> None:
    """Turn off what the libraries print that says nothing to a user of the runner: their progress
    bars and INFO lines (a setting in the user's environment wins), matplotlib's "building the font
    cache" line."""
    for key, value in _QUIET_ENV.items():
        os.environ.setdefault(key, value)
    logging.getLogger("matplotlib").setLevel(logging.ERROR)


def _not_a_library_warning(record: logging.LogRecord) -> bool:
    """A console filter: Python warnings (the libraries'; the runner logs its own) go to the log file only."""
    return record.name != WARNINGS_LOGGER


class _RankFilter(logging.Filter):
    def __init__(self, rank: int):
        super().__init__()
        self.rank = rank

    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = self.rank
        return True


class _Format(logging.Formatter):
    """The rank's format for records that carry a rank; without one (the launcher's), Hydra's."""

    def format(self, record: logging.LogRecord) -> str:
        record.where = f"[rank {record.rank}]" if hasattr(record, "rank") else ""
        return super().format(record)


def step_record(log: logging.Logger, step: int, steps: int, loss: float, text: str) -> None:
    """Rank 0's line for a finished step (``step`` of ``steps``, 1-based): a progress-bar update
    on a terminal, a plain line elsewhere, always a line in ``runner.log``."""
    log.info("step %d/%d %s", step, steps, text, extra={"progress": (step, steps, loss)})


class Console(logging.Handler):
    """Prints records to ``stream``; on a terminal, step records move a tqdm bar and the other
    records print above it. ``every``: on a terminal, also keep a step line every N steps."""

    def __init__(self, stream: TextIO | None = None, *, tty: bool | None = None, every: int = 0):
        super().__init__()
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty() if tty is None else tty
        self.every = every
        self.bar: tqdm | None = None  # created on the first step record (tqdm imported then)
        self.setFormatter(_Format("[%(asctime)s]%(where)s[%(name)s][%(levelname)s] - %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            progress = getattr(record, "progress", None)
            if self.tty and progress is not None:
                self._advance(*progress)
                step, steps, _ = progress
                every = self.every or max(1, steps // 10)
                if step % every and step != steps:
                    return
            self._write(self.format(record))
        except Exception:
            self.handleError(record)

    def _advance(self, step: int, steps: int, loss: float) -> None:
        from tqdm import tqdm

        if self.bar is None:
            self.bar = tqdm(total=steps, initial=step - 1, desc="train", unit="step", file=self.stream,
                            dynamic_ncols=True)
        self.bar.set_postfix(loss=f"{loss:.4f}", refresh=False)
        self.bar.update(step - self.bar.n)
        if step >= steps:
            self.close_bar()

    def _write(self, text: str) -> None:
        if self.bar is not None:
            self.bar.write(text, file=self.stream)
        else:
            self.stream.write(text + "\n")
            self.stream.flush()

    def close_bar(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def close(self) -> None:
        self.close_bar()
        super().close()


def rank_logging(rank: int, run_dir: Path, console_queue) -> None:
    """A spawned rank's logging: all its INFO lines to ``runner.log``; its console lines (rank 0:
    INFO and up, others: WARNING and up) through ``console_queue`` to the launcher's ``Console``."""
    root = logging.getLogger()
    for handler in root.handlers[:]:  # a forked rank inherits the launcher's (Hydra's) handlers
        root.removeHandler(handler)
    file = logging.FileHandler(run_dir / "runner.log")
    file.setFormatter(logging.Formatter(RANK_FORMAT))
    console = logging.handlers.QueueHandler(console_queue)
    console.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    console.addFilter(_not_a_library_warning)
    for handler in (file, console):
        handler.addFilter(_RankFilter(rank))
        root.addHandler(handler)
    root.setLevel(logging.INFO)
    quiet_libraries()  # a spawned rank starts afresh
    logging.captureWarnings(True)  # warnings.warn in a rank becomes a record in runner.log, not raw stderr


@contextmanager
def console_listener(queue, stream: TextIO | None = None) -> Iterator[Console]:
    """The launcher's end of ``rank_logging``: prints what the ranks send until the block ends."""
    console = Console(stream)
    listener = logging.handlers.QueueListener(queue, console)
    listener.start()
    try:
        yield console
    finally:
        listener.stop()  # prints what is still queued
        console.close()
        if hasattr(queue, "join_thread"):  # its feeder thread (the stop's sentinel) ends: a restart may fork
            queue.close()
            queue.join_thread()


@contextmanager
def console_for_run() -> Iterator[None]:
    """A run in this process: the root logger's console handlers (Hydra's, on stdout) become a
    ``Console`` on the same stream for the run (Python warnings to the log file only), then come back."""
    root = logging.getLogger()
    consoles = [h for h in root.handlers if type(h) is logging.StreamHandler
                and getattr(h, "stream", None) in (sys.stdout, sys.stderr)]
    replacements = [Console(h.stream) for h in consoles]
    for old, new in zip(consoles, replacements):
        new.setLevel(old.level)
        new.addFilter(_not_a_library_warning)
        root.removeHandler(old)
        root.addHandler(new)
    captured = getattr(warnings.showwarning, "__module__", None) == "logging"  # the caller's own choice
    logging.captureWarnings(True)  # the libraries' warnings into the run's log file (Hydra's), not the console
    try:
        yield
    finally:
        logging.captureWarnings(captured)
        for old, new in zip(consoles, replacements):
            root.removeHandler(new)
            new.close()
            root.addHandler(old)


@contextmanager
def torchrun_rank_log(rank: int, run_dir: Path) -> Iterator[None]:
    """torchrun's ranks other than 0 log into rank 0's runner.log too (the run directory is on a
    filesystem every node shares); their consoles are torchrun's."""
    if rank == 0:  # Hydra's file handler already writes runner.log
        yield
        return
    handler = logging.FileHandler(run_dir / "runner.log")
    handler.setFormatter(logging.Formatter(RANK_FORMAT.replace("%(rank)s", str(rank))))
    root = logging.getLogger()
    level, consoles = root.level, [h for h in root.handlers if h.level == logging.NOTSET]
    for console in consoles:  # the file gets INFO; the console keeps showing what it showed
        console.setLevel(level)
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    try:
        yield
    finally:
        root.removeHandler(handler)
        root.setLevel(level)
        for console in consoles:
            console.setLevel(logging.NOTSET)
        handler.close()
