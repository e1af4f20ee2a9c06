"""DCP's ``.metadata`` as each Python pickles it: some (3.11.2, Debian's; 3.12+) write an enum
member as ``getattr(cls, name)``, which the safe reader admits for the metadata's enums only."""

from __future__ import annotations

import enum
import io
import pickle
from pathlib import PosixPath

import pytest
import torch
import torch.distributed.checkpoint as dcp

from runner._torch.dcp import SafeReader, UnsafeCheckpointError


class _EnumsByGetattr(pickle.Pickler):
    """Pickles enum members as Python 3.11.2 does, on any Python."""

    def reducer_override(self, obj):
        if isinstance(obj, enum.Enum):
            return getattr, (type(obj), obj.name)
        return NotImplemented


def _repickled(metadata, pickler=_EnumsByGetattr) -> bytes:
    out = io.BytesIO()
    pickler(out, protocol=pickle.HIGHEST_PROTOCOL).dump(metadata)
    return out.getvalue()


def test_metadata_with_enum_members_pickled_by_getattr_loads(tmp_path):
    dcp.save({"w": torch.arange(6.0).reshape(2, 3)}, checkpoint_id=tmp_path, no_dist=True)
    original = SafeReader(str(tmp_path)).read_metadata()
    written = _repickled(original)
    assert b"getattr" in written
    (tmp_path / ".metadata").write_bytes(written)
    loaded = SafeReader(str(tmp_path)).read_metadata()
    assert loaded.state_dict_metadata == original.state_dict_metadata
    properties = loaded.state_dict_metadata["w"].properties
    assert isinstance(properties.memory_format, torch.memory_format) and properties.dtype == torch.float32


def test_getattr_in_metadata_reaches_nothing_but_enum_members(tmp_path):
    dcp.save({"w": torch.ones(2)}, checkpoint_id=tmp_path, no_dist=True)

    class _Crafted:
        def __reduce__(self):
            return getattr, (PosixPath, "cwd")  # an allowed class, but a method: not an enum member

    (tmp_path / ".metadata").write_bytes(pickle.dumps(_Crafted()))
    with pytest.raises(UnsafeCheckpointError, match=r"'PosixPath'\.cwd, which is not a member of a checkpoint "
                                                    r"metadata enum"):
        SafeReader(str(tmp_path)).read_metadata()
