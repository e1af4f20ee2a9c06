"""Which files ``data.path`` names: a file, a directory (walked, hidden files and directories left
out) or a glob (``*``, ``?``, ``[...]``, ``**``; relative or absolute), ``~`` expanded in each.
For text, which of them are text: a directory takes the files whose suffix is a text suffix
(``TEXT_SUFFIXES``; none, as ``README``, also counts), a glob whatever it matches, and both only
files whose first ``HEAD_BYTES`` are UTF-8 without a NUL byte. What is taken and what is skipped,
with why, is logged by file type. A bare name of a shipped example (``example_corpus.txt``) that
is no file here is that example, from any directory. And when such a file has changed (``file_identity``), and where the
runner caches what it derives from a user's files (``default_cache_dir``)."""

from __future__ import annotations

import codecs
import glob
import logging
import os
from collections import Counter
from pathlib import Path
from typing import Iterable

from runner.errors import ConfigError

__all__ = ["TEXT_SUFFIXES", "HEAD_BYTES", "examples_dir", "find_files", "text_files", "not_text", "by_type",
           "default_cache_dir", "file_identity"]

log = logging.getLogger("runner.data_files")  # named as before runner/ became packages (runner.log)

# Prose, markup, code and configuration: what a directory of text is made of. An image, an archive
# or a model file never is (docs folders hold PNGs: they once were most of a tokenized stream).
TEXT_SUFFIXES = frozenset(
    ".txt .text .md .markdown .rst .adoc .org .tex .htm .html .xml .json .jsonl .csv .tsv .yaml .yml .toml "
    ".ini .cfg .conf .py .pyi .c .h .cc .cpp .hpp .cu .java .kt .scala .js .ts .go .rs .rb .php .pl .lua .r "
    ".jl .swift .sh .bash .zsh .sql .css .scss".split())
HEAD_BYTES = 1 << 16  # read from each file to tell text from binary: cheap enough to do on every run

_reported: set[str] = set()  # selections already logged (forked ranks inherit the launcher's)


def _walk(directory: Path) -> list[Path]:
    """The files under ``directory``; none under a hidden directory (``.git``) or hidden itself."""
    return sorted(f for f in directory.rglob("*")
                  if f.is_file() and not any(part.startswith(".") for part in f.relative_to(directory).parts))


def examples_dir() -> Path:
    """The shipped examples (schedule files, a text corpus): ``runner/examples`` in an installed
    wheel (the build ships the repository's top-level ``examples/`` there), ``examples/`` next to the
    package in a checkout."""
    package = Path(__file__).resolve().parent.parent
    shipped = package / "examples"
    return shipped if shipped.is_dir() else package.parent / "examples"


def find_files(path: str, key: str = "data.path") -> tuple[list[Path], str]:
    """The files ``path`` names, and how it named them: ``file``, ``directory`` or ``glob``. A bare
    name that names nothing here but a shipped example (``example_corpus.txt``) is that example."""
    p = Path(path).expanduser()
    if not p.exists() and p.name == path and (examples_dir() / path).is_file():
        p = examples_dir() / path
    if p.is_file():
        return [p], "file"
    if p.is_dir():
        files, kind = _walk(p), "directory"
    else:  # glob.glob takes absolute patterns too (Path.glob refuses them)
        matches = [Path(m) for m in sorted(glob.glob(str(p), recursive=True))]
        files, kind = list(dict.fromkeys(f for m in matches for f in (_walk(m) if m.is_dir() else [m]))), "glob"
    if not files:
        raise ConfigError(f"{key}={path!r}: no such file, or no file in that directory or matching that glob "
                          f"(looked for {str(p)!r}). Fix: a local file, directory or glob (absolute, relative to "
                          "the directory the runner started in, or under ~).")
    return files, kind


def not_text(file: Path) -> str | None:
    """Why ``file`` is not UTF-8 text (its first ``HEAD_BYTES``), or None."""
    with open(file, "rb") as f:
        head = f.read(HEAD_BYTES)
    nul = head.find(b"\0")
    if nul >= 0:
        return f"a NUL byte at offset {nul}"
    try:  # a character cut at the end of the head is not an error
        codecs.getincrementaldecoder("utf-8")().decode(head, final=len(head) < HEAD_BYTES)
    except UnicodeDecodeError as e:
        return f"byte 0x{head[e.start]:02x} at offset {e.start} is not UTF-8"
    return None


def by_type(files: Iterable[Path]) -> str:
    """``3 .md (12.0 KB), 1 .txt (0.1 KB)``: files and bytes per suffix."""
    counts: Counter[str] = Counter()
    sizes: Counter[str] = Counter()
    for f in files:
        suffix = f.suffix.lower() or "(no suffix)"
        counts[suffix] += 1
        sizes[suffix] += f.stat().st_size
    return ", ".join(f"{counts[s]} {s} ({sizes[s] / 1e3:.1f} KB)" for s in sorted(counts, key=lambda s: -sizes[s]))


def text_files(path: str, key: str = "data.path") -> list[Path]:
    """The text files ``path`` names (see the module docstring). A file named on its own must be
    text; from a directory or glob the rest is skipped and logged; none left is an error."""
    files, kind = find_files(path, key)
    if kind == "file":
        problem = not_text(files[0])
        if problem:
            raise ConfigError(f"{key}={path!r} is not UTF-8 text: {problem}. Fix: a text file (UTF-8), or "
                              "data=tokens for token ids.")
        return files
    taken, skipped = [], {}
    for f in files:
        suffix = f.suffix.lower()
        reason = (f"not a text suffix ({suffix})" if kind == "directory" and suffix and suffix not in TEXT_SUFFIXES
                  else not_text(f))
        if reason:
            skipped[f] = reason
        else:
            taken.append(f)
    if not taken:
        raise ConfigError(f"{key}={path!r}: none of its {len(files)} files is text ({by_type(files)}; e.g. "
                          f"{files[0]}: {skipped[files[0]]}). Fix: a directory or glob of UTF-8 text files; a glob "
                          f"(e.g. {key}='dir/**/*.ext') takes files of any suffix that hold text.")
    if path not in _reported:
        _reported.add(path)
        log.info("%s=%s: %d text files: %s", key, path, len(taken), by_type(taken))
        if skipped:
            first = next(iter(skipped))
            log.info("%s=%s: skipped %d files that are not text: %s (e.g. %s: %s)", key, path, len(skipped),
                        by_type(skipped), first, skipped[first])
    return taken


def default_cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "runner" / "tokens"


def file_identity(file: Path) -> str:
    """What changes whenever a file's bytes may have: its path, device, inode, size, modification and
    change times (``cp -p``, ``rsync -t`` and ``tar`` keep a modification time, never a change time)."""
    st = file.stat()
    return f"{file.resolve()}|{st.st_dev}|{st.st_ino}|{st.st_size}|{st.st_mtime_ns}|{st.st_ctime_ns}"
