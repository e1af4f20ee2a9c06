"""Model → stages: build the model without memory, choose which pipeline units each stage holds,
and materialise only what a rank owns of them, initialised exactly as the unsplit model is: its
stage modules are copied out of the meta model (``stage_skeleton``), laid out on the meta device
by tp and dp (``runner.parallel``), then ``fill`` allocates only the rank's shards and fills them
one module at a time (``materialize``: both at once, for a whole stage).

A stage module holds its units under their full names (a skeleton of the model with only those
modules), so every parameter keeps its full name (``model.layers.3.self_attn.q_proj.weight``) in
every stage: checkpoints, ``verify`` and reports line up with the unsplit model. The units and how
a stage runs them come from the model's ``ModelSpec`` (``runner.models.units``).
"""

from __future__ import annotations

import copy
import hashlib
import logging
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Sequence

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig
from torch import nn

from runner._torch.dist import local_region, wait_pending
from runner.errors import ConfigError
from runner.models.units import ModelSpec, describe_names, spec_for, tied_groups

__all__ = ["StageModule", "MetaModel", "build_meta_model", "split_by_cost", "plan_split", "check_shapes", "stage_io",
           "seed_for", "check_init", "check_keyword_inputs", "stage_skeleton", "fill", "materialize", "tied_groups",
           "tied_stages"]

log = logging.getLogger("runner.split")  # named as before runner/ became packages (runner.log)


class _Container(nn.Module):
    """A level of the model's name tree that holds a stage's units (``model``, ``model.layers``)."""


class StageModule(nn.Module):
    """The units of one stage, run in order by the model's spec, and also:

    * keyword inputs (e.g. ``attention_mask``) reach every unit: torch's schedules hand each stage
      the step's keyword inputs, and the spec routes them (or derives masks and positions from them);
    * ``autocast_dtype`` (set for ``train.precision=bf16``) autocasts the forward only: backward
      runs in the dtypes the forward chose, and recomputation under activation checkpointing
      restores the same autocast state;
    * ``seq_shards``, given when it is built: how many slices of the sequence its hidden states are
      (tp under sequence parallelism, ``runner.parallel.tp``), which the spec's ``run`` is told so
      that positions and masks cover the whole sequence.
    """

    autocast_dtype: torch.dtype | None = None

    def __init__(self, spec: ModelSpec, units: Sequence[str], modules: Mapping[str, nn.Module], *,
                 seq_shards: int = 1):
        super().__init__()
        self.spec = spec
        self.units = tuple(units)
        self.seq_shards = seq_shards
        for name, module in modules.items():
            *path, leaf = name.split(".")
            parent: nn.Module = self
            for part in path:
                if part not in parent._modules:
                    parent.add_module(part, _Container())
                child = parent._modules[part]
                assert child is not None, f"{name}: {part} is a registered None, not a module"
                parent = child
            parent.add_module(leaf, module)

    def unit_modules(self) -> list[nn.Module]:
        """Every module the stage's units hold (a unit may hold several: GPT-2's wte, wpe, drop)."""
        return [self.get_submodule(n) for u in self.units for n in self.spec.unit(u).modules]

    def forward(self, x: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        cast = torch.autocast(x.device.type, dtype=self.autocast_dtype) if self.autocast_dtype else nullcontext()
        with cast:  # a tp all-reduce still in flight at the stage's end is waited for before the send
            return wait_pending(self.spec.run(self, self.units, x, kwargs, seq_shards=self.seq_shards))


@dataclass
class MetaModel:
    """The model on the meta device (shapes only), its units, and its tied parameters (taken when
    it is built: materialising a stage re-allocates, and so unties, the modules it takes)."""

    module: nn.Module
    spec: ModelSpec
    tied: list[list[str]]

    @property
    def unit_names(self) -> list[str]:
        return self.spec.unit_names


def build_meta_model(model_cfg: DictConfig, stage_modules: Sequence[Sequence[str]] | None = None) -> MetaModel:
    """Instantiate the model factory on the meta device: shapes only, no memory, no init."""
    try:
        with torch.device("meta"):
            model = instantiate(model_cfg)
    except Exception as e:  # the user's factory can fail in any way
        cause = e.__cause__ if isinstance(e.__cause__, ConfigError) else None
        if cause is not None:  # the factory's own message (model=hf: a missing config.json, ...)
            raise cause from None
        raise ConfigError(
            f"model._target_={model_cfg.get('_target_')!r} could not be built: {e}\n"
            "Fix: check the model keys; a model factory must accept the keys of its model group."
        ) from e
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model._target_={model_cfg.get('_target_')!r} returned {type(model).__name__}, "
                          "not an nn.Module. Fix: return the model (see docs/models.md, 'Bring your own model').")
    return MetaModel(model, spec_for(model, stage_modules), tied_groups(model))


def tied_stages(meta: MetaModel, stages: Sequence[Sequence[str]]) -> list[tuple[list[int], int]]:
    """Each tied weight of the meta model under this split: the stages holding a copy (by the units
    whose modules own one of its names) and its elements."""
    stage_of = {u: i for i, units in enumerate(stages) for u in units}
    out = []
    for names in meta.tied:
        owners = sorted({stage_of[u] for n in names for u in meta.unit_names if u in stage_of
                         and any(n.startswith(f"{m}.") for m in meta.spec.unit(u).modules)})
        out.append((owners, meta.module.get_parameter(names[0]).numel()))
    return out


def _balanced_bounds(costs: Sequence[float], num_stages: int) -> list[int]:
    """Start index of each stage for contiguous groups that minimise the costliest group."""
    n = len(costs)
    prefix: list[float] = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[k][i]: minimal max-cost of splitting units[:i] into k groups; cut[k][i]: last start.
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0
    for k in range(1, num_stages + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost < best[k][i]:
                    best[k][i], cut[k][i] = cost, j
    starts, i = [], n
    for k in range(num_stages, 0, -1):
        i = cut[k][i]
        starts.append(i)
    return starts[::-1]


def split_by_cost(names: Sequence[str], costs: Sequence[float], num_stages: int) -> list[str]:
    """``parallel.split_points`` (the units that start stages 1..) of the contiguous split
    of ``names`` whose costliest stage costs least."""
    return [names[i] for i in _balanced_bounds(costs, num_stages)[1:]]


def _expand(meta: MetaModel, name: str) -> list[str]:
    """A listed name as units: a module whose entries are units stands for them."""
    if name in meta.spec._by_name:
        return [name]
    try:
        children = [f"{name}.{child}" for child, _ in meta.module.get_submodule(name).named_children()]
    except AttributeError:
        return [name]
    return children if children and all(c in meta.spec._by_name for c in children) else [name]


def plan_split(meta: MetaModel, num_stages: int, split_points: Sequence[str] | None = None,
               stage_modules: Sequence[Sequence[str]] | None = None) -> tuple[tuple[str, ...], ...]:
    """The unit names of each stage, in stage order: as ``stage_modules`` lists them, starting at
    ``split_points``, or balanced by the spec's cost hints (``ModelSpec.unit_costs``)."""
    names = meta.unit_names
    if stage_modules is not None:
        return _listed_stages(meta, num_stages, stage_modules)
    if len(names) < num_stages:
        raise ConfigError(
            f"The model has {len(names)} pipeline units ({describe_names(names)}) but the layout needs "
            f"{num_stages} stages. Fix: a deeper model (the built-in models' model.n_layers, model=hf's "
            "model.config_overrides.num_hidden_layers), or lower parallel.pp or "
            "parallel.stages_per_rank."
        )
    if split_points is None:
        starts = _balanced_bounds(meta.spec.unit_costs(meta.module), num_stages)
    else:
        points = list(split_points)
        unknown = [p for p in points if p not in names]
        if unknown:
            raise ConfigError(
                f"parallel.split_points={points} names no pipeline unit: {unknown}. "
                f"Fix: use unit names of the model: {describe_names(names)}."
            )
        if len(points) != num_stages - 1:
            raise ConfigError(
                f"parallel.split_points={points} gives {len(points) + 1} stages but the layout "
                f"has {num_stages}. Fix: give {num_stages - 1} names, or split_points=null."
            )
        starts = [0] + [names.index(p) for p in points]
        if any(b <= a for a, b in zip(starts, starts[1:])):
            raise ConfigError(
                f"parallel.split_points={points} are out of order or start the first stage. "
                f"Fix: list unit names in model order after '{names[0]}': {describe_names(names[1:])}."
            )
    bounds = starts + [len(names)]
    stages = tuple(tuple(names[a:b]) for a, b in zip(bounds, bounds[1:]))
    assert sum(len(s) for s in stages) == len(names), "split must cover every unit once"
    return stages


def _listed_stages(meta: MetaModel, num_stages: int,
                   stage_modules: Sequence[Sequence[str]]) -> tuple[tuple[str, ...], ...]:
    listed = [list(s) for s in stage_modules]
    if len(listed) != num_stages:
        raise ConfigError(
            f"parallel.stage_modules lists {len(listed)} stages but the layout has {num_stages} "
            "(parallel.pp x stages per rank). Fix: one list per stage, or change parallel.pp / "
            "parallel.stages_per_rank."
        )
    stages = tuple(tuple(u for name in stage for u in _expand(meta, name)) for stage in listed)
    if any(not s for s in stages):
        raise ConfigError(f"parallel.stage_modules={listed} has an empty stage. Fix: give every stage a module.")
    flat = [u for s in stages for u in s]
    if flat != meta.unit_names:
        unknown = [u for u in flat if u not in meta.unit_names]
        problem = (f"names no pipeline unit: {unknown}" if unknown else
                   "does not list every unit exactly once, in model order")
        raise ConfigError(f"parallel.stage_modules={listed} {problem}. "
                          f"Fix: split this list into stages: {describe_names(meta.unit_names)}.")
    return stages


def check_init(meta: MetaModel) -> None:
    """Every module that owns parameters or buffers can be initialised on its own (the runner
    allocates and initialises only a rank's own units): all those that cannot, listed at once."""
    missing = meta.spec.cannot_init(meta.module)
    if missing:
        raise ConfigError(
            f"{len(missing)} module(s) own parameters or buffers but have no reset_parameters(), so the runner "
            f"cannot initialise them from the meta device: {', '.join(missing[:10])}"
            f"{' …' if len(missing) > 10 else ''}. Fix: give each a reset_parameters() method that "
            "initialises its own parameters and buffers."
        )


def check_shapes(
    meta: MetaModel, stages: Sequence[Sequence[str]], *, microbatch: int, seq_len: int,
    kwargs: dict[str, torch.Tensor] | None = None,
) -> int:
    """Run one microbatch through the meta model, unit by unit: a unit that cannot take its
    predecessor's output (so one stage cannot take the previous stage's) fails here, named, in
    milliseconds and without memory, instead of inside a rank. ``kwargs`` are one microbatch's
    keyword inputs. Returns the logits' last dimension (the model's vocabulary)."""
    stage_of = {name: i for i, names in enumerate(stages) for name in names}
    x = torch.zeros(microbatch, seq_len, dtype=torch.long, device="meta")
    kwargs = {k: v.to("meta") for k, v in (kwargs or {}).items()}
    for name in meta.unit_names:
        try:  # the meta model holds every unit and the shared modules: run this unit alone
            x = meta.spec.run(meta.module, [name], x, kwargs)
        except Exception as e:
            hint = ("a unit receives one tensor (and the keyword inputs its forward names); a layer that needs "
                    "more (rotary position embeddings, a mask) must compute it itself, or use model=hf for a "
                    "Hugging Face causal LM" if isinstance(e, TypeError) else "make consecutive units' shapes agree")
            raise ConfigError(
                f"Model unit '{name}' (stage {stage_of[name]}) cannot take the output of the unit before it "
                f"(shape {tuple(x.shape)}): {e}\nFix: {hint} (see docs/models.md, 'Bring your own model')."
            ) from e
        if not isinstance(x, torch.Tensor):
            raise ConfigError(f"Model unit '{name}' (stage {stage_of[name]}) returned {type(x).__name__}; "
                              "stages pass one tensor. Fix: return a single tensor.")
    if x.dim() != 3 or tuple(x.shape[:2]) != (microbatch, seq_len):
        raise ConfigError(f"The model returns shape {tuple(x.shape)}, not logits (batch, seq, vocab) with "
                          f"(batch, seq) = {(microbatch, seq_len)}. Fix: end the model with a head to the vocabulary.")
    return x.shape[-1]


def check_keyword_inputs(meta: MetaModel, kwargs: Mapping[str, torch.Tensor]) -> None:
    """The dataset's keyword inputs against those the model consumes: one it ignores is refused."""
    consumed = meta.spec.keyword_inputs()
    unused = sorted(set(kwargs) - consumed) if consumed is not None else []
    if unused:
        raise ConfigError(f"The dataset returns keyword inputs {unused}, which the {meta.spec.family} model does not "
                          f"take (it takes {sorted(consumed or ())}). Fix: a dataset that returns only those.")


def stage_io(meta: MetaModel, stages: Sequence[Sequence[str]], *, microbatch: int, seq_len: int,
             kwargs: dict[str, torch.Tensor] | None = None, seq_shards: int = 1,
             ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each stage's input and output for one microbatch, as meta tensors (shapes and dtypes, no
    memory), from the same unit-by-unit pass ``check_shapes`` makes (which has accepted it): what a
    ``PipelineStage`` built with static metadata is given. ``seq_shards`` (sequence parallelism)
    slices the sequence of what flows between stages, as each tp rank holds it."""
    x = torch.zeros(microbatch, seq_len, dtype=torch.long, device="meta")
    kwargs = {k: v.to("meta") for k, v in (kwargs or {}).items()}
    out = []
    last = len(stages) - 1
    for units in stages:
        inputs = x
        for name in units:
            x = meta.spec.run(meta.module, [name], x, kwargs)
        out.append((inputs, x))
    if seq_shards > 1:
        def local(t: torch.Tensor) -> torch.Tensor:
            return t.new_empty(t.shape[0], t.shape[1] // seq_shards, *t.shape[2:])

        out = [(x_in if i == 0 else local(x_in), x_out if i == last else local(x_out))
               for i, (x_in, x_out) in enumerate(out)]
    return out


def seed_for(seed: int, name: str) -> int:
    """A 63-bit generator seed drawn from the run seed and ``name`` (a module's full name; a
    pipeline rank's dropout: ``runner.train``), the same in every process."""
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


@contextmanager
def _seeded(seed: int, name: str) -> Iterator[None]:
    """The CPU generator (modules are initialised on CPU) seeded for ``name``, its state restored
    after. Not ``torch.manual_seed``: it also seeds every accelerator's generators, which
    ``fork_rng(devices=[])`` does not restore, and without CUDA queues each call with its stack
    formatted (milliseconds per module, kept for the process's life)."""
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(seed_for(seed, name))
        yield


def _set_param(root: nn.Module, name: str, param: nn.Parameter) -> None:
    owner, _, leaf = name.rpartition(".")
    setattr(root.get_submodule(owner), leaf, param)


def _init(spec: ModelSpec, root: nn.Module, names: Sequence[str], seed: int) -> None:
    """Initialise the named modules of ``root``, each under a generator seeded from the run seed
    and its full name: a module initialises identically whichever stage or process builds it."""
    with torch.no_grad():
        for name in spec.init_order(names):
            module = root.get_submodule(name)
            if not spec.needs_init(module):
                continue
            with _seeded(seed, name):
                spec.init_module(name, module)


def stage_skeleton(meta: MetaModel, units: Sequence[str], *, seq_shards: int = 1) -> StageModule:
    """A stage module holding copies of ``units`` of the meta model (and its shared modules), still
    on the meta device: what tensor and data parallelism lay out (``runner.parallel``) before
    ``fill`` allocates anything. The meta model itself is left as it is (the units ``fill`` builds
    are copied from it). Weights tied within the stage are one parameter. ``seq_shards``: the
    ``StageModule``'s (sequence parallelism)."""
    spec = meta.spec
    names = [n for u in units for n in spec.unit(u).modules] + list(spec.shared)
    stage = StageModule(spec, units, {n: copy.deepcopy(meta.module.get_submodule(n)) for n in names},
                        seq_shards=seq_shards)
    _tie(stage, meta.tied)  # copied one module at a time: tie them again
    return stage


def fill(meta: MetaModel, stage: StageModule, *, seed: int, device: torch.device) -> StageModule:
    """Allocate ``stage``'s tensors on ``device`` and give them the unsplit model's values, never
    holding more than one of its modules whole: a parameter that tp or FSDP laid out (a DTensor)
    gets only this rank's shard. Pretrained tensors are read by slice, each its own part alone
    (``ModelSpec.load_pretrained``); the rest are initialised one top-level module (a unit's
    module, a shared one) at a time: built whole on CPU (so every device gets the same numbers),
    initialised under seeds from the run seed and the module names (``_init``), this rank's part
    of each tensor copied out, the whole freed. In place; returns ``stage``.

    A parameter tied to one outside the stage (a head tied to the embedding of the first stage)
    gets the value the unsplit model gives it: that of its first owner in model order."""
    stage.to_empty(device=device)
    _tie(stage, meta.tied)  # allocation gives each name its own tensor
    loaded = meta.spec.load_pretrained(stage)
    local = set(_state(stage, ""))
    for name in [n for u in stage.units for n in meta.spec.unit(u).modules] + list(meta.spec.shared):
        _fill_module(meta, stage, name, seed, loaded, local)
    return stage


def materialize(meta: MetaModel, units: Sequence[str], *, seed: int, device: torch.device,
                seq_shards: int = 1) -> StageModule:
    """A stage module holding ``units`` of the meta model, whole (no tp or dp), with the unsplit
    model's values on ``device``: ``stage_skeleton`` then ``fill``. A rank's stages are laid out
    on the meta device before ``fill`` instead (``runner.pipeline.step``), so that it allocates
    only its shards; the unsplit references (``verify``, the planner's probes) take this."""
    return fill(meta, stage_skeleton(meta, units, seq_shards=seq_shards), seed=seed, device=device)


def _tie(stage: StageModule, tied: list[list[str]]) -> None:
    """The stage's names of each tied weight made one parameter, its first local name's."""
    local = {name for name, _ in stage.named_parameters(remove_duplicate=False)}
    for names in tied:
        here = [n for n in names if n in local]
        for other in here[1:]:
            _set_param(stage, other, stage.get_parameter(here[0]))


def _state(module: nn.Module, prefix: str) -> dict[str, torch.Tensor]:
    """``module``'s parameters and buffers by full name (``prefix``: the module's), every name of a tied one."""
    out: dict[str, torch.Tensor] = dict(module.named_parameters(prefix=prefix, remove_duplicate=False))
    out.update(module.named_buffers(prefix=prefix, remove_duplicate=False))
    return out


@torch.no_grad()
def _copy_part(target: torch.Tensor, whole: torch.Tensor) -> None:
    """This rank's part of ``whole`` into ``target`` (its local shard where it is a DTensor)."""
    local = target.to_local() if hasattr(target, "to_local") else target
    local.copy_(whole[local_region(target)])


def _fill_module(meta: MetaModel, stage: StageModule, name: str, seed: int, loaded: set[str] | None,
                 local: set[str]) -> None:
    """Initialise the top-level module ``name`` of ``stage`` (what pretrained weights left out of
    it) whole on CPU, alone, and copy this rank's part of each tensor into the stage. A weight tied
    to an earlier module of the stage was filled with it; one whose first owner is elsewhere takes
    that owner's initialisation, built alone once this module's whole is freed. ``local``: the
    stage's tensor names."""
    spec = meta.spec
    targets = _state(stage.get_submodule(name), name)
    owner_of = {n: names[0] for names in meta.tied for n in names}
    todo = {n for n in targets if loaded is None or n not in loaded}
    todo -= {n for n in todo if n in owner_of and owner_of[n] != n and owner_of[n] in local}
    if not todo:
        return
    elsewhere = {n for n in todo if n in owner_of and owner_of[n] != n}
    whole = StageModule(spec, (), {name: copy.deepcopy(meta.module.get_submodule(name))})
    whole.to_empty(device="cpu")
    _tie(whole, meta.tied)
    modules = [n for n, m in whole.named_modules() if (n == name or n.startswith(f"{name}."))
               and not _fully_loaded(m, n, loaded)]
    _init(spec, whole, modules, seed)
    firsts = {owner_of[n].rpartition(".")[0] for n in todo if owner_of.get(n) == n}
    _init(spec, whole, sorted(firsts), seed)  # a tied weight: its first owner initialises it last
    values = _state(whole, "")
    for n in sorted(todo - elsewhere):
        _copy_part(targets[n], values[n])
    del whole, values
    for n in sorted(elsewhere):  # the first owner lives in another stage: build just that module
        owner, _, leaf = owner_of[n].rpartition(".")
        first = copy.deepcopy(meta.module.get_submodule(owner)).to_empty(device="cpu")
        with torch.no_grad(), _seeded(seed, owner):
            spec.init_module(owner, first)
        _copy_part(targets[n], getattr(first, leaf))


def _fully_loaded(module: nn.Module, name: str, loaded: set[str] | None) -> bool:
    if loaded is None:
        return False
    own = [f"{name}.{t}" for t, _ in module.named_parameters(recurse=False)]
    own += [f"{name}.{t}" for t, _ in module.named_buffers(recurse=False)]
    return all(n in loaded for n in own)
