"""Pipeline units: the pieces a model is cut into, in the order they run, with their full names.

A stage is a contiguous run of units. Where the units come from depends on the model:

* an ``nn.Sequential``: its children, with a child that is itself an ``nn.Sequential`` taken entry
  by entry (``layers.0`` ... ``layers.N-1`` between what comes before and after it);
* a model that declares them: a ``pipeline_units`` attribute listing module names in the order
  they run (containers stand for their entries); Hugging Face models through ``runner.models.hf``;
* any other ``nn.Module``: the modules ``parallel.stage_modules`` lists, stage by stage.

Every unit except those of a Hugging Face family takes one tensor (and the batch's keyword inputs
its forward names) and returns one tensor. A ``ModelSpec`` says how a stage runs its units, how a
module is initialised on its own, and what the unsplit model's own forward is (``verify``'s
reference).
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import torch
from torch import nn

from runner.errors import ConfigError

__all__ = ["Unit", "ModelSpec", "SequentialSpec", "ListedSpec", "spec_for", "keyword_filter", "describe_names",
           "owns_state", "tied_groups"]

# Containers without a forward of their own: a listed one stands for its entries.
CONTAINERS = (nn.ModuleList, nn.ModuleDict)


@dataclass(frozen=True)
class Unit:
    name: str  # what split points and stage_modules name: "model.layers.3"
    modules: tuple[str, ...]  # full names of the modules it holds (GPT-2's first unit: wte, wpe, drop)


def keyword_filter(module: nn.Module) -> Callable[[dict], dict]:
    """Which keyword inputs ``module``'s forward takes: all (it has ``**kwargs``) or those it names."""
    params = inspect.signature(module.forward).parameters.values()
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return lambda kwargs: kwargs
    names = {p.name for p in params if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)}
    return lambda kwargs: {k: v for k, v in kwargs.items() if k in names}


def owns_state(module: nn.Module) -> bool:
    return any(True for _ in module.parameters(recurse=False)) or any(True for _ in module.buffers(recurse=False))


def tied_groups(module: nn.Module) -> list[list[str]]:
    """Parameter names sharing one tensor (a tied embedding and head), in model order."""
    by_id: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    return [names for names in by_id.values() if len(names) > 1]


def describe_names(names: Sequence[str], limit: int = 12) -> str:
    """``embed, layers.0 … layers.31, norm, head``: numbered runs folded, for error messages."""
    out: list[str] = []
    i = 0
    while i < len(names):
        match = re.fullmatch(r"(.*\D)(\d+)", names[i])
        j = i
        if match:
            prefix, start = match.group(1), int(match.group(2))
            while j + 1 < len(names) and names[j + 1] == f"{prefix}{start + j + 1 - i}":
                j += 1
        out += names[i:j + 1] if j - i < 2 else [f"{names[i]} … {names[j]}"]
        i = j + 1
    text = ", ".join(out[:limit])
    return text + (f", … ({len(names)} in all)" if len(out) > limit else "")


class ModelSpec:
    """A model family's contract with the runner. Subclasses set ``units`` and may override the
    rest:

    * ``units``: the pipeline units in the order they run (what stages are cut from), and
      ``shared``: parameter-free modules every stage holds;
    * ``blocks()``: the units activation checkpointing may recompute;
    * ``unit_costs(model)``: a relative cost per unit, which the default split balances;
    * ``run``: how a stage runs its units (told how many slices of the sequence it holds);
      ``reference_forward``: the unsplit model's own forward (``verify``'s reference);
      ``keyword_inputs``: what the model consumes besides the tokens;
    * ``init_module``, ``init_order``, ``needs_init``, ``cannot_init``, ``load_pretrained``: how
      each module is initialised on its own (or read from pretrained weights).
    """

    units: tuple[Unit, ...] = ()
    shared: tuple[str, ...] = ()  # parameter-free modules every stage holds (rotary embeddings)
    family: str = "sequential"

    @property
    def unit_names(self) -> list[str]:
        return [u.name for u in self.units]

    def unit(self, name: str) -> Unit:
        return self._by_name[name]

    @property
    def _by_name(self) -> dict[str, Unit]:
        if not hasattr(self, "_units_by_name"):
            self._units_by_name = {u.name: u for u in self.units}
        return self._units_by_name

    def blocks(self) -> list[str]:
        """Units activation checkpointing may recompute: those between the first and the last
        (the embedding and the head are never recomputed), the same whatever the split."""
        return self.unit_names[1:-1]

    def unit_costs(self, model: nn.Module) -> list[int]:
        """A relative cost per unit, in order, for the split the runner picks when none is given:
        its parameter count (+1, so that a parameter-free unit still counts). ``python -m
        runner.plan`` times the units instead."""
        return [1 + sum(p.numel() for n in u.modules for p in model.get_submodule(n).parameters())
                for u in self.units]

    def run(self, stage: nn.Module, units: Sequence[str], x: torch.Tensor, kwargs: dict[str, Any], *,
            seq_shards: int = 1) -> torch.Tensor:
        """Run ``units`` of ``stage`` (a module holding them under their full names) in order.
        ``x`` is one of ``seq_shards`` slices of the sequence (sequence parallelism): a spec that
        builds positions or masks builds them for the whole sequence; this one builds none."""
        for name in units:
            module = stage.get_submodule(name)
            x = module(x, **self._filter(name, module)(kwargs)) if kwargs else module(x)
        return x

    def _filter(self, name: str, module: nn.Module) -> Callable[[dict], dict]:
        filters = self.__dict__.setdefault("_filters", {})
        if name not in filters:
            filters[name] = keyword_filter(module)
        return filters[name]

    def init_module(self, name: str, module: nn.Module) -> None:
        """Initialise ``module``'s own parameters and buffers (not its children's)."""
        # torch types a module's attributes as Tensor | Module; this one is its class's method
        # (cannot_init listed the modules without one).
        module.reset_parameters()  # type: ignore[operator]

    @property
    def pretrained(self) -> bool:
        """Whether ``load_pretrained`` reads weights (tp shards are then placed before it reads)."""
        return False

    def load_pretrained(self, stage: nn.Module) -> set[str] | None:
        """Read the stage's tensors from the model's weights, if it has any: the names loaded."""
        return None

    def cannot_init(self, model: nn.Module) -> list[str]:
        """Modules owning parameters or buffers that ``init_module`` cannot initialise."""
        return [f"{name} ({type(m).__name__})" for name, m in model.named_modules()
                if owns_state(m) and not hasattr(m, "reset_parameters")]

    def init_order(self, names: Iterable[str]) -> list[str]:
        """The order modules are initialised in (by name): as listed (parents before children)."""
        return list(names)

    def needs_init(self, module: nn.Module) -> bool:
        return owns_state(module)

    def reference_forward(self, model: nn.Module) -> Callable[..., torch.Tensor]:
        """The unsplit model's own forward, returning logits: what ``verify`` compares with."""
        return lambda x, **kwargs: model(x, **kwargs)

    def keyword_inputs(self) -> set[str] | None:
        """The keyword inputs the model consumes (None: whatever its units' forwards name)."""
        return None


class SequentialSpec(ModelSpec):
    """An ``nn.Sequential``: its children in order; a child that is an ``nn.Sequential`` stands for
    its entries. Its own forward is this chain, with keyword inputs routed to the children that
    name them."""

    def __init__(self, model: nn.Sequential):
        self.units = tuple(Unit(name, (name,)) for name in _chain(model, ""))

    def reference_forward(self, model: nn.Module) -> Callable[..., torch.Tensor]:
        names = self.unit_names
        return lambda x, **kwargs: self.run(model, names, x, kwargs)


def _chain(module: nn.Sequential, prefix: str) -> list[str]:
    out = []
    for name, child in module.named_children():
        full = f"{prefix}{name}"
        out += _chain(child, f"{full}.") if isinstance(child, nn.Sequential) else [full]
    return out


class ListedSpec(ModelSpec):
    """Any ``nn.Module`` whose units are named: by its ``pipeline_units`` or by
    ``parallel.stage_modules``. Units run in the listed order, one tensor each; the reference is
    the model's own forward, so ``verify`` catches a listing that is not what the model computes."""

    def __init__(self, model: nn.Module, names: Sequence[str], *, key: str):
        expanded = []
        for name in names:
            module = _submodule(model, name, key)
            if isinstance(module, CONTAINERS):
                expanded += [f"{name}.{child}" for child, _ in module.named_children()]
            else:
                expanded.append(name)
        _check_listing(model, expanded, key)
        self.units = tuple(Unit(name, (name,)) for name in expanded)


def _submodule(model: nn.Module, name: str, key: str) -> nn.Module:
    try:
        return model.get_submodule(name)
    except AttributeError:
        valid = [n for n, _ in model.named_modules() if n and "." not in n]
        raise ConfigError(f"{key} names {name!r}, which is not a module of the model. "
                          f"Fix: use module names such as {describe_names(valid)}.") from None


def _check_listing(model: nn.Module, names: list[str], key: str) -> None:
    """Each module once, none inside another, in the model's order, and every parameter and
    buffer covered: a module left out would silently not train."""
    order = {name: i for i, (name, _) in enumerate(model.named_modules())}
    repeated = sorted({n for n in names if names.count(n) > 1})
    nested = [(a, b) for a in names for b in names if b.startswith(f"{a}.")]
    if repeated or nested:
        what = f"{repeated} more than once" if repeated else f"{nested[0][1]!r} inside {nested[0][0]!r}"
        raise ConfigError(f"{key} lists {what}. Fix: list each module exactly once.")
    positions = [order[n] for n in names]
    if positions != sorted(positions):
        expected = sorted(names, key=order.__getitem__)
        raise ConfigError(f"{key} lists modules out of model order. Fix: in the order the model defines them: "
                          f"{describe_names(expected)}.")
    covered = {f"{n}.{t}" for n in names for t, _ in _state(model.get_submodule(n))}
    left = [name for name, _ in _state(model) if name not in covered]
    if left:
        raise ConfigError(f"{key} leaves parameters or buffers of the model in no stage: {describe_names(left, 6)}. "
                          "Fix: list the modules that hold them.")


def _state(module: nn.Module):
    yield from module.named_parameters(remove_duplicate=False)
    yield from module.named_buffers(remove_duplicate=False)


def spec_for(model: nn.Module, stage_modules: Sequence[Sequence[str]] | None = None) -> ModelSpec:
    """The units of a model built on the meta device (see the module docstring)."""
    declared = getattr(model, "runner_spec", None)  # Hugging Face families (runner.models.hf)
    if isinstance(declared, ModelSpec):
        return declared
    if stage_modules is not None and not isinstance(model, nn.Sequential):
        return ListedSpec(model, [n for stage in stage_modules for n in stage], key="parallel.stage_modules")
    listed = getattr(model, "pipeline_units", None)
    if listed is not None:
        return ListedSpec(model, list(listed), key=f"{type(model).__name__}.pipeline_units")
    if isinstance(model, nn.Sequential):
        return SequentialSpec(model)
    raise ConfigError(
        f"The model is a {type(model).__name__}, not an nn.Sequential, and does not declare its pipeline units. "
        "Fix: name the modules of each stage, in the order they run, with parallel.stage_modules="
        "[[embed,layers.0],[layers.1,norm,head]] (each takes one tensor), give the model a pipeline_units "
        "list, or use model=hf for a Hugging Face causal LM (see docs/models.md, 'Bring your own model')."
    )
