"""Plans for hardware this host does not have (``python -m runner.plan plan.target=<device>``).

The model is built from its config alone (``model=hf`` needs only ``config.json``: weights are
never read) and run unit by unit under ``FakeTensorMode``: shapes without memory or compute. Each
unit's forward, input-gradient (I) and weight-gradient (W) passes are counted op by op
(``runner.plan.roofline``: FLOPs and bytes at the named device's peaks, divided by
``plan.efficiency``), with the bytes its forward keeps for backward. Candidates are pp x dp (the
product is ``plan.world_size``; a tp degree is one more factor of ``Degrees``) x dp mode x schedule
x microbatches; each is simulated as the planner simulates probed candidates
(``runner.pipeline.simulate``), with a message of ``latency + bytes / bandwidth`` per cross-rank
dependency, then the gradient sum of a weight tied across pipeline ranks where the ranks holding its
copies meet after their backward (``tied_s``), the step's gradient synchronisation over dp and the
slowest rank's AdamW update; without the
barrier (``plan.barrier=false``) the steady step of ``train.optimizer_sync=deferred`` instead, each
rank's synchronisation and update between its own steps, and the ranks holding a tied weight's copies
meeting after every backward to sum its gradient (``runner.pipeline.simulate.deferred_step``).
Memory per rank is ``runner.plan.memory``'s whole-rank estimate. Nothing here needs a GPU.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, replace
from typing import NamedTuple

import torch
from omegaconf import DictConfig, OmegaConf, open_dict

from runner._torch.dispatch import FakeTensorMode
from runner.errors import ConfigError
from runner.losses import build_loss
from runner.models.split import MetaModel, StageModule, build_meta_model, split_by_cost
from runner.parallel.dims import ParallelDims
from runner.parallel.parallelize import checkpointed_blocks
from runner.pipeline.ops import Op
from runner.pipeline.schedule import (
    SCHEDULES,
    check_schedule,
    default_stages_per_rank,
    placement,
    schedule_order,
)
from runner.pipeline.simulate import deferred_step, expected_makespan, peak_in_flight, simulate
from runner.plan.link import Link, configured_link, ring_all_reduce_s, tied_meetings
from runner.plan.memory import FP32, rank_memory, rank_params
from runner.plan.planner import DEFERRED, amortized_step, committed_steps
from runner.plan.roofline import DevicePeaks, OpCounter, device_peaks
from runner.validate import tied_spans

__all__ = ["UnitCount", "Degrees", "TargetCandidate", "Link", "count_units", "model_flops", "degrees", "plan_target"]

_KINDS = ("F", "I", "W")
_ADAMW_BYTES = 9 * FP32  # per parameter: read p, g, m, v and write p, m, v; the norm and clip read/write g
# train.optimizer_sync=deferred's update: AdamW's bytes and the snapshot's (read p, m, v, write their copies)
_SNAPSHOT = (_ADAMW_BYTES + 6 * FP32) / _ADAMW_BYTES


@dataclass(frozen=True)
class UnitCount:
    """One pipeline unit on one microbatch: FLOPs, bytes and roofline seconds (at the peaks,
    efficiency 1) of its F, I and W passes, and what it holds and sends."""

    params: int
    flops: dict[str, int]
    bytes: dict[str, int]
    seconds: dict[str, float]
    saved_bytes: int  # distinct tensors its forward keeps for backward (parameters excluded)
    output_bytes: int  # what it sends on


class Degrees(NamedTuple):
    pp: int
    dp: int
    tp: int = 1  # not planned yet (runner.parallel.tp's costs are not modelled): always 1


@dataclass
class TargetCandidate:
    schedule: str  # a runner.pipeline.registry name, or "none" (pp=1: the unsplit model, microbatches accumulated)
    pp: int
    dp: int
    tp: int
    dp_mode: str
    microbatches: int
    stages_per_rank: int
    overrides: list[str]
    valid: bool = False
    reason: str = ""
    split_points: list[str] = field(default_factory=list)
    step_time_s: float | None = None
    pipeline_s: float | None = None  # of the step: the simulated pipeline
    sync_s: float | None = None  # the gradient all-reduce (ddp) or all-gather + reduce-scatter (fsdp) over dp
    optimizer_s: float | None = None  # the slowest rank's norm, clip and AdamW update
    # the tied weights' gradient sums where the pipeline ranks holding a copy meet, beyond the pipeline's
    # end (with the barrier, and a commit step's; plan.barrier=false's steady step has them in it)
    tied_s: float = 0.0
    bubble: float | None = None
    mfu: float | None = None  # model FLOPs per second over the ranks' dense peak
    memory_per_rank: list[dict[str, int]] = field(default_factory=list)  # runner.plan.memory, per pipeline rank
    fits_device: bool = True  # every rank's total within the device's memory
    stage_costs_s: dict[str, float] = field(default_factory=dict)
    tie: bool = False
    recommended: bool = False
    # plan.barrier=false: a step validated at its own end (evaluated, saved, compared by verify, the
    # last), which the next cannot overlap; and the step averaged over the run (runner.plan.planner.committed_steps)
    commit_step_s: float | None = None
    amortized_step_s: float | None = None


def _config_only(model_cfg: DictConfig) -> DictConfig:
    """The model config with its weights never read (``model=hf``: random init, from config.json)."""
    cfg = copy.deepcopy(model_cfg)
    if "pretrained" in cfg:
        with open_dict(cfg):
            cfg.pretrained = False
    return cfg


def _count_unit(unit: StageModule, x: torch.Tensor, loss_fn, targets: torch.Tensor | None,
                peaks: DevicePeaks) -> tuple[UnitCount, torch.Tensor]:
    """Count one unit's F, I and W under the active fake mode; returns its count and its output."""
    inp = x.detach().requires_grad_(x.is_floating_point())
    params = [p for p in unit.parameters() if p.requires_grad]
    own = {p.untyped_storage()._cdata for p in unit.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage._cdata not in own:  # a weight (or a view of it) is the parameter, not an activation
            saved[storage._cdata] = storage.nbytes()
        return t.detach()  # not ``t``: see ``runner.verify.memory.activation_bytes``

    counters = {k: OpCounter(peaks) for k in ("F", "I", "B")}
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), counters["F"]:
        out = unit(inp)
        loss = out if targets is None else loss_fn(out, targets)
    grad = None if targets is not None else torch.ones_like(out)
    wrt = [inp] if inp.requires_grad else []
    if wrt:
        with counters["I"]:
            torch.autograd.grad(loss, wrt, grad, retain_graph=True)
    if wrt or params:
        with counters["B"]:  # the whole backward: I + W
            torch.autograd.grad(loss, wrt + params, grad, allow_unused=True)
    f, i, b = counters["F"], counters["I"], counters["B"]
    count = UnitCount(sum(p.numel() for p in unit.parameters()),
                      {"F": f.flops, "I": i.flops, "W": max(0, b.flops - i.flops)},
                      {"F": f.bytes, "I": i.bytes, "W": max(0, b.bytes - i.bytes)},
                      {"F": f.seconds, "I": i.seconds, "W": max(0.0, b.seconds - i.seconds)},
                      sum(saved.values()), out.numel() * out.element_size())
    return count, out.detach()


def _unit_key(unit: StageModule, name: str, x: torch.Tensor, last: bool) -> tuple:
    """What a unit's counts depend on: its modules' classes and parameter shapes (relative to the
    unit), its attention kind where the model has several, and its input."""
    module = unit.get_submodule(name)
    return (tuple(type(m).__name__ for m in module.modules()),
            tuple((n, tuple(p.shape)) for n, p in module.named_parameters()),
            getattr(module, "attention_type", None), tuple(x.shape), x.dtype, last)


def count_units(cfg: DictConfig, microbatch_size: int, peaks: DevicePeaks, *,
                cast_params: bool = False) -> dict[str, UnitCount]:
    """Every pipeline unit of ``cfg.model`` (built from its config alone) counted on one microbatch
    of ``microbatch_size`` samples of ``train.seq_len`` tokens, in the run's precision and with its
    activation checkpointing (a recomputed block keeps only its input, and its backward runs its
    forward again). Units alike (a model's identical layers) are counted once. bf16 is autocast
    (each forward keeps bf16 copies of the weights it used, as a run without FSDP does), or with
    ``cast_params`` the parameters themselves are bf16 (FSDP's mixed precision gathers them so)."""
    meta = build_meta_model(_config_only(cfg.model), cfg.parallel.get("stage_modules"))
    spec, names = meta.spec, meta.unit_names
    recomputed = checkpointed_blocks(spec.blocks(), cfg.train.activation_checkpointing, cfg.train.ac_every)
    fake = FakeTensorMode(allow_non_fake_inputs=True)  # the meta model's tensors are taken in, then replaced
    with fake:
        x = torch.zeros(microbatch_size, cfg.train.seq_len, dtype=torch.long)
        targets = torch.zeros(microbatch_size, cfg.train.seq_len, dtype=torch.long)
    loss_fn, counts = build_loss(cfg.loss), {}
    alike: dict[tuple, tuple[UnitCount, torch.Tensor]] = {}
    for index, name in enumerate(names):
        last = index == len(names) - 1
        modules = {n: copy.deepcopy(meta.module.get_submodule(n)) for n in [*spec.unit(name).modules, *spec.shared]}
        unit = StageModule(spec, [name], modules)
        bf16 = cfg.train.precision == "bf16"
        unit.autocast_dtype = torch.bfloat16 if bf16 and not cast_params else None
        key = _unit_key(unit, name, x, last)
        if key not in alike:
            if bf16 and cast_params:
                unit.to(torch.bfloat16)  # on the meta device, before its fake tensors exist
            with fake:
                unit.to_empty(device="cpu")
                alike[key] = _count_unit(unit, x, loss_fn, targets if last else None, peaks)
        count, out = alike[key]
        if name in recomputed:
            count = replace(count, saved_bytes=x.numel() * x.element_size(),
                            seconds={**count.seconds, "I": count.seconds["I"] + count.seconds["F"]})
        counts[name], x = count, out
    return counts


def model_flops(counts: dict[str, UnitCount]) -> int:
    """One microbatch's model FLOPs through every unit, MFU's numerator as PaLM and Megatron-LM
    define it: three times the forward's (the backward computes twice the forward's products). Not
    the sum of the passes counted: torch's counter gives a flash attention backward its recomputed
    scores too (2.5x the forward's attention: MFU read 4% high at d=4096 and sequence 8192, 9.5% at
    32768), and activation checkpointing's recomputation is the hardware's work, not the model's."""
    return 3 * sum(u.flops["F"] for u in counts.values())


def degrees(world_size: int, num_units: int) -> list[Degrees]:
    """Every (pp, dp, tp) whose product is ``world_size``, with no more pipeline ranks than units."""
    return [Degrees(pp, world_size // pp) for pp in range(1, min(world_size, num_units) + 1) if world_size % pp == 0]


def _stages(names: list[str], counts: dict[str, UnitCount], num_stages: int) -> list[list[str]]:
    """The contiguous split balancing each stage's F + I + W roofline time."""
    points = split_by_cost(names, [sum(counts[n].seconds.values()) for n in names], num_stages)
    bounds = [0, *(names.index(p) for p in points), len(names)]
    return [names[a:b] for a, b in zip(bounds, bounds[1:])]


def _stage_costs(stages: list[list[str]], counts: dict[str, UnitCount], efficiency: float) -> dict:
    costs = {}
    for s, names in enumerate(stages):
        f, i, w = (sum(counts[n].seconds[k] for n in names) / efficiency for k in _KINDS)
        # The first stage's input (token ids) takes no gradient: its I is empty, its W the whole backward.
        costs.update({(s, "F"): f, (s, "B"): i + w, (s, "I"): i if s else 0.0, (s, "W"): w if s else i + w})
    return costs


def _sync_s(params: int, dp: int, dp_mode: str, compute_bytes: int, link: Link) -> float:
    """The gradient synchronisation after the pipeline, over a ring of dp ranks (not overlapped
    with compute: an upper bound for replicate's all-reduce, which starts in the last backward)."""
    if dp == 1 or dp_mode == "none":
        return 0.0
    if dp_mode == "fsdp":  # all-gather of the parameters (compute dtype), reduce-scatter of fp32 gradients
        return 2 * link.latency_s * (dp - 1) + (dp - 1) / dp * params * (compute_bytes + FP32) / link.bandwidth
    return ring_all_reduce_s(params * FP32, dp, link)


def _order(name: str, pp: int, m: int, spr: int) -> dict[int, list[Op]]:
    if name == "none":  # pp=1: each microbatch's forward and backward in turn (gradient accumulation)
        return {0: [Op(0, kind, mb) for mb in range(m) for kind in "FB"]}
    return schedule_order(name, pp, m, spr)


def _meetings(meta: MetaModel, stages: list[list[str]], to_rank: dict[int, int], c: TargetCandidate,
              link: Link) -> list[tuple[tuple[int, ...], float]]:
    """The tied weights' gradient sums where the pipeline ranks holding a copy meet after every
    backward (``runner.validate.tied_spans``, as a run's ``Layout.tied``): each a ring all-reduce of
    its fp32 gradient (FSDP: a shard) between them (``runner.plan.link.tied_meetings``)."""
    return tied_meetings(tied_spans(meta, stages, to_rank,
                                    OmegaConf.create({"tp": c.tp, "dp": c.dp, "dp_mode": c.dp_mode})), link)


def _predict(c: TargetCandidate, names: list[str], counts: dict[str, UnitCount], peaks: DevicePeaks,
             link: Link, cfg: DictConfig, meta: MetaModel) -> None:
    num_stages = c.pp * c.stages_per_rank
    stages = _stages(names, counts, num_stages)
    c.split_points = [s[0] for s in stages[1:]]
    to_rank = {0: 0} if c.schedule == "none" else placement(c.schedule, c.pp, num_stages)
    eff = cfg.plan.efficiency
    costs = _stage_costs(stages, counts, eff)
    message = max(counts[s[-1]].output_bytes for s in stages)
    order = _order(c.schedule, c.pp, c.microbatches, c.stages_per_rank)
    timeline = simulate(order, costs, num_stages=num_stages, comm_s=link.seconds(message))
    c.pipeline_s = max(a.end for a in timeline)
    c.bubble = 1 - sum(a.end - a.start for a in timeline) / (c.pp * c.pipeline_s)
    meetings = _meetings(meta, stages, to_rank, c, link)
    c.tied_s = expected_makespan(order, costs, num_stages=num_stages, comm_s=link.seconds(message),
                                 meetings=meetings) - c.pipeline_s if meetings else 0.0
    compute_bytes = 2 if cfg.train.precision == "bf16" else FP32
    params = rank_params(stages, {n: counts[n].params for n in names}, to_rank, c.pp)
    shards = c.dp if c.dp_mode == "fsdp" else 1
    syncs = [_sync_s(p, c.dp, c.dp_mode, compute_bytes, link) for p in params]
    updates = [p / shards * _ADAMW_BYTES / (peaks.bandwidth * eff) for p in params]
    c.sync_s, c.optimizer_s = max(syncs), max(updates)
    c.step_time_s = c.pipeline_s + c.tied_s + c.sync_s + c.optimizer_s
    if not cfg.plan.barrier:  # train.optimizer_sync=deferred: each rank's sync and update between its own steps
        between = {r: syncs[r] + updates[r] * _SNAPSHOT for r in range(c.pp)}
        c.commit_step_s = c.pipeline_s + c.tied_s + max(between.values()) + link.latency_s
        c.pipeline_s = deferred_step(order, costs, num_stages=num_stages, comm_s=link.seconds(message))
        c.bubble = 1 - sum(a.end - a.start for a in timeline) / (c.pp * c.pipeline_s)
        c.step_time_s = deferred_step(order, costs, num_stages=num_stages, comm_s=link.seconds(message),
                                      update_s=between, reduce_s=link.latency_s, meetings=meetings)
    held = peak_in_flight(order, {s: sum(counts[n].saved_bytes for n in names) for s, names in enumerate(stages)})
    c.memory_per_rank = [rank_memory(p, held[r], dp=c.dp, dp_mode=c.dp_mode, compute_bytes=compute_bytes)
                         for r, p in enumerate(params)]
    c.fits_device = max(m["total"] for m in c.memory_per_rank) <= peaks.memory_bytes
    flops = c.dp * c.microbatches * model_flops(counts)
    dtype = torch.bfloat16 if cfg.train.precision == "bf16" else torch.float32
    c.mfu = flops / (c.step_time_s * c.pp * c.dp * c.tp * peaks.peak(dtype))
    c.stage_costs_s = {f"{s}{k}": v for (s, k), v in sorted(costs.items())}
    c.valid = True


def _layouts(cfg: DictConfig, world_size: int, num_units: int):
    """(degrees, dp mode, schedule, microbatches, stages per rank) of every candidate."""
    for deg in degrees(world_size, num_units):
        replica = cfg.train.batch_size // deg.dp
        modes = ["none"] if deg.dp == 1 else ["ddp", "fsdp"]
        names = ["none"] if deg.pp == 1 else list(SCHEDULES)
        for mode in modes:
            for name in names:
                for m in cfg.plan.microbatches:
                    if cfg.train.batch_size % deg.dp == 0 and replica % m == 0:
                        yield deg, mode, name, m, 1 if name == "none" else default_stages_per_rank(name)


def _overrides(deg: Degrees, mode: str, name: str, m: int, spr: int) -> list[str]:
    out = [f"parallel.pp={deg.pp}", f"parallel.dp={deg.dp}", f"parallel.dp_mode={mode}", f"parallel.microbatches={m}"]
    return out + ([] if name == "none" else [f"schedule={name}", f"parallel.stages_per_rank={spr}"])


class TargetPlan(NamedTuple):
    candidates: list[TargetCandidate]  # valid and fitting first, fastest first
    peaks: DevicePeaks
    link: Link
    world_size: int


def plan_target(cfg: DictConfig) -> TargetPlan:
    """Every candidate layout on ``plan.world_size`` ranks of ``plan.target``, predicted from the
    model's FLOP and byte counts; ties within ``plan.tie_tolerance`` of the fastest that fits the
    device's memory are marked, the one holding least memory recommended."""
    peaks = device_peaks(cfg.plan.target)
    if not 0 < cfg.plan.efficiency <= 1:
        raise ConfigError(f"plan.efficiency={cfg.plan.efficiency}: the fraction of the device's peaks its ops reach "
                          "must be in (0, 1]. Fix: e.g. plan.efficiency=0.5.")
    world_size = cfg.plan.world_size or ParallelDims.from_config(cfg.parallel).world_size
    if world_size < 1:
        raise ConfigError(f"plan.world_size={world_size}: plan for at least one rank. Fix: plan.world_size=8.")
    link = configured_link(cfg.plan.comm_latency_s, cfg.plan.comm_bandwidth)
    meta = build_meta_model(_config_only(cfg.model), cfg.parallel.get("stage_modules"))
    num_units = len(meta.unit_names)
    counted: dict[tuple[int, bool], dict[str, UnitCount]] = {}
    out = []
    for deg, mode, name, m, spr in _layouts(cfg, world_size, num_units):
        c = TargetCandidate(name, deg.pp, deg.dp, deg.tp, mode, m, spr,
                            _overrides(deg, mode, name, m, spr) + ([] if cfg.plan.barrier else [DEFERRED]))
        out.append(c)
        try:
            if name != "none":
                if deg.pp * spr > num_units:
                    raise ConfigError(f"{deg.pp * spr} stages but the model has {num_units} pipeline units")
                check_schedule(name, pp=deg.pp, stages_per_rank=spr, microbatches=m)
        except ConfigError as e:
            c.reason = str(e).splitlines()[0]
            continue
        key = (cfg.train.batch_size // (deg.dp * m), mode == "fsdp")
        if key not in counted:
            counted[key] = count_units(cfg, key[0], peaks, cast_params=key[1])
        _predict(c, list(counted[key]), counted[key], peaks, link, cfg, meta)
    if not any(c.valid for c in out):
        raise ConfigError(f"no layout of {world_size} ranks can run this model: "
                          f"{out[0].reason if out else 'no microbatch count in plan.microbatches divides the batch'}. "
                          "Fix: another plan.world_size, train.batch_size or plan.microbatches.")
    committed, steps = committed_steps(cfg)
    for c in out:  # plan.barrier=false: the steps validated at their own end, over the run's
        if c.commit_step_s is not None and c.step_time_s is not None:
            c.amortized_step_s = amortized_step(c.step_time_s, c.commit_step_s, committed, max(steps, 1))
    out.sort(key=lambda c: (not c.valid, not c.fits_device, c.step_time_s or 0.0))
    _mark_ties(out, cfg.plan.tie_tolerance)
    return TargetPlan(out, peaks, link, world_size)


def _mark_ties(ranked: list[TargetCandidate], tolerance: float) -> None:
    fitting = [c for c in ranked if c.valid and c.fits_device]
    if not fitting:
        return
    fastest = fitting[0].step_time_s or 0.0
    tied = [c for c in fitting if (c.step_time_s or 0.0) <= fastest * (1 + tolerance)]
    for c in tied:
        c.tie = len(tied) > 1
    min(tied, key=lambda c: (max(m["total"] for m in c.memory_per_rank), c.step_time_s or 0.0)).recommended = True
