"""Weights tied across stages (an input embedding and the output head), trained as Megatron does.

In the unsplit model one tensor serves both ends and collects both gradients. Pipelined, the first
and the last stage may sit on different ranks: each holds a copy, the copies start equal
(``split.fill``), their gradients are summed between the ranks that hold them after every
backward, so the same update keeps them equal. Where both ends are on one rank (V placements) the
two stage modules share one parameter, unless data parallelism wraps each stage on its own (FSDP
cannot share a parameter between two ``fully_shard`` roots): then the copies are summed locally.
The global gradient norm counts the weight once, and checkpoints store it once, under the name of
its first owner in the unsplit model. With tensor parallelism both ends are sharded on their
vocabulary rows over the same tp group, so each tp shard sums with its peer of its own pipeline
(a group per pipeline, ``dims.groups_of("pp")``) the rows it holds.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import AbstractSet, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from runner.models.split import tied_stages
from runner.parallel.mesh import Mesh
from runner.ranks.watchdog import waiting

__all__ = ["TiedGroup", "log_tied_placement", "share_local_copies", "TiedWeights"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TiedGroup:
    canonical: str  # the name the unsplit model gives the weight (its first owner's)
    local: tuple[str, ...]  # this rank's names of it (one per distinct copy)
    ranks: tuple[int, ...]  # the pipeline ranks holding a copy


def log_tied_placement(meta, stages, stage_to_rank: dict[int, int], per_stage: bool) -> None:
    """Say, before any rank starts, how each tied weight of the meta model will be trained under
    this layout: one parameter, or a copy per stage with summed gradients (``per_stage``: dp wraps
    each stage on its own)."""
    for names, (owners, _) in zip(meta.tied, tied_stages(meta, stages)):
        ranks = sorted({stage_to_rank[s] for s in owners})
        if len(owners) > 1:
            log.info("Tied weight %s spans stages %s on ranks %s: %s", " = ".join(names), owners, ranks,
                     "one parameter" if len(ranks) == 1 and not per_stage else "a copy each, gradients summed")


def _params_by_name(modules: list[nn.Module]) -> dict[str, nn.Parameter]:
    out: dict[str, nn.Parameter] = {}
    for module in modules:
        out.update(module.named_parameters(remove_duplicate=False))
    return out


def _set_param(root: nn.Module, name: str, param: nn.Parameter) -> None:
    owner, _, leaf = name.rpartition(".")
    setattr(root.get_submodule(owner), leaf, param)


def share_local_copies(modules: Sequence[nn.Module], groups: list[list[str]]) -> None:
    """Make the copies of a tied weight on this rank one parameter (before any wrapping)."""
    for names in groups:
        holders = [(m, n) for m in modules for n, _ in m.named_parameters(remove_duplicate=False) if n in names]
        if len({id(m) for m, _ in holders}) < 2:
            continue
        first = holders[0][0].get_parameter(holders[0][1])
        for module, name in holders[1:]:
            _set_param(module, name, first)


def _local(modules: list[nn.Module], names: list[str]) -> tuple[str, ...]:
    """This rank's names of a tied weight, one per distinct tensor."""
    seen, out = set(), []
    for name, p in _params_by_name(modules).items():
        if name in names and id(p) not in seen:
            seen.add(id(p))
            out.append(name)
    return tuple(sorted(out, key=names.index))


class TiedWeights:
    """This rank's part in keeping tied copies equal. ``groups``: the unsplit model's tied
    parameter names; ``rank_of``: pipeline rank of each parameter name's stage; ``embedding_names``:
    the names in groups that hold an ``nn.Embedding`` (weight decay treats all as embeddings)."""

    def __init__(self, groups: list[list[str]], rank_of: dict[str, int], modules: list[nn.Module], mesh: Mesh,
                 *, embedding_names: AbstractSet[str] = frozenset()):
        self.modules = modules
        self.embedding_names = embedding_names  # names of weights tied to an embedding
        self.groups: list[TiedGroup] = []
        self._process_groups: list[dist.ProcessGroup | None] = []
        for names in groups:
            ranks = tuple(sorted({rank_of[n] for n in names}))
            group = TiedGroup(names[0], _local(modules, names), ranks)
            self.groups.append(group)
            # Every rank creates every group (a collective), one per pipeline (data-parallel replica).
            pg = None
            if len(ranks) > 1 and mesh.device_mesh is not None:
                for pipeline in mesh.dims.groups_of("pp"):
                    members = [pipeline[r] for r in ranks]
                    created = dist.new_group(members)
                    if mesh.rank in members:
                        pg = created
            self._process_groups.append(pg)

    def __bool__(self) -> bool:
        return any(g.local for g in self.groups)

    def sync_grads(self) -> None:
        """Sum the copies' gradients (this rank's, then across the ranks holding copies) and give
        every copy the sum: what the one tensor of the unsplit model collects."""
        params = _params_by_name(self.modules)
        for group, pg in zip(self.groups, self._process_groups):
            copies = [params[n] for n in group.local]
            grads = [_as_param(p) for p in copies if p.grad is not None]
            if not copies or (len(copies) == 1 and pg is None):
                continue
            total = _local_tensor(grads[0]).clone() if grads else torch.zeros_like(_local_tensor(copies[0]))
            for g in grads[1:]:
                total += _local_tensor(g)
            if pg is not None:
                with waiting("the tied weights' gradient sum"):  # between stages: outside any action
                    dist.all_reduce(total, group=pg)
            for p in copies:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                _local_tensor(p.grad).copy_(total)

    def not_counted(self) -> set[str]:
        """Names of the copies the global gradient norm must skip: all but the first owner's."""
        return {n for g in self.groups for n in g.local if n != g.canonical}

    def renames(self) -> tuple[dict[str, str], dict[str, str]]:
        """For checkpoints: (local name -> canonical name) of the copy each rank stores, and
        (local name -> that copy's local name) of the other copies on this rank (equal to it)."""
        stored, equal = {}, {}
        for g in self.groups:
            if not g.local:
                continue
            rep = g.canonical if g.canonical in g.local else g.local[0]
            if rep != g.canonical:
                stored[rep] = g.canonical
            equal.update({n: rep for n in g.local if n != rep})
        return stored, equal


def _as_param(p: nn.Parameter) -> torch.Tensor:
    """``p``'s gradient, laid out as ``p`` is. Under tensor parallelism the copies are sharded
    alike (the embedding's and the head's vocabulary rows, ``Shard(0)`` over the same tp group),
    but DTensor's embedding backward returns the whole gradient (``Replicate``) on every shard:
    taken to the parameter's placements (a local slice, no communication), each shard sums its
    own rows with its peers'. Set back on ``p``, so the optimizer steps a shard with its rows."""
    grad = p.grad
    assert grad is not None
    if isinstance(grad, DTensor) and isinstance(p, DTensor) and grad.placements != p.placements:
        p.grad = grad = grad.redistribute(p.device_mesh, p.placements)
    return grad


def _local_tensor(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t
