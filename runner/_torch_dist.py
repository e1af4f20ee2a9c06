"""Every use of torch's private distributed internals outside pipelining (``_torch_pp``) and DCP
(``_torch_dcp``): the caches of DTensor that keep process groups alive. When a torch release moves
them, this file is the one to change (a group left alive is then named by ``runner.dist.cleanup``'s
warning, and the tests' spawns fail on it). Tested with torch 2.13.
"""

from __future__ import annotations

import importlib
import sys

__all__ = ["drop_dtensor_caches"]

# (module, what to call): each empties a cache whose keys or values hold DTensor specs or meshes,
# and so the process groups, of every op a DTensor (FSDP's parameters, replicate's) went through.
_DTENSOR_CACHES = (
    ("torch.distributed.tensor.debug", "_clear_sharding_prop_cache"),  # this thread's, and the fast path's
    ("torch.distributed.tensor._sharding_prop", "ShardingPropagator._propagate_tensor_meta_cached.cache_clear"),
    ("torch.distributed.tensor._redistribute", "clear_redistribute_planner_cache"),
    ("torch.distributed.tensor._redistribute", "_gen_transform_infos.cache_clear"),
    ("torch.distributed.tensor._collective_utils", "MeshTopoInfo.build_from_mesh.cache_clear"),
)


def drop_dtensor_caches() -> None:
    """Empty DTensor's caches (``_DTENSOR_CACHES``); one torch no longer has is passed over (the
    groups it keeps alive are then named by ``cleanup``'s warning)."""
    if "torch.distributed.tensor" not in sys.modules:  # no DTensor ever ran here: nothing to drop
        return
    for module, path in _DTENSOR_CACHES:
        try:
            target: object = importlib.import_module(module)
            for name in path.split("."):
                target = getattr(target, name)
        except (ImportError, AttributeError):
            continue
        target()  # type: ignore[operator]
