"""Loading a DCP checkpoint without running code from it: every use of torch.distributed.checkpoint
internals, in one place. Tested with torch 2.13.

DCP unpickles in two places. ``FileSystemReader.read_metadata`` reads ``.metadata`` with plain
``pickle``; ``DefaultLoadPlanner.load_bytes`` reads every non-tensor entry of the shards (the
optimizer's hyperparameters, for one) with ``torch.load`` and ``weights_only`` off. A crafted file runs
arbitrary code through either. ``SafeReader`` unpickles ``.metadata`` admitting only DCP's metadata
classes and the plain values they hold; ``SafePlanner`` loads byte entries with
``weights_only=True`` (``load_plain``, which also reads the ranks' ``rng-rank<R>.pt``). Anything else
is refused with ``UnsafeCheckpointError``, in one message (``refusal``). (Tensor entries are already
read with ``weights_only=True`` by DCP itself.)
"""

from __future__ import annotations

import enum
import io
import pickle
import re
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata

from runner.errors import CheckpointError, shown

__all__ = ["UnsafeCheckpointError", "SafeReader", "SafePlanner", "load_plain", "read_rng_state", "refusal",
           "root_causes", "read_model_tensors"]

# What DCP's ``.metadata`` pickle refers to (torch 2.13): its dataclasses, tensor sizes, dtypes
# and layouts, and the path it was saved to.
_METADATA_CLASSES = {
    ("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING")
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # looks a layout up by name among torch's own
    ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath"),
    ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
}


class UnsafeCheckpointError(Exception):
    """A checkpoint file holds something other than checkpoint data; it was not loaded."""


def _enum_member(cls: Any, name: str) -> Any:
    """``getattr`` as some Pythons (3.11.2, 3.12+) pickle an enum member, ``getattr(cls, name)``:
    admitted for the metadata's enums only, never as ``getattr`` itself."""
    if not (isinstance(cls, type) and issubclass(cls, enum.Enum)) or name not in cls.__members__:
        raise UnsafeCheckpointError(f".metadata asks for {getattr(cls, '__name__', cls)!r}.{name}, which is not a "
                                    "member of a checkpoint metadata enum; loading it could run code, so it was "
                                    "not loaded")
    return cls[name]


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_CLASSES:
            return super().find_class(module, name)
        if (module, name) == ("builtins", "getattr"):
            return _enum_member
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UnsafeCheckpointError(
            f".metadata refers to {module}.{name}, which is not checkpoint metadata; loading it "
            "could run code, so it was not loaded")


class SafeReader(FileSystemReader):
    """``FileSystemReader`` whose ``.metadata`` is unpickled by an allowlist (see the module)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        # torch 2.13's FileSystemReader.read_metadata with pickle.load replaced.
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as metadata_file:
            metadata = _MetadataUnpickler(metadata_file).load()
        if not isinstance(metadata, Metadata):
            raise UnsafeCheckpointError(f".metadata holds a {type(metadata).__name__}, not DCP metadata")
        storage_meta = getattr(metadata, "storage_meta", None)
        if storage_meta is None:
            storage_meta = metadata.storage_meta = StorageMeta()
        storage_meta.load_id = self.load_id
        return metadata


def load_plain(source: str | Path | io.BytesIO, what: str) -> Any:
    """A pickle of a checkpoint (``what``: how the refusal names it) read as tensors and plain
    values (``torch.load(weights_only=True)``); anything else is refused with
    ``UnsafeCheckpointError`` and none of it runs."""
    try:
        return torch.load(source, weights_only=True)
    except pickle.UnpicklingError as e:
        found = re.search(r"Unsupported global: GLOBAL (\S+)", str(e))
        # Torch's message also suggests weights_only=False: quote only its unpickler's finding.
        detail = re.search(r"WeightsUnpickler error:\s*(\S[^\n]*)", str(e))
        problem = (f"refers to {found.group(1)}, which is not plain data" if found else
                   f"is not plain data ({detail.group(1)[:200] if detail else type(e).__name__})")
        raise UnsafeCheckpointError(f"{what} {problem}; loading it could run code, so it was not loaded") from None


def refusal(checkpoint: Path | str, error: UnsafeCheckpointError, where: str = "") -> str:
    """The message of a checkpoint refused for what a file of it holds (``where``: on which rank)."""
    return (f"checkpoint {checkpoint} was refused{where}: {error}. Fix: use only checkpoints this runner wrote; a "
            "checkpoint from elsewhere may have been tampered with.")


def read_rng_state(file: Path) -> torch.Tensor:
    """A rank's ``rng-rank<R>.pt`` (or ``cuda-rng-rank<R>.pt``), through ``load_plain``."""
    state = load_plain(file, file.name)
    if not (isinstance(state, torch.Tensor) and state.dtype == torch.uint8):
        raise UnsafeCheckpointError(f"{file.name} holds {shown(state)}, not a CPU generator's state")
    return state


class SafePlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` that loads non-tensor entries through ``load_plain``."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        obj = load_plain(value, f"entry {fqn!r}")
        # torch 2.13's DefaultLoadPlanner.load_bytes, with the value loaded above.
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


def root_causes(error: BaseException) -> list[tuple[int | None, BaseException]]:
    """(rank, exception) for each failure a DCP ``CheckpointException`` gathered from the ranks;
    any other exception is its own root cause."""
    if isinstance(error, CheckpointException):
        return [(rank, exc) for rank, (exc, _trace) in sorted(error.failures.items())]
    return [(None, error)]


def read_model_tensors(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The model's tensors of a DCP checkpoint (not the optimizer's), by full name, read in this
    process alone (no collective: rank 0 of a run may call it), the safe way. Nothing is allocated
    beyond what the checkpoint's shard files can hold. The caller checks the manifests first
    (``runner.checkpoint.checkpointer.verify_checkpoint``)."""
    reader = SafeReader(str(checkpoint))
    try:
        metadata = reader.read_metadata()
    except UnsafeCheckpointError as e:
        raise CheckpointError(refusal(checkpoint, e)) from None
    entries = {key.removeprefix("model."): meta for key, meta in metadata.state_dict_metadata.items()
               if key.startswith("model.") and isinstance(meta, TensorStorageMetadata)}
    wanted = sum(m.size.numel() * m.properties.dtype.itemsize for m in entries.values())
    on_disk = sum(f.stat().st_size for f in checkpoint.glob("*.distcp"))
    if wanted > on_disk:
        raise CheckpointError(f"checkpoint {checkpoint}: its .metadata describes {wanted} bytes of model tensors, "
                              f"its shards hold {on_disk} bytes (.metadata corrupt, or shards missing). Nothing was "
                              "loaded. Fix: another checkpoint of that run.")
    model = {name: torch.empty(m.size, dtype=m.properties.dtype) for name, m in entries.items()}
    try:
        with warnings.catch_warnings():  # one process on purpose: DCP's note that it assumes so says nothing
            warnings.filterwarnings("ignore", "torch.distributed is disabled, unavailable or uninitialized")
            dcp.load({"model": model}, checkpoint_id=str(checkpoint), storage_reader=reader,
                     planner=SafePlanner(), no_dist=True)
    except (Exception, CheckpointException) as e:  # the latter is a BaseException
        rank, exc = root_causes(e)[0]
        if isinstance(exc, UnsafeCheckpointError):
            raise CheckpointError(refusal(checkpoint, exc)) from None
        first_line = (str(exc).strip().splitlines() or [""])[0]
        raise CheckpointError(f"checkpoint {checkpoint} could not be read: {type(exc).__name__}: {first_line}") from e
    return model
