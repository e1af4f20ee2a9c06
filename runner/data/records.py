"""``data=hf``'s records: local json/jsonl/parquet/arrow/csv files read with ``datasets``
(memory-mapped Arrow). What ``datasets`` cannot read is named here by file and line, with the fix;
``data.field`` must be a column of text."""

from __future__ import annotations

import json
import logging
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from runner.errors import ConfigError
from runner.ranks.processes import stop_progress_monitors

__all__ = ["FORMATS", "load_records", "naming_bad_records"]

log = logging.getLogger("runner.records")  # named as before runner/ became packages (runner.log)

FORMATS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".arrow": "arrow", ".csv": "csv", ".txt": "text"}
_LINES = {"json", "csv", "text"}  # formats read as UTF-8 lines: a bad line can be named
_TEXT = ("string", "large_string")


def _record_files(path: str, files: list[Path]) -> tuple[list[Path], str]:
    """``files`` (what ``path`` names) all of one format, empty ones left out (logged)."""
    formats = {FORMATS.get(f.suffix.lower(), "") for f in files}
    if "" in formats or len(formats) != 1:
        raise ConfigError(f"data.path={path!r}: files of one format are needed, one of "
                          f"{', '.join(sorted(FORMATS))}; found {sorted({f.suffix for f in files})}. Fix: a glob "
                          f"that names one kind, e.g. data.path='{Path(path).expanduser() / '*.jsonl'}'.")
    empty = [f for f in files if f.stat().st_size == 0]
    if len(empty) == len(files):
        raise ConfigError(f"data.path={path!r}: {', '.join(map(str, empty[:3]))}{' …' if len(empty) > 3 else ''} "
                          "is empty: no records. Fix: data.path=<files holding records>.")
    if empty:
        log.info("data.path=%s: skipping %d empty files (%s%s)", path, len(empty), ", ".join(map(str, empty[:3])),
                 " …" if len(empty) > 3 else "")
    return [f for f in files if f.stat().st_size], formats.pop()


def _bad_line(file: Path, fmt: str) -> str | None:
    """The first line of ``file`` that is not UTF-8 (or, for JSON lines, not a JSON object)."""
    whole_json = None
    if file.suffix.lower() == ".json":  # one JSON document, or JSON lines
        try:
            whole_json = json.loads(file.read_bytes())
        except ValueError:
            pass
    with open(file, "rb") as f:
        for number, line in enumerate(f, 1):
            try:
                text = line.decode("utf-8")
            except UnicodeDecodeError as e:
                return (f"line {number}: byte 0x{line[e.start]:02x} at column {e.start + 1} is not UTF-8 (data=hf "
                        "reads UTF-8)")
            if fmt != "json" or whole_json is not None or not text.strip():
                continue
            try:
                record = json.loads(text.rstrip("\r\n"))
            except ValueError as e:
                return f"line {number}: not JSON ({getattr(e, 'msg', e)} at column {getattr(e, 'colno', '?')})"
            if not isinstance(record, dict):
                return f"line {number}: a JSON {type(record).__name__}, where a record (an object) belongs"
    return None


def _unreadable(path: str, files: list[Path], fmt: str, error: Exception) -> str:
    """One paragraph on why ``datasets`` could not read ``files``: the file and line where they
    can be found, else its own words."""
    for file in files if fmt in _LINES else []:
        where = _bad_line(file, fmt)
        if where:
            return f"data.path={path!r}: {file}, {where}. Fix: that line (or leave the file out of data.path)."
    cause = " ".join(f"{type(error).__name__}: {error}; {error.__cause__ or ''}".split())
    return (f"data.path={path!r}: datasets cannot read these {fmt} files ({', '.join(map(str, files[:3]))}"
            f"{' …' if len(files) > 3 else ''}): {cause}. Fix: files datasets.load_dataset({fmt!r}) reads.")


def _check_field(ds, path: str, field: str) -> None:
    import datasets

    columns = {name: getattr(feature, "dtype", type(feature).__name__) for name, feature in ds.features.items()}
    text = [name for name, dtype in columns.items() if dtype in _TEXT]
    listing = ", ".join(f"{name} ({dtype})" for name, dtype in columns.items())
    hint = f"Fix: data.field=<a text column>{': ' + ', '.join(text) if text else ' (this data has none)'}."
    if field not in columns:
        raise ConfigError(f"data.field={field!r} is not a column of data.path={path!r} (columns: {listing}). {hint}")
    if not isinstance(ds.features[field], datasets.Value) or columns[field] not in _TEXT:
        raise ConfigError(f"data.field={field!r} of data.path={path!r} holds {columns[field]} values, not text "
                          f"(columns: {listing}). {hint}")
    if len(ds) == 0:
        raise ConfigError(f"data.path={path!r} holds no records. Fix: data.path=<files holding records>.")


def load_records(path: str, files: list[Path], field: str, cache_dir: str):
    """The records of ``files`` (those ``path`` names; ``runner.data.files.find_files``) as a
    ``datasets.Dataset``, ``field`` checked to be a text column; ``cache_dir``: ``datasets``' own
    cache. Returns the files read (empty ones left out) and the dataset."""
    files, fmt = _record_files(path, files)
    try:
        import datasets
    except ImportError as e:
        raise ConfigError("data=hf needs datasets (not installed). Fix: pip install -e '.[hf]'.") from e
    try:
        ds = datasets.load_dataset(fmt, data_files=[str(f) for f in files], split="train", cache_dir=cache_dir)
    except Exception as e:  # whatever datasets raises (ArrowInvalid, UnicodeDecodeError, StopIteration, ...)
        raise ConfigError(_unreadable(path, files, fmt, e)) from e
    finally:
        stop_progress_monitors()  # datasets' progress bars start it
    _check_field(ds, path, str(field))
    return files, ds


@contextmanager
def naming_bad_records(path: str, files: list[Path]) -> Iterator[None]:
    """Errors in reading the records later, as they are tokenized (Arrow holds a JSON string that is
    not UTF-8 until then), named as ``load_records`` names them."""
    import pyarrow  # type: ignore[import-untyped]  # (no type information)

    try:
        yield
    except (UnicodeError, pyarrow.ArrowException) as e:
        raise ConfigError(_unreadable(path, files, FORMATS[files[0].suffix.lower()], e)) from e
