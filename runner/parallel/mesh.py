"""The ranks' ``DeviceMesh``, built from the one owner of the layout (``runner.parallel.dims``): its named
dimensions in the owner's rank order (``pp``, ``dp``, and ``tp`` where it is above 1), and the
sub-meshes and groups each rank uses. Nothing else creates meshes.

Each replica is a whole pipeline, and the ranks holding the same stage in every replica form a dp
group; which rank is where is ``ParallelDims``'s arithmetic, never repeated here."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from runner._torch.dist import drop_dtensor_caches, drop_mesh_groups
from runner.ranks.dist import DistEnv, release_at_cleanup

if TYPE_CHECKING:  # the owner's instances arrive built (ResolvedRun.dims): no import chain through here
    from runner.parallel.dims import Coords, ParallelDims

__all__ = ["Mesh", "build_mesh"]


@dataclass(frozen=True)
class Mesh:
    dims: ParallelDims
    rank: int
    device_mesh: DeviceMesh | None  # None for a single process

    @property
    def coords(self) -> Coords:
        return self.dims.coords(self.rank)

    @property
    def pp(self) -> int:
        return self.dims.pp

    @property
    def dp(self) -> int:
        return self.dims.dp

    @property
    def pp_rank(self) -> int:
        return self.coords.pp

    @property
    def dp_rank(self) -> int:
        return self.coords.dp

    def submesh(self, dim: str) -> DeviceMesh | None:
        """This rank's 1-D mesh along ``dim`` (None for a single process)."""
        return self.device_mesh[dim] if self.device_mesh is not None else None

    def group(self, dim: str) -> dist.ProcessGroup | None:
        """This rank's process group along ``dim`` (None for a single process)."""
        sub = self.submesh(dim)
        return sub.get_group() if sub is not None else None

    @property
    def pp_group(self) -> dist.ProcessGroup | None:
        return self.group("pp")

    @property
    def dp_mesh(self) -> DeviceMesh | None:
        return self.submesh("dp")

    @property
    def tp_mesh(self) -> DeviceMesh | None:
        """The stage's tensor-parallel shards (None at tp=1: the mesh has no tp dimension)."""
        return self.submesh("tp") if self.dims.tp > 1 else None


def build_mesh(env: DistEnv, dims: ParallelDims) -> Mesh:
    dims.check(env.world_size)
    return Mesh(dims=dims, rank=env.rank, device_mesh=_cached_device_mesh(env, tuple(dims.mesh_dims.items())))


@lru_cache(maxsize=None)  # groups are collective to create: once per mesh shape per process
def _cached_device_mesh(env: DistEnv, shape: tuple[tuple[str, int], ...]) -> DeviceMesh | None:
    if env.world_size == 1:
        return None
    return init_device_mesh(env.device.type, tuple(d for _, d in shape), mesh_dim_names=tuple(n for n, _ in shape))


# The meshes hold their process groups: the cached ones, DTensor's caches (FSDP's and replicate's
# parameters are DTensors on them) and compiled code's guards keep meshes alive. All let go of
# the groups when they go (runner.ranks.dist.cleanup).
release_at_cleanup(_cached_device_mesh.cache_clear)
release_at_cleanup(drop_mesh_groups)
release_at_cleanup(drop_dtensor_caches)
