"""Schedule files: torch's CSV action orders, every cell read whole.

One row per pipeline rank, one action per cell; empty cells are idle slots. The shapes torch
writes or ships are all read into one compute-only order (``Op``s per rank):

* compute-only cells, ``<stage><F|B|I|W><microbatch>`` (``2F0``, ``1B3``, ``0W1``): what
  ``schedule=csv`` and a run's ``schedule.csv`` hold;
* ``(0F7;7B3)OVERLAP_F_B`` cells (DualPipeV, torch's schedule visualizer): torch's runtime runs
  the sub-actions one after the other, so they are read as that order;
* compute+comms files (``SEND_F``, ``RECV_F``, ``SEND_B``, ``RECV_B``, ``UNSHARD``, ``RESHARD``,
  ``REDUCE_GRAD``): the compute actions are kept, in order, and lowered as a compute-only file is.
  torch's own ``compute_comms`` path runs the file as written and adds no gradient-reduce step,
  so gradients are not divided by the microbatch count and never reduced under FSDP; the
  compute-only lowering adds the communication, the reduce and its 1/m scaling;
* the notation before torch 2.6, where ``B`` was the input backward and ``BW`` the full one
  (now ``I`` and ``B``): recognised by a ``BW`` cell, or by ``W`` cells without any ``I``, and
  converted.

Whatever cannot be read entirely is an error naming the row, the column and the cell (torch's
own cell parser reads ``2BW0`` as ``2B`` and ``2F0x`` as ``2F0``). What was converted is
returned as notes, for a log line. Imports no torch.
"""

from __future__ import annotations

import csv
import re
from dataclasses import dataclass
from pathlib import Path

from runner.data.files import examples_dir
from runner.pipeline.ops import Op

__all__ = ["ScheduleFile", "ScheduleFileError", "read_schedule_file", "examples_dir", "example_names",
           "resolve_schedule_file"]



def example_names() -> list[str]:
    """The names ``schedule.csv`` accepts for the shipped examples (their file names less ``.csv``)."""
    folder = examples_dir()
    return sorted(p.stem for p in folder.glob("*.csv")) if folder.is_dir() else []


def resolve_schedule_file(value: str) -> str:
    """The file ``schedule.csv=<value>`` names: a path that exists is that path (a user's file wins);
    otherwise a bare name of a shipped example, with or without ``.csv``
    (``zero_bubble_pp2_m4``), is that example's file; otherwise ``value`` as given (reading it
    then says what is missing)."""
    if Path(value).exists() or Path(value).name != value:  # a file, or a path (not a bare name)
        return value
    example = examples_dir() / f"{value.removesuffix('.csv')}.csv"
    return str(example) if example.is_file() else value


_COMPUTE = re.compile(r"(\d+)(F|B|I|W|BW)(\d+)")
_COMMS = re.compile(r"(\d+)(?:(SEND_F|RECV_F|SEND_B|RECV_B)(\d+)|(UNSHARD|RESHARD)|(REDUCE_GRAD)\d*)")
_OVERLAP = re.compile(r"\((.*)\)OVERLAP_F_B")
CELL_FORMS = ("<stage><F|B|I|W><microbatch> (2F0, 1B3, 0W1), (<cell>;<cell>)OVERLAP_F_B, "
              "or a communication cell (1SEND_F0, 2RECV_B3, 0UNSHARD)")


class ScheduleFileError(ValueError):
    """A cell that cannot be read, or a file that mixes notations; the message says where."""


@dataclass(frozen=True)
class ScheduleFile:
    order: dict[int, list[Op]]  # rank -> its compute actions, in order
    notes: tuple[str, ...]  # what was converted to read it (for a log line)


def _cell(text: str, where: str) -> list[tuple[int, str, int]] | None:
    """A cell's compute actions as (stage, kind as written, microbatch); None for communication."""
    if (overlap := _OVERLAP.fullmatch(text)) is not None:
        parts = [p.strip() for p in overlap.group(1).split(";")]
        found = [m for p in parts if (m := _COMPUTE.fullmatch(p)) is not None]
        if len(parts) < 2 or len(found) < len(parts):
            raise ScheduleFileError(f"{where}: cannot read {text!r}: an OVERLAP_F_B cell holds two or more compute "
                                    "actions separated by ';', e.g. (0F7;7B3)OVERLAP_F_B.")
        return [(int(m.group(1)), m.group(2), int(m.group(3))) for m in found]
    if (compute := _COMPUTE.fullmatch(text)) is not None:
        return [(int(compute.group(1)), compute.group(2), int(compute.group(3)))]
    if _COMMS.fullmatch(text):
        return None
    raise ScheduleFileError(f"{where}: cannot read {text!r}. Each cell is one of: {CELL_FORMS}; "
                            "empty cells are idle slots.")


def _old_notation(kinds: set[str]) -> bool:
    """Whether the file uses torch < 2.6's names: BW (full backward), or W with B but no I (B was
    the input backward then; a W needs one)."""
    if "BW" in kinds and "I" in kinds:
        raise ScheduleFileError("the file mixes torch >= 2.6 notation (I = input backward) with the older one "
                                "(BW = full backward). Fix: use one: F, B (full backward), I (input backward), "
                                "W (weight backward).")
    return "BW" in kinds or ("W" in kinds and "I" not in kinds and "B" in kinds)


def read_schedule_file(path: Path) -> ScheduleFile:
    """Read a schedule file of any of the shapes above; raises ``ScheduleFileError``."""
    with open(path, newline="") as f:
        rows = [row for row in csv.reader(f) if any(cell.strip() for cell in row)]
    raw: dict[int, list[tuple[int, str, int]]] = {}
    comms = overlaps = 0
    for r, row in enumerate(rows):
        raw[r] = []
        for c, text in enumerate(row):
            text = text.strip()
            if not text:
                continue
            actions = _cell(text, f"row {r + 1} (rank {r}), column {c + 1}")
            if actions is None:
                comms += 1
                continue
            overlaps += len(actions) > 1
            raw[r] += actions
    if not any(raw.values()):
        raise ScheduleFileError("no compute actions (F, B, I, W). Fix: one row per pipeline rank, "
                                "e.g. '0F0,0F1,0B0,0B1'.")
    notes = []
    rename = {}
    if _old_notation({kind for actions in raw.values() for _, kind, _ in actions}):
        rename = {"B": "I", "BW": "B"}
        notes.append("read in the notation of torch < 2.6 (B = input backward, BW = full backward) and converted: "
                     "B -> I, BW -> B")
    if overlaps:
        notes.append(f"{overlaps} OVERLAP_F_B cells read as their actions, one after the other (as torch runs them)")
    if comms:
        notes.append(f"a compute+comms file: its {comms} communication cells are left out and the compute order "
                     "is lowered as a compute-only file's (torch adds the sends, receives and the gradient reduce)")
    order = {r: [Op(stage, rename.get(kind, kind), mb) for stage, kind, mb in actions]
             for r, actions in raw.items()}
    return ScheduleFile(order=order, notes=tuple(notes))
