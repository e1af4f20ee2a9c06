"""The one place that knows the ranks' 2D layout: a ``DeviceMesh`` of (dp, pp).

Rank ``r`` is pipeline rank ``r % pp`` of data-parallel replica ``r // pp``: each replica is a
whole pipeline, and the ranks holding the same stage in every replica form a dp group.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from runner._torch_dist import drop_dtensor_caches
from runner.dist import DistEnv, release_at_cleanup

__all__ = ["Mesh", "build_mesh"]


@dataclass(frozen=True)
class Mesh:
    pp: int
    dp: int
    pp_rank: int
    dp_rank: int
    device_mesh: DeviceMesh | None  # None for a single process

    @property
    def pp_group(self) -> dist.ProcessGroup | None:
        return self.device_mesh["pp"].get_group() if self.device_mesh is not None else None

    @property
    def dp_mesh(self) -> DeviceMesh | None:
        return self.device_mesh["dp"] if self.device_mesh is not None else None


def build_mesh(env: DistEnv, *, pp: int, dp: int) -> Mesh:
    if pp * dp != env.world_size:
        raise ValueError(f"parallel.pp={pp} x parallel.dp={dp} != {env.world_size} ranks")
    return _cached_mesh(env, pp, dp)


@lru_cache(maxsize=None)  # groups are collective to create: once per layout per process
def _cached_mesh(env: DistEnv, pp: int, dp: int) -> Mesh:
    device_mesh = None
    if env.world_size > 1:
        device_mesh = init_device_mesh(env.device.type, (dp, pp), mesh_dim_names=("dp", "pp"))
    return Mesh(pp=pp, dp=dp, pp_rank=env.rank % pp, dp_rank=env.rank // pp, device_mesh=device_mesh)


# The cached meshes hold their process groups, and DTensor's caches hold the meshes (FSDP's and
# replicate's parameters are DTensors on them): both go with the groups (runner.dist.cleanup).
release_at_cleanup(_cached_mesh.cache_clear)
release_at_cleanup(drop_dtensor_caches)
