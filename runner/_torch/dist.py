"""Every use of torch's private distributed internals outside pipelining (``_torch_pp``) and DCP
(``_torch_dcp``): the caches of DTensor and the meshes' registries that keep process groups alive,
the region of the whole tensor a DTensor's local shard holds (``local_region``), and a
collective's result still in flight (``wait_pending``).
When a torch release moves them, this file is the one to change (a group left alive is then named
by ``runner.ranks.dist.cleanup``'s warning, and the tests' spawns fail on it). Tested with torch 2.13.
"""

from __future__ import annotations

import gc
import importlib
import os
import sys

__all__ = ["drop_dtensor_caches", "drop_mesh_groups", "own_compile_cache", "local_region", "wait_pending"]

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


def drop_mesh_groups() -> None:
    """Empty every live mesh's registry of process groups (``DeviceMesh._pg_registry``, kept for
    ``torch.compile``). Compiled code keeps meshes alive past the run, copies of the run's that no
    cache of ours reaches (Dynamo's guards hold copied DTensor specs, and a copied mesh rebuilds its
    own registry), and so their groups: found on the heap, once, as the rank ends."""
    if "torch.distributed.device_mesh" not in sys.modules:
        return
    from torch.distributed.device_mesh import DeviceMesh

    for obj in gc.get_objects():
        # Not isinstance: DeviceMesh's metaclass checks would run on every object of the heap.
        if DeviceMesh in type(obj).__mro__ and isinstance(getattr(obj, "_pg_registry", None), dict):
            obj._pg_registry.clear()


def own_compile_cache(name: str) -> str:
    """Have torch.compile cache into ``<its cache directory>/<name>`` in this process from now on
    (the user's ``TORCHINDUCTOR_CACHE_DIR``, else torch's default; Triton's follows it), and return
    that directory. Calling it again with the same name changes nothing. torch keys its AOTAutograd
    cache of DTensor programs by their specs, which every rank shares (pytorch/pytorch#188390; the
    fix that adds the device does not tell CPU ranks apart), so ranks sharing a host's cache load
    each other's compiled tensor-parallel units, whose shard offsets differ."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    current = cache_dir()
    if os.path.basename(current) != name:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(current, name)
    return os.environ["TORCHINDUCTOR_CACHE_DIR"]


def local_region(tensor) -> tuple[slice, ...]:
    """The part of the whole tensor that ``tensor``'s local data holds, one slice per dimension:
    all of it for a plain tensor; for a DTensor (tp's shards, FSDP's, both at once), its chunk as
    DCP records it when saving (``__create_chunk_list__``: offsets and sizes from the placements,
    FSDP's strided sharding over tp included)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(tensor, DTensor):
        return tuple(slice(0, n) for n in tensor.shape)
    (chunk,) = tensor.__create_chunk_list__()  # one local chunk per rank
    return tuple(slice(o, o + n) for o, n in zip(chunk.offsets, chunk.sizes))


def wait_pending(out):
    """``out`` (a stage's output) waited for in place where it is a tp collective's result still in
    flight: an ``AsyncCollectiveTensor``, e.g. a vocabulary-parallel embedding's sum when the
    embedding ends its stage (nothing after it in the stage consumes it, which would wait). The
    pipeline sends a detached view of a stage's output, and a view keeps the result pending: the
    send could read it before the all-reduce ends, and the work stays registered unwaited at exit
    ("unwaited collective calls", gloo's threads alive after the group is destroyed). Waiting in
    place keeps the tensor, and its autograd history, as it is."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    if isinstance(out, AsyncCollectiveTensor):
        out.trigger_wait()
    return out
