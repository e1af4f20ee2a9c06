"""``data=tokens``: pre-tokenized files of integer token ids, memory-mapped, and their ids checked
against the model's vocabulary before any rank starts.

``data.path`` is a flat binary of ``data.dtype`` ids or a ``.npy`` array of an integer dtype, or
a directory or glob of such files of one suffix: shards, read in name order as one stream. The
smallest and largest id of each file (and where they are) are found by one pass over it and kept
in the runner's cache directory under the file's identity (path, size, modification and change
times, inode): later runs look them up instead of reading the file again."""

from __future__ import annotations

import bisect
import hashlib
import json
import logging
import os
import uuid
from collections import Counter
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from runner.data.files import file_identity
from runner.errors import ConfigError

__all__ = ["DTYPES", "Shards", "IdRange", "open_tokens", "as_stream", "id_range", "check_ids"]

log = logging.getLogger("runner.token_files")  # named as before runner/ became packages (runner.log)

DTYPES = {"uint8": np.uint8, "uint16": np.uint16, "uint32": np.uint32}
_SCAN = 1 << 24  # ids read per pass of the scan: bounded memory for any file


class Shards:
    """Token files read as one stream, in order: ``len`` and slices, as of one array."""

    def __init__(self, files: list[Path], arrays: list[np.ndarray]):
        self.files, self.arrays = files, arrays
        self.starts = [0]
        for a in arrays:
            self.starts.append(self.starts[-1] + len(a))

    def __len__(self) -> int:
        return self.starts[-1]

    def __getitem__(self, index: slice) -> np.ndarray:
        start, stop, _ = index.indices(len(self))
        parts, shard = [], bisect.bisect_right(self.starts, start) - 1
        while start < stop:  # a window may span shards
            end = min(stop, self.starts[shard + 1])
            parts.append(self.arrays[shard][start - self.starts[shard]:end - self.starts[shard]])
            start, shard = end, shard + 1
        return np.concatenate(parts) if parts else self.arrays[0][:0]


def _open_one(file: Path, path: str, dtype: str) -> np.ndarray:
    if file.suffix == ".npy":
        try:
            tokens = np.load(file, mmap_mode="r")
        except (ValueError, OSError) as e:  # object arrays (pickles are never loaded), a damaged header
            raise ConfigError(f"data.path={path!r}: {file} is not a readable .npy array of token ids ({e}). "
                              "Fix: np.save(file, ids) with an integer dtype (uint16, uint32).") from e
        if not np.issubdtype(tokens.dtype, np.integer):
            raise ConfigError(f"data.path={path!r}: {file} holds {tokens.dtype} values; token ids are integers "
                              "(a float id would be truncated without a word). Fix: save the ids as integers: "
                              "np.save(file, ids.astype(np.uint32)).")
        return tokens.reshape(-1)
    size = np.dtype(DTYPES[dtype]).itemsize
    if file.stat().st_size % size:
        raise ConfigError(f"data.path={path!r}: {file} has {file.stat().st_size} bytes, not a whole number of "
                          f"{dtype} tokens. Fix: the data.dtype it was written with.")
    return np.memmap(file, dtype=DTYPES[dtype], mode="r") if file.stat().st_size else np.zeros(0, DTYPES[dtype])


def open_tokens(path: str, files: list[Path], dtype: str) -> list[np.ndarray]:
    """Each of ``files`` (what ``path`` names: ``runner.data.files.find_files``) memory-mapped:
    ``.npy`` (its own dtype) or raw ``dtype``."""
    if dtype not in DTYPES:
        raise ConfigError(f"data.dtype={dtype!r} is not one of {', '.join(DTYPES)}. "
                          "Fix: data.dtype=uint16 (vocabularies up to 65536) or uint32.")
    suffixes = Counter(f.suffix for f in files)
    if len(suffixes) > 1:
        most = suffixes.most_common(1)[0][0]
        raise ConfigError(f"data.path={path!r} names files of several kinds ({', '.join(sorted(suffixes))}): token "
                          f"files are one kind. Fix: a glob of the token files, e.g. data.path='"
                          f"{next(f.parent for f in files if f.suffix == most)}/*{most}'.")
    return [_open_one(f, path, dtype) for f in files]


def as_stream(files: list[Path], arrays: list[np.ndarray]) -> np.ndarray | Shards:
    """One file's array, or several files' ``Shards``."""
    return arrays[0] if len(arrays) == 1 else Shards(files, arrays)


@dataclass(frozen=True)
class IdRange:
    low: int
    low_at: int  # the first position (a token index in the file) holding it
    high: int
    high_at: int
    odd_high: int  # the largest id at odd positions (1, 3, 5, ...; -1: none): see _split_ids


def _scan(tokens: np.ndarray) -> IdRange:
    found = IdRange(int(tokens[0]), 0, int(tokens[0]), 0, -1)
    for start in range(0, len(tokens), _SCAN):  # _SCAN is even: a part's odd positions are the file's
        part = np.asarray(tokens[start:start + _SCAN])
        lo, hi = int(part.min()), int(part.max())
        if lo < found.low:
            found = replace(found, low=lo, low_at=start + int(part.argmin()))
        if hi > found.high:
            found = replace(found, high=hi, high_at=start + int(part.argmax()))
        if len(part) > 1:
            found = replace(found, odd_high=max(found.odd_high, int(part[1::2].max())))
    return found


# uint32 ids (or int32: the same bytes for ids >= 0) read as uint16 are each two ids, the low half
# and the high half: every other id then is 0 (vocabularies up to 65536), or at most 7 up to 2^19,
# while the others spread over the vocabulary. No real stream of ids of one dtype looks like that.
_SPLIT_MIN_TOKENS = 1024
_SPLIT_HALF_MAX = 7
_SPLIT_SPREAD = 64


def _split_ids(file: Path, tokens: np.ndarray, r: IdRange) -> str | None:
    """Why ``file``'s ids look like wider ids read as uint16, or None."""
    if (tokens.dtype != np.uint16 or file.suffix == ".npy" or len(tokens) < _SPLIT_MIN_TOKENS
            or r.odd_high > _SPLIT_HALF_MAX or r.high < _SPLIT_SPREAD):
        return None
    return (f"{file} read as uint16 holds ids of at most {r.odd_high} at every odd position (1, 3, 5, ...) and up to "
            f"{r.high} at the others: the pattern of uint32 (or int32) ids read as uint16, each id split into its low "
            "and high halves, which the model would train on without a word")


def id_range(file: Path, tokens: np.ndarray, cache: Path) -> IdRange:
    """The smallest and largest id of ``tokens`` (``file`` read as its dtype), from a record in
    ``cache`` when the file is the one scanned before."""
    identity = f"{file_identity(file)}|{tokens.dtype}"
    record = cache / "id-ranges" / (hashlib.sha256(identity.encode()).hexdigest()[:32] + ".json")
    try:
        cached = json.loads(record.read_text())
        if cached["identity"] == identity:
            return IdRange(**cached["range"])
    except (OSError, ValueError, KeyError, TypeError):  # none yet, or not ours: scan
        pass
    found = _scan(tokens)
    partial = record.with_name(f".{record.name}.{uuid.uuid4().hex[:8]}")
    try:  # beside, then renamed: a reader never sees half a record
        record.parent.mkdir(parents=True, exist_ok=True)
        partial.write_text(json.dumps({"identity": identity, "range": asdict(found)}))
        os.replace(partial, record)
    except OSError as e:  # an unwritable cache costs a scan next time, nothing else
        log.info("could not keep the id range of %s in %s (%s): the next run scans it again", file, record.parent, e)
        partial.unlink(missing_ok=True)
    return found


def check_ids(path: str, files: list[Path], arrays: list[np.ndarray], limit: int, bound: str, cache: Path) -> None:
    """Every id of every file in ``0 .. limit - 1`` (``bound`` says where ``limit`` comes from);
    ``cache``: where each file's range is kept."""
    for file, array in zip(files, arrays):
        if not len(array):
            continue
        r = id_range(file, array, cache)
        if split := _split_ids(file, array, r):
            raise ConfigError(f"data.dtype=uint16: data.path={path!r}: {split}. Fix: data.dtype=uint32 (the dtype the "
                              "file was written with; int32 ids of 0 and up read the same), or, if they really are "
                              "uint16 ids, np.save them as a .npy (its header names the dtype: not checked so).")
        if r.low < 0 or r.high >= limit:
            bad, at = (r.low, r.low_at) if r.low < 0 else (r.high, r.high_at)
            raise ConfigError(
                f"data.path={path!r}: {file} holds token id {bad} at position {at} (a token index, from 0), outside "
                f"{bound} ({limit}: ids 0..{limit - 1}); the model's embedding would fail on it. Fix: token ids "
                "from the model's tokenizer, the data.dtype the file was written with, or a model whose vocabulary "
                "holds them.")
