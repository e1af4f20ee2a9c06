"""Model → stages: build the model without memory, choose where stages start, and materialise
only the stage modules a rank owns, initialised exactly as the unsplit model would be.

Stage modules are ``StageModule``s (an ``nn.Sequential``) built from an ordered dict of the full
model's own children, so every parameter keeps its full name (``block3.attn.qkv.weight``) in every
stage: checkpoints, ``verify`` and reports line up with the unsplit model.
"""

from __future__ import annotations

import hashlib
import inspect
import logging
from collections import OrderedDict, defaultdict
from contextlib import nullcontext
from typing import Any, Sequence

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig
from torch import nn

from runner.errors import ConfigError

__all__ = ["StageModule", "build_meta_model", "split_by_cost", "plan_split", "check_tied_weights", "check_shapes",
           "materialize"]

log = logging.getLogger(__name__)


def _keyword_filter(module: nn.Module):
    """Which keyword inputs ``module``'s forward takes: all (it has ``**kwargs``) or those it names."""
    params = inspect.signature(module.forward).parameters.values()
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return lambda kwargs: kwargs
    names = {p.name for p in params if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)}
    return lambda kwargs: {k: v for k, v in kwargs.items() if k in names}


class StageModule(nn.Sequential):
    """Some of a model's top-level children, run in order, as ``nn.Sequential`` does, and also:

    * keyword inputs (e.g. ``attention_mask``) go to every child whose forward takes them: torch's
      schedules hand each stage the step's keyword inputs, so every stage sees them;
    * ``autocast_dtype`` (set for ``train.precision=bf16``) autocasts the forward only: backward
      runs in the dtypes the forward chose, and recomputation under activation checkpointing
      restores the same autocast state.
    """

    autocast_dtype: torch.dtype | None = None

    def forward(self, x: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        if kwargs and not hasattr(self, "_filters"):
            self._filters = {name: _keyword_filter(child) for name, child in self.named_children()}
        cast = (torch.autocast(x.device.type, dtype=self.autocast_dtype) if self.autocast_dtype
                else nullcontext())
        with cast:
            for name, child in self.named_children():
                x = child(x, **self._filters[name](kwargs)) if kwargs else child(x)
        return x


def build_meta_model(model_cfg: DictConfig) -> nn.Sequential:
    """Instantiate the model factory on the meta device: shapes only, no memory, no init."""
    try:
        with torch.device("meta"):
            model = instantiate(model_cfg)
    except Exception as e:  # the user's factory can fail in any way
        raise ConfigError(
            f"model._target_={model_cfg.get('_target_')!r} could not be built: {e}\n"
            "Fix: check the model keys; a model factory must accept the keys of its model group."
        ) from e
    if not isinstance(model, nn.Sequential):
        raise ConfigError(
            f"model._target_={model_cfg.get('_target_')!r} returned {type(model).__name__}, "
            "not an nn.Sequential. Fix: return an nn.Sequential whose top-level children run in "
            "order (see README, 'Bring your own model')."
        )
    return model


def _unit_costs(model: nn.Sequential) -> list[int]:
    # Parameter count as the cost proxy; +1 so parameter-free children still count.
    return [1 + sum(p.numel() for p in child.parameters()) for child in model.children()]


def _balanced_bounds(costs: Sequence[float], num_stages: int) -> list[int]:
    """Start index of each stage for contiguous groups that minimise the costliest group."""
    n = len(costs)
    prefix = [0]
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
    """``parallel.split_points`` (the children that start stages 1..) of the contiguous split
    of ``names`` whose costliest stage costs least."""
    return [names[i] for i in _balanced_bounds(costs, num_stages)[1:]]


def plan_split(
    model: nn.Sequential, num_stages: int, split_points: Sequence[str] | None
) -> tuple[tuple[str, ...], ...]:
    """The names of the model's top-level children in each stage, in stage order."""
    names = list(model._modules)
    if len(names) < num_stages:
        raise ConfigError(
            f"The model has {len(names)} top-level children ({', '.join(names)}) but the layout "
            f"needs {num_stages} stages. Fix: raise model.n_layers, or lower parallel.pp or "
            "parallel.stages_per_rank."
        )
    if split_points is None:
        starts = _balanced_bounds(_unit_costs(model), num_stages)
    else:
        points = list(split_points)
        unknown = [p for p in points if p not in names]
        if unknown:
            raise ConfigError(
                f"parallel.split_points={points} names no module: {unknown}. "
                f"Fix: use top-level children of the model: {names}."
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
                f"Fix: list names in model order after '{names[0]}': {names[1:]}."
            )
    bounds = starts + [len(names)]
    stages = tuple(tuple(names[a:b]) for a, b in zip(bounds, bounds[1:]))
    assert sum(len(s) for s in stages) == len(names), "split must cover every child once"
    return stages


def check_tied_weights(model: nn.Sequential, stages: Sequence[Sequence[str]]) -> None:
    """Parameters shared between children (tied embedding/head) cannot span two stages: each
    stage would train its own copy. Reject that before launching."""
    stage_of = {name: i for i, names in enumerate(stages) for name in names}
    for names in _tied_groups(model):
        owners = {stage_of[n.split(".", 1)[0]] for n in names}
        if len(owners) > 1:
            raise ConfigError(
                f"Tied parameters {names} fall in different stages {sorted(owners)}; pipelined "
                "stages cannot share a weight. Fix: model.tie_embeddings=false, or split so "
                "both owners share a stage (parallel.split_points)."
            )


def check_shapes(
    model: nn.Sequential, stages: Sequence[Sequence[str]], *, microbatch: int, seq_len: int, vocab_size: int,
    kwargs: dict[str, torch.Tensor] | None = None,
) -> None:
    """Run one microbatch through the meta model, child by child: a child that cannot take its
    predecessor's output (so one stage cannot take the previous stage's) fails here, named, in
    milliseconds and without memory, instead of inside a rank. ``kwargs`` are one microbatch's
    keyword inputs, given to the children that take them."""
    stage_of = {name: i for i, names in enumerate(stages) for name in names}
    x = torch.zeros(microbatch, seq_len, dtype=torch.long, device="meta")
    kwargs = {k: v.to("meta") for k, v in (kwargs or {}).items()}
    for name, child in model.named_children():
        try:
            x = child(x, **_keyword_filter(child)(kwargs))
        except Exception as e:
            raise ConfigError(
                f"Model child '{name}' (stage {stage_of[name]}) cannot take the output of the child "
                f"before it (shape {tuple(x.shape)}): {e}\nFix: make consecutive children's shapes agree "
                "(see README, 'Bring your own model')."
            ) from e
        if not isinstance(x, torch.Tensor):
            raise ConfigError(f"Model child '{name}' (stage {stage_of[name]}) returned {type(x).__name__}; "
                              "stages pass one tensor. Fix: return a single tensor.")
    if tuple(x.shape) != (microbatch, seq_len, vocab_size):
        raise ConfigError(f"The model returns shape {tuple(x.shape)}, not logits (batch, seq, vocab_size) = "
                          f"{(microbatch, seq_len, vocab_size)}. Fix: end the model with a head to vocab_size.")


def _tied_groups(module: nn.Module) -> list[list[str]]:
    by_id = defaultdict(list)
    for name, p in module.named_parameters(remove_duplicate=False):
        by_id[id(p)].append(name)
    return [names for names in by_id.values() if len(names) > 1]


def _seed_for(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _set_param(root: nn.Module, name: str, param: nn.Parameter) -> None:
    owner, _, leaf = name.rpartition(".")
    setattr(root.get_submodule(owner), leaf, param)


def materialize(
    model: nn.Sequential, names: Sequence[str], *, seed: int, device: torch.device
) -> StageModule:
    """A stage module holding the given children of a meta-device ``model``, allocated and
    initialised on CPU (so every device gets the same numbers), then moved to ``device``.

    Each module's ``reset_parameters()`` runs under a generator seeded from the run seed and the
    module's full name, so a child initialises identically whichever stage or process builds it.
    """
    stage = StageModule(OrderedDict((n, model._modules[n]) for n in names))
    tied = _tied_groups(stage)
    stage.to_empty(device="cpu")
    for first, *others in tied:  # allocation gives each name its own tensor: tie them again
        for other in others:
            _set_param(stage, other, stage.get_parameter(first))
    with torch.no_grad():
        for name, module in stage.named_modules():
            owns_state = any(True for _ in module.parameters(recurse=False)) or any(
                True for _ in module.buffers(recurse=False)
            )
            reset = getattr(module, "reset_parameters", None)
            if reset is None:
                if owns_state:
                    raise ConfigError(
                        f"Module '{name}' ({type(module).__name__}) owns parameters or buffers "
                        "but has no reset_parameters(), so the runner cannot initialise it "
                        "from the meta device. Fix: give it a reset_parameters() method."
                    )
                continue
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(_seed_for(seed, name))
                reset()
    return stage.to(device)
