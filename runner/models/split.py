"""Model → stages: build the model without memory, choose which pipeline units each stage holds,
and materialise only the stage modules a rank owns, initialised exactly as the unsplit model is.

A stage module holds its units under their full names (a skeleton of the model with only those
modules), so every parameter keeps its full name (``model.layers.3.self_attn.q_proj.weight``) in
every stage: checkpoints, ``verify`` and reports line up with the unsplit model. The units and how
a stage runs them come from the model's ``ModelSpec`` (``runner.models.units``).
"""

from __future__ import annotations

import copy
import hashlib
import logging
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig
from torch import nn

from runner.errors import ConfigError
from runner.models.shards import place_shards
from runner.models.units import ModelSpec, describe_names, spec_for, tied_groups

__all__ = ["StageModule", "MetaModel", "build_meta_model", "split_by_cost", "plan_split", "check_shapes", "stage_io",
           "check_init", "check_keyword_inputs", "materialize", "tied_groups"]

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
        with cast:
            return self.spec.run(self, self.units, x, kwargs, seq_shards=self.seq_shards)


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


def _seed_for(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


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
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(_seed_for(seed, name))
                spec.init_module(name, module)


def materialize(meta: MetaModel, units: Sequence[str], *, seed: int, device: torch.device,
                tp_mesh: Any = None, tp_plan: Mapping[str, str] | None = None, seq_shards: int = 1) -> StageModule:
    """A stage module holding ``units`` of the meta model, allocated and initialised on CPU (so
    every device gets the same numbers) or read from the model's pretrained weights, then moved
    to ``device``. With a ``tp_mesh`` (a DeviceMesh) and pretrained weights, the planned
    parameters are DTensors holding this rank's shard, read alone (``runner.parallel.tp.place_shards``);
    random initialisation stays whole (``parallelize`` distributes it). ``seq_shards``: the
    ``StageModule``'s (sequence parallelism).

    A parameter tied to one outside the stage (a head tied to the embedding of the first stage)
    gets the value the unsplit model gives it: that of its first owner in model order."""
    spec = meta.spec
    modules = {n: meta.module.get_submodule(n) for u in units for n in spec.unit(u).modules}
    modules.update({n: copy.deepcopy(meta.module.get_submodule(n)) for n in spec.shared})
    stage = StageModule(spec, units, modules, seq_shards=seq_shards)
    local = {name for name, _ in stage.named_parameters(remove_duplicate=False)}
    local_groups = [[n for n in names if n in local] for names in meta.tied]
    stage.to_empty(device="cpu")
    # Allocation gives each name its own tensor: tie them again.
    for first, *others in (g for g in local_groups if len(g) > 1):
        for other in others:
            _set_param(stage, other, stage.get_parameter(first))
    if tp_mesh is not None and tp_plan and spec.pretrained:
        place_shards(stage, tp_mesh, tp_plan)
    loaded = spec.load_pretrained(stage)
    _init(spec, stage, [n for n, m in stage.named_modules() if not _fully_loaded(m, n, loaded)], seed)
    if loaded is None:
        _init_tied(meta, stage, seed)
    return stage.to(device)


def _fully_loaded(module: nn.Module, name: str, loaded: set[str] | None) -> bool:
    if loaded is None:
        return False
    own = [f"{name}.{t}" for t, _ in module.named_parameters(recurse=False)]
    own += [f"{name}.{t}" for t, _ in module.named_buffers(recurse=False)]
    return all(n in loaded for n in own)


def _init_tied(meta: MetaModel, stage: StageModule, seed: int) -> None:
    """Tied parameters take the value their first owner's initialisation gives, wherever the
    owners are (in the unsplit model each owner initialises the one tensor in turn)."""
    local = {name for name, _ in stage.named_parameters(remove_duplicate=False)}
    for names in meta.tied:
        here = [n for n in names if n in local]
        if not here:
            continue
        first, _, leaf = names[0].rpartition(".")
        if names[0] in local:  # the stage's copies are one tensor: its first owner initialises it last
            _init(meta.spec, stage, [first], seed)
            continue
        # The first owner lives in another stage: build just that module, as that stage does.
        owner = copy.deepcopy(meta.module.get_submodule(first)).to_empty(device="cpu")
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            torch.manual_seed(_seed_for(seed, first))
            meta.spec.init_module(first, owner)
            for n in here:
                stage.get_parameter(n).copy_(getattr(owner, leaf))
