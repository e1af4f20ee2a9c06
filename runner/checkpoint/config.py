"""The ``checkpoint.*`` keys (schema ``CheckpointConfig``): how often to save, how many to keep, what
to resume from. Imports nothing heavy."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

__all__ = ["CheckpointConfig"]


@dataclass
class CheckpointConfig:
    every: int = 0  # save every K optimizer steps into <run dir>/checkpoints/step-N; 0 = never
    keep: int = 2  # complete checkpoints kept (the newest)
    # Save in the background (DCP's async_save): the step waits only for a copy of the rank's state
    # in CPU memory (twice the model and optimizer state while a save runs), not for the writes;
    # the commit follows once every rank's files are written. A save first waits for the previous
    # one, and the run's end for the last.
    async_save: bool = False
    # Continue from: a checkpoint directory, a run directory (its newest complete checkpoint), or
    # "latest": the newest complete checkpoint of the runs under latest_root that are not in progress.
    resume: Optional[str] = None
    # Where resume=latest looks (relative to the launch directory): this directory and run
    # directories up to three levels below it (outputs/<date>/<time>, multirun/<date>/<time>/<job>).
    latest_root: str = "outputs"
    # Resume with a data.tokenizer other than the one the checkpoint recorded (its token ids then
    # stand for other text); false: such a resume is refused before any rank starts.
    allow_tokenizer_change: bool = False
    # Resume with another train.batch_size, train.seq_len or train.seed than the checkpoint's (the
    # step it resumes at then no longer marks where its data stopped: samples skipped or read twice);
    # false: such a resume is refused before any rank starts.
    allow_data_change: bool = False
