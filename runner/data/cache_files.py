"""Where the runner caches what it derives from a user's files, and when such a file has changed.
Imports nothing of the runner's: ``tokens`` and ``token_cache`` both use it."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["default_cache_dir", "file_identity"]


def default_cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "runner" / "tokens"


def file_identity(file: Path) -> str:
    """What changes whenever a file's bytes may have: its path, device, inode, size, modification and
    change times (``cp -p``, ``rsync -t`` and ``tar`` keep a modification time, never a change time)."""
    st = file.stat()
    return f"{file.resolve()}|{st.st_dev}|{st.st_ino}|{st.st_size}|{st.st_mtime_ns}|{st.st_ctime_ns}"
