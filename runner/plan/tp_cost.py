"""Tensor parallelism in the planner: the layouts of the same ranks over pp x dp x tp
(``plan.search_degrees``), and what tp changes in each child's measured costs.

A child whose layers the model's plan shards (``runner.parallel.tp``) computes its sharded part on 1/tp of
the weights, and adds the collectives torch's styles run per microbatch: a rowwise layer's
all-reduce of its output in the forward, a colwise layer's all-reduce of its input gradient in
the backward (each colwise layer its own: q, k and v are three), the vocabulary-sharded
embedding's all-reduce of its output, and the head's all-gather of the logits. Their sizes are
the activations' (tokens of a microbatch x features x the element size); their cost is a ring
all-reduce over tp ranks (``runner.plan.link.ring_all_reduce_s``: 2(tp-1) messages of 1/tp of the
bytes; an all-gather half of them) on the link of the all-reduce the calibration measured between
two ranks (``Calibration.all_reduce_link``: it is two such messages), or of its message where it was
not measured. Candidates that tp cannot shard (heads that do not divide, a
model without a plan) are refused by the same ``validate`` a run makes, with its reason."""

from __future__ import annotations

import copy
import dataclasses
import functools
from dataclasses import dataclass
from typing import Callable, Iterator, Mapping

from omegaconf import DictConfig, OmegaConf

from runner.parallel.dims import ParallelDims
from runner.plan.calibrate import Calibration
from runner.plan.costs import ChildCost
from runner.plan.link import ring_all_reduce_s

__all__ = ["UnitCollectives", "by_degrees", "degree_variants", "single_stage_once", "degrees_of", "degree_overrides",
           "unit_collectives", "collective_s", "tp_child_costs", "tp_child_at"]

_ACTIVATION_BYTES = {"fp32": 4, "bf16": 2}


@dataclass(frozen=True)
class UnitCollectives:
    """What tp adds to one unit per microbatch: the features of each collective (bytes per token
    are these times the activations' element size) and the part of its parameters tp shards."""

    forward_all_reduce: tuple[int, ...] = ()
    backward_all_reduce: tuple[int, ...] = ()  # input gradients: a zero-bubble I runs them
    forward_all_gather: tuple[int, ...] = ()  # the head's logits, whole on every shard
    sharded_fraction: float = 0.0


def _factorisations(world: int) -> list[tuple[int, int, int]]:
    return [(pp, dp, world // (pp * dp)) for pp in range(1, world + 1) if world % pp == 0
            for dp in range(1, world // pp + 1) if (world // pp) % dp == 0]


def degree_variants(cfg: DictConfig) -> list[DictConfig]:
    """The run's config, then (``plan.search_degrees``) one per other pp x dp x tp of its ranks:
    replicas are kept in step (``ddp`` where the run has no dp mode)."""
    own = ParallelDims.from_config(cfg.parallel)
    out = [cfg]
    if not cfg.plan.get("search_degrees", False):
        return out
    for pp, dp, tp in _factorisations(own.world_size):
        if (pp, dp, tp) == (own.pp, own.dp, own.tp):
            continue
        variant = copy.deepcopy(cfg)
        variant.parallel.pp, variant.parallel.dp, variant.parallel.tp = pp, dp, tp
        if dp > 1 and own.dp_mode == "none":
            variant.parallel.dp_mode = "ddp"
        if pp > 1 and cfg.parallel.get("split_points"):
            variant.parallel.split_points = None  # the run's split is for its own number of stages
        out.append(variant)
    return out


def single_stage_once(variant: DictConfig, candidates: list[tuple[str, int, int | None]]) -> list:
    """The candidates worth planning at ``variant``'s degrees: at pp=1 the runner trains the unsplit
    model whatever the schedule, so one single-stage schedule per microbatch count stands for all."""
    if int(variant.parallel.pp) > 1:
        return candidates
    seen: set[int] = set()
    out = []
    for name, m, spr in candidates:
        if spr == 1 and m not in seen:
            seen.add(m)
            out.append((name, m, spr))
    return out


def by_degrees(cfg: DictConfig, candidates_of: Callable[[DictConfig], list[tuple[str, int, int | None]]]
               ) -> Iterator[tuple[DictConfig, tuple[str, int, int | None]]]:
    """(the config at some degrees, a candidate there): the run's own degrees' candidates first."""
    for variant in degree_variants(cfg):
        for candidate in single_stage_once(variant, candidates_of(variant)):
            yield variant, candidate


def degrees_of(cfg: DictConfig) -> dict[str, int]:
    return {k: int(cfg.parallel.get(k, 1)) for k in ParallelDims.ORDER}


def degree_overrides(variant: DictConfig, cfg: DictConfig) -> list[str]:
    """The command-line keys that turn the run's degrees into the variant's (none for the run's own)."""
    keys = (*ParallelDims.ORDER, "dp_mode")
    return [f"parallel.{k}={variant.parallel.get(k)}" for k in keys
            if variant.parallel.get(k) != cfg.parallel.get(k, 1 if k in ParallelDims.ORDER else None)]


@functools.lru_cache(maxsize=4)
def _collectives_of(model_yaml: str, stage_modules: str) -> dict[str, UnitCollectives]:
    from torch import nn

    from runner.models.split import build_meta_model
    from runner.parallel.tp import model_plan, stage_plan

    listed = OmegaConf.create(stage_modules) if stage_modules != "null" else None
    meta = build_meta_model(OmegaConf.create(model_yaml), listed)  # type: ignore[arg-type]
    planned = stage_plan(meta.module, model_plan(meta.module))
    out = {}
    for unit in meta.unit_names:
        prefixes = meta.spec.unit(unit).modules
        forward, backward, gather, sharded, total = [], [], [], 0, 0
        for prefix in prefixes:
            total += sum(p.numel() for p in meta.module.get_submodule(prefix).parameters())
        for name, style in planned.items():
            if not any(name == p or name.startswith(f"{p}.") for p in prefixes):
                continue
            module = meta.module.get_submodule(name)
            sharded += sum(p.numel() for p in module.parameters(recurse=False))
            if isinstance(module, nn.Embedding):
                forward.append(module.embedding_dim)  # a vocabulary shard's rows, summed over the group
            elif isinstance(module, nn.Linear):
                if style == "rowwise":
                    forward.append(module.out_features)
                elif style in ("colwise", "colwise_gather_output"):
                    backward.append(module.in_features)
                    if style == "colwise_gather_output":
                        gather.append(module.out_features)
        out[unit] = UnitCollectives(tuple(forward), tuple(backward), tuple(gather), sharded / max(total, 1))
    return out


def unit_collectives(cfg: DictConfig) -> dict[str, UnitCollectives]:
    """Per unit of the model (the planner's children), what tp adds (built once per model)."""
    listed = cfg.parallel.get("stage_modules")
    return _collectives_of(OmegaConf.to_yaml(cfg.model, resolve=True),
                           OmegaConf.to_yaml(listed) if listed is not None else "null")


def collective_s(calibration: Calibration, nbytes: float, tp: int, *, gather: bool = False) -> float:
    """One all-reduce (or all-gather: the ring's second half) of ``nbytes`` over ``tp`` ranks, a ring
    on the calibration's all-reduce link (``runner.plan.link.ring_all_reduce_s``)."""
    return ring_all_reduce_s(nbytes, tp, calibration.all_reduce_link(), gather=gather)


def tp_child_costs(child: Mapping[str, ChildCost], cfg: DictConfig, calibration: Calibration,
                   microbatch_size: int) -> dict[str, ChildCost]:
    """The children's costs at ``cfg``'s tp (unchanged at tp=1): the sharded part of each
    child's compute, memory and update divided by tp, its collectives added."""
    tp = int(cfg.parallel.get("tp", 1))
    if tp == 1:
        return dict(child)
    per_token = _ACTIVATION_BYTES.get(str(cfg.train.precision), 4)
    tokens = microbatch_size * int(cfg.train.seq_len)
    units = unit_collectives(cfg)
    out = {}
    for name, c in child.items():
        u = units.get(name, UnitCollectives())
        share = 1 - u.sharded_fraction + u.sharded_fraction / tp
        forward = (sum(collective_s(calibration, f * per_token * tokens, tp) for f in u.forward_all_reduce)
                   + sum(collective_s(calibration, f * per_token * tokens, tp, gather=True)
                         for f in u.forward_all_gather))
        backward = sum(collective_s(calibration, f * per_token * tokens, tp) for f in u.backward_all_reduce)
        out[name] = dataclasses.replace(
            c, forward_s=c.forward_s * share + forward, backward_s=c.backward_s * share + backward,
            input_backward_s=c.input_backward_s * share + backward, weight_backward_s=c.weight_backward_s * share,
            saved_bytes=round(c.saved_bytes * share), update_s=c.update_s * share,
            snapshot_s=c.snapshot_s * share)
    return out


def tp_child_at(child_at: Callable[[int], Mapping[str, ChildCost]], cfg: DictConfig,
                calibration: Calibration) -> Callable[[int], dict[str, ChildCost]]:
    """``child_at`` (children's costs by microbatch count) at ``cfg``'s tp: what the probes of a
    tp run are fitted against, so that the fit does not absorb tp's collectives a second time."""
    dp = int(cfg.parallel.dp)
    return lambda m: tp_child_costs(child_at(m), cfg, calibration, int(cfg.train.batch_size) // (dp * m))
