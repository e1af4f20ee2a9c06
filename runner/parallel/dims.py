"""The one owner of the parallel layout: the degree of each parallel dimension, the order of the
ranks, and the arithmetic between a rank and its coordinates. ``runner.parallel.mesh`` builds the
``DeviceMesh`` from it; validation, the launcher, the planner, the config's resolvers and the
ranks read it. Nothing else multiplies degrees or divides ranks.

Rank order, outermost first: ``pp``, ``dp``, ``tp``, as torchtitan and Megatron-LM order them: a
tensor-parallel group (the most communication) on consecutive ranks, one node's fast links, then
the replicas, the pipeline outermost (a message per microbatch, between nodes): with pp=2 x dp=2
x tp=2, ranks 0 and 1 are one tensor-parallel group, ranks 0-3 the first pipeline rank's stages
in both replicas. Changing the order is a change of ``ParallelDims.ORDER`` alone: every group
below is derived.

Pure arithmetic, no ``torch.distributed``: cheap for the modules that run before any rank starts."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

from runner.errors import ConfigError

__all__ = ["Coords", "ParallelDims", "check_tp_options"]


class Coords:
    """One rank's coordinate along each parallel dimension, by the dimension's name (``coords.pp``:
    which pipeline rank, ``coords.dp``: which replica, ``coords.tp``: which tensor-parallel shard).
    The names are the owner's (``ParallelDims.ORDER``); positional arguments follow that order."""

    __slots__ = ("_of",)
    _of: dict[str, int]

    def __init__(self, *values: int, **named: int) -> None:
        given = {**dict(zip(ParallelDims.ORDER, values)), **named}
        order = [*(n for n in ParallelDims.ORDER if n in given), *(n for n in given if n not in ParallelDims.ORDER)]
        object.__setattr__(self, "_of", {n: given[n] for n in order})  # read in the owner's order, as given

    def __getattr__(self, name: str) -> int:
        if name.startswith("_"):
            raise AttributeError(name)
        try:
            return self._of[name]
        except KeyError:
            raise AttributeError(f"Coords has no dimension {name!r} (it has {', '.join(self._of)})") from None

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("Coords is frozen")

    def asdict(self) -> dict[str, int]:
        return dict(self._of)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Coords) and self._of == other._of

    def __hash__(self) -> int:
        return hash(tuple(sorted(self._of.items())))

    def __repr__(self) -> str:
        return f"Coords({', '.join(f'{k}={v}' for k, v in self._of.items())})"

    def __reduce__(self) -> tuple:
        return (_coords, (self._of,))


def _coords(of: dict[str, int]) -> Coords:
    return Coords(**of)


@dataclass(frozen=True)
class ParallelDims:
    """The run's parallel degrees, built once from ``cfg.parallel`` (``from_config``)."""

    pp: int  # pipeline ranks of one replica
    dp: int  # replicas of the whole pipeline
    dp_mode: str = "none"  # a runner.parallel.dp name
    tp: int = 1  # the shards of each stage's layers (runner.parallel.tp)
    # How the tp shards split what flows between the layers (runner.parallel.tp): the sequence between the
    # blocks, the vocabulary into the loss.
    sequence_parallel: bool = False
    loss_parallel: bool = False

    # The parallel dimensions, outermost first (consecutive ranks differ in the last one): the one
    # list of them. The DeviceMesh's dimensions, the coordinates, the checks of each degree and the
    # summary's keys follow it; each is a field above and ``parallel.<name>`` in ParallelConfig.
    ORDER: ClassVar[tuple[str, ...]] = ("pp", "dp", "tp")
    # The dimensions the mesh always has (the ranks read their groups even at degree 1); any
    # other one only where it is used (degree > 1), so a run without it creates no groups for it.
    ALWAYS: ClassVar[tuple[str, ...]] = ("pp", "dp")

    @classmethod
    def key(cls, name: str) -> str:
        """The config key of a dimension's degree, for messages: ``parallel.pp``."""
        return f"parallel.{name}"

    @classmethod
    def from_config(cls, parallel: Any) -> ParallelDims:
        """From the composed ``cfg.parallel`` (a DictConfig, or a dict); a degree it lacks is 1."""
        get = parallel.get
        return cls(**{name: int(get(name, 1)) for name in cls.ORDER}, dp_mode=str(get("dp_mode", "none")),
                   sequence_parallel=bool(get("sequence_parallel")), loss_parallel=bool(get("loss_parallel")))

    @property
    def degrees(self) -> dict[str, int]:
        """Each dimension's degree, in rank order (outermost first)."""
        return {name: getattr(self, name) for name in self.ORDER}

    @property
    def world_size(self) -> int:
        return math.prod(self.degrees.values())

    @property
    def stage_ranks(self) -> int:
        """The ranks that hold each stage (its replicas and its tensor-parallel shards): a value
        every one of them adds to a world-wide sum counts this many times."""
        return self.world_size // self.pp

    @property
    def mesh_dims(self) -> dict[str, int]:
        """The dimensions the ``DeviceMesh`` has, in rank order (``ALWAYS``, and the others used)."""
        return {name: d for name, d in self.degrees.items() if name in self.ALWAYS or d > 1}

    def coords(self, rank: int) -> Coords:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside 0..{self.world_size - 1}")
        out = {}
        for name in reversed(self.ORDER):  # innermost first: the fastest-changing digit
            rank, out[name] = divmod(rank, getattr(self, name))
        return Coords(**out)

    def rank_of(self, coords: Coords) -> int:
        rank = 0
        for name in self.ORDER:
            rank = rank * getattr(self, name) + getattr(coords, name)
        return rank

    def ranks_of(self, dim: str, rank: int) -> list[int]:
        """The ranks of ``rank``'s group along ``dim`` (the ranks that differ from it in ``dim``
        alone), indexed by their coordinate along ``dim``."""
        here = self.coords(rank).asdict()
        return [self.rank_of(Coords(**{**here, dim: i})) for i in range(getattr(self, dim))]

    def groups_of(self, dim: str) -> list[list[int]]:
        """Every group along ``dim``, each as ``ranks_of`` gives it, ordered by their first rank:
        the same list on every rank (process groups are created in the same order everywhere)."""
        return [list(g) for g in sorted({tuple(self.ranks_of(dim, r)) for r in range(self.world_size)})]

    def describe(self) -> str:
        """The product, as the keys that set it: ``parallel.pp=2 x parallel.dp=2``."""
        parts = [f"{self.key(n)}={d}" for n, d in self.degrees.items() if n in self.ALWAYS or d > 1]
        return " x ".join(parts)

    def check(self, world_size: int, *, started_by: str = "the launcher", restart: str | None = None) -> None:
        """The one check of the degrees against the ranks a job has. ``started_by`` names what
        started them (``torchrun``), ``restart`` how to start the right number with it."""
        if world_size == self.world_size:
            return
        others = self.world_size // self.pp
        keys = (f"parallel.pp={world_size // others}" if world_size % others == 0
                else f"{' and '.join(map(self.key, self.ORDER))} whose product is {world_size}")
        start = restart or f"start {self.world_size} ranks"
        raise ConfigError(f"{started_by} started {world_size} ranks but {self.describe()} = {self.world_size}. "
                          f"Fix: {start}, or {keys}.")


def check_tp_options(parallel: Any, seq_len: int, loss: Any) -> None:
    """The checks of ``parallel.sequence_parallel`` and ``parallel.loss_parallel`` that need only the
    config (those that need the model: ``runner.parallel.tp.check_tp``)."""
    tp = int(parallel.get("tp", 1))
    for key in ("sequence_parallel", "loss_parallel"):
        if tp == 1 and parallel.get(key):
            raise ConfigError(f"parallel.{key}=true shards over the tensor-parallel group, but parallel.tp=1. "
                              f"Fix: parallel.tp=2 or more, or parallel.{key}=false.")
    if parallel.get("sequence_parallel") and seq_len % tp:
        raise ConfigError(f"parallel.sequence_parallel=true shards the sequence over parallel.tp={tp}, but "
                          f"train.seq_len={seq_len} does not divide. Fix: train.seq_len a multiple of {tp}.")
    if parallel.get("loss_parallel"):
        target, smoothing = loss.get("_target_"), loss.get("label_smoothing", 0.0)
        if target != "runner.losses.cross_entropy" or smoothing:
            raise ConfigError(f"parallel.loss_parallel=true computes torch's vocabulary-parallel cross-entropy, not "
                              f"loss._target_={target} with label_smoothing={smoothing}. Fix: "
                              "parallel.loss_parallel=false, or the built-in cross-entropy without label smoothing.")
