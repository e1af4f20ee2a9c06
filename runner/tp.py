"""Tensor parallelism inside each stage (``parallel.tp``): the model's own plan, applied to the
modules a stage holds, with torch's parallel styles over the stage's tp group.

A plan is the model's ``tp_plan`` attribute: module name patterns (``*`` for a layer's number) to
style names, in transformers' vocabulary, so a Hugging Face family brings its own (its merged
``model.tp_plan``) and the built-in transformer declares one (``runner.models``); any other model
may set one. Each style maps to a torch ``ParallelStyle`` (``STYLES``); one torch has no style for,
``replicated_with_grad_allreduce`` (Qwen3's ``q_norm``/``k_norm``: a weight every shard holds whole
but applies to its own heads), leaves the weight replicated and sums its gradient over the tp
group after every backward, or each shard would step with its own heads' part of it.

Messages between stages stay plain tensors: every plan ends its layers replicated (rowwise outputs
are all-reduced, the head's logits gathered), so every schedule sends what it sends without tp.

Randomly initialised stage modules are built whole and then distributed (``distribute_tensor``
keeps each rank's slice of the whole tensor): every tp gives the unsplit model's initial values,
which a seeded ``normal_`` on a sharded tensor would not. Pretrained ones never hold a sharded
weight whole: ``place_shards`` makes each planned parameter a DTensor laid out as ``apply_tp``
lays it out, with an empty local shard, loading reads that shard alone from the safetensors file
(``local_part``: torch.chunk's rows or columns), and ``parallelize_module`` keeps the DTensors as
they are (torch refuses one whose layout differs from its style's: the table is checked by torch)."""

from __future__ import annotations

import fnmatch
from typing import TYPE_CHECKING, Any, Mapping

from runner.errors import ConfigError

if TYPE_CHECKING:
    from torch import nn

    from runner.mesh import Mesh
    from runner.split import MetaModel, StageModule

__all__ = ["STYLE_NAMES", "REPLICATED_WITH_GRAD_SUM", "model_plan", "stage_plan", "check_tp", "apply_tp",
           "sum_partial_grads", "param_layouts", "shard_range", "place_shards", "local_part"]

REPLICATED_WITH_GRAD_SUM = "replicated_with_grad_allreduce"
# transformers' style names the runner translates (torch's class, and its layouts).
STYLE_NAMES = ("colwise", "rowwise", "colwise_gather_output", "embedding_rowwise", REPLICATED_WITH_GRAD_SUM)


def _style(name: str) -> Any:
    """The torch ``ParallelStyle`` of a transformers style name (None: no torch style)."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {
        "colwise": ColwiseParallel(),  # output dim sharded: each rank its heads, its MLP columns
        "rowwise": RowwiseParallel(),  # input dim sharded, outputs summed: replicated again
        "colwise_gather_output": ColwiseParallel(output_layouts=Replicate()),  # the head: whole logits
        "embedding_rowwise": RowwiseParallel(input_layouts=Replicate()),  # vocabulary rows sharded
        REPLICATED_WITH_GRAD_SUM: None,
    }[name]


def model_plan(model: nn.Module) -> dict[str, str]:
    """The model's declared plan (``tp_plan``: transformers' merged plan, or ours), {} if none."""
    plan = getattr(model, "tp_plan", None)
    return dict(plan) if isinstance(plan, Mapping) else {}


def _style_of(name: str, plan: Mapping[str, str]) -> str | None:
    """The style of module ``name``: its plan entry's (the first pattern that matches it)."""
    return next((style for pattern, style in plan.items() if fnmatch.fnmatchcase(name, pattern)), None)


def stage_plan(module: nn.Module, plan: Mapping[str, str]) -> dict[str, str]:
    """The plan's entries for the modules ``module`` holds, by their full names."""
    return {name: style for name, _ in module.named_modules() if name and (style := _style_of(name, plan))}


def _heads(meta: MetaModel) -> list[tuple[str, int]]:
    """What each shard must hold whole numbers of: attention heads and key/value heads, by key."""
    config = getattr(meta.module, "config", None)
    if config is not None and hasattr(config, "num_attention_heads"):  # Hugging Face
        where = "model.path's config.json"
        heads = [(f"{where} num_attention_heads", int(config.num_attention_heads))]
        kv = getattr(config, "num_key_value_heads", None)
        return heads + ([(f"{where} num_key_value_heads", int(kv))] if kv else [])
    counts = {n for m in meta.module.modules() if isinstance(n := getattr(m, "n_heads", None), int)}
    return [("model.n_heads", n) for n in sorted(counts)]


def check_tp(meta: MetaModel, parallel: Any, seq_len: int, loss: Any) -> None:
    """The checks of ``parallel.tp`` and its options that need the model, before launch."""
    tp = int(parallel.get("tp", 1))
    if tp == 1:
        for key in ("sequence_parallel", "loss_parallel"):
            if parallel.get(key):
                raise ConfigError(f"parallel.{key}=true shards over the tensor-parallel group, but parallel.tp=1. "
                                  f"Fix: parallel.tp=2 or more, or parallel.{key}=false.")
        return
    plan = model_plan(meta.module)
    if not plan:
        family = getattr(getattr(meta.module, "config", None), "model_type", None)
        what = f"a {family!r} model" if family else f"the model ({type(meta.module).__name__})"
        raise ConfigError(f"parallel.tp={tp}: {what} declares no tensor-parallel plan (tp_plan), so the runner "
                          "cannot know which layers to shard. Fix: parallel.tp=1 (pipeline and data parallelism "
                          "only), a Hugging Face family with a tp_plan (Llama, Mistral, Qwen2, Qwen3), the built-in "
                          "model=transformer, or give the model a tp_plan attribute (docs/parallelism.md).")
    unknown = sorted({s for s in plan.values() if s not in STYLE_NAMES})
    if unknown:
        raise ConfigError(f"parallel.tp={tp}: the model's tp_plan uses style(s) {unknown} the runner does not "
                          f"translate to torch's (it knows {', '.join(STYLE_NAMES)}). Fix: parallel.tp=1.")
    if not stage_plan(meta.module, plan):
        raise ConfigError(f"parallel.tp={tp}: the model's tp_plan {sorted(plan)} names none of its modules. "
                          "Fix: patterns of module names (model.layers.*.mlp.up_proj), or parallel.tp=1.")
    for key, n in _heads(meta):
        if n % tp:
            fits = [d for d in range(2, n + 1) if n % d == 0 and all(m % d == 0 for _, m in _heads(meta))]
            raise ConfigError(f"parallel.tp={tp} does not divide {key}={n}: each shard holds whole heads. "
                              f"Fix: parallel.tp={' or '.join(map(str, fits[:4])) or 1}.")
    if parallel.get("sequence_parallel") and seq_len % tp:
        raise ConfigError(f"parallel.sequence_parallel=true shards the sequence over parallel.tp={tp}, but "
                          f"train.seq_len={seq_len} does not divide. Fix: train.seq_len a multiple of {tp}.")
    if parallel.get("loss_parallel"):
        target, smoothing = loss.get("_target_"), loss.get("label_smoothing", 0.0)
        if target != "runner.losses.cross_entropy" or smoothing:
            raise ConfigError(f"parallel.loss_parallel=true computes torch's vocabulary-parallel cross-entropy, not "
                              f"loss._target_={target} with label_smoothing={smoothing}. Fix: "
                              "parallel.loss_parallel=false, or the built-in cross-entropy without label smoothing.")


def apply_tp(module: StageModule, mesh: Mesh, plan: Mapping[str, str]) -> None:
    """Shard ``module``'s planned layers over this rank's tp group, in place. Weights tied within
    the module (embedding and head of one stage) are tied again after distribution; the names
    of weights whose gradients are summed over the group are kept on the module."""
    from torch.distributed.tensor.parallel import parallelize_module

    assert mesh.tp_mesh is not None
    before = dict(module.named_parameters(remove_duplicate=False))
    planned = stage_plan(module, plan)
    styles = {name: _style(style) for name, style in planned.items() if style != REPLICATED_WITH_GRAD_SUM}
    parallelize_module(module, mesh.tp_mesh, styles)
    first_name: dict[int, str] = {}
    for name, p in before.items():  # a weight two modules shared was distributed once per module: share again
        first = first_name.setdefault(id(p), name)
        if first != name:
            owner, _, leaf = name.rpartition(".")
            setattr(module.get_submodule(owner), leaf, module.get_parameter(first))
    summed = tuple(f"{name}.{p}" for name, style in planned.items() if style == REPLICATED_WITH_GRAD_SUM
                   for p, _ in module.get_submodule(name).named_parameters())
    module.tp_grad_sum = summed


def sum_partial_grads(modules: list[nn.Module], mesh: Mesh) -> None:
    """Sum over the tp group the gradients each shard holds only its part of (``apply_tp``)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    group = mesh.group("tp") if mesh.tp_mesh is not None else None
    if group is None:
        return
    for module in modules:
        for name in getattr(module, "tp_grad_sum", ()):  # StageModule's
            grad = module.get_parameter(name).grad
            if grad is not None:
                dist.all_reduce(grad.to_local() if isinstance(grad, DTensor) else grad, group=group)


# Where torch's styles put the parameters of the modules they partition (ColwiseParallel and
# RowwiseParallel's partition functions for nn.Linear and nn.Embedding): the dimension each
# parameter is sharded on, None where every shard holds it whole.
_LAYOUTS: dict[tuple[str, str], dict[str, int | None]] = {
    ("colwise", "Linear"): {"weight": 0, "bias": 0},  # output features: the weight's rows
    ("colwise", "Embedding"): {"weight": 1},  # the embedding's columns
    ("rowwise", "Linear"): {"weight": 1, "bias": None},  # input features; the bias added once, whole
    ("rowwise", "Embedding"): {"weight": 0},  # vocabulary rows
}
_TORCH_STYLE = {"colwise": "colwise", "colwise_gather_output": "colwise", "rowwise": "rowwise",
                "embedding_rowwise": "rowwise"}


def param_layouts(module: nn.Module, plan: Mapping[str, str]) -> dict[str, int | None]:
    """The parameters ``apply_tp`` distributes, by full name: the dimension sharded, or None
    (replicated). Modules no torch style partitions (not Linear or Embedding) are left out: they
    are read whole and distributed by ``parallelize_module`` as before."""
    from torch import nn

    out: dict[str, int | None] = {}
    for name, style in stage_plan(module, plan).items():
        sub = module.get_submodule(name)
        kind = "Linear" if isinstance(sub, nn.Linear) else "Embedding" if isinstance(sub, nn.Embedding) else ""
        layout = _LAYOUTS.get((_TORCH_STYLE.get(style, ""), kind))
        if layout is not None:
            out.update({f"{name}.{p}": layout[p] for p, _ in sub.named_parameters(recurse=False) if p in layout})
    return out


def shard_range(size: int, count: int, index: int) -> tuple[int, int]:
    """Shard ``index`` of ``count`` of a dimension of ``size``, as DTensor's ``Shard`` cuts it
    (``torch.chunk``: ceil(size / count) each, the last ones shorter or empty): [start, stop)."""
    step = -(-size // count)
    start = min(index * step, size)
    return start, min(start + step, size)


def place_shards(module: nn.Module, tp_mesh: Any, plan: Mapping[str, str]) -> None:
    """Replace ``module``'s planned parameters (``param_layouts``) by DTensors over ``tp_mesh``
    with uninitialised local shards, in place; a parameter tied under several names stays one."""
    import torch
    from torch import nn
    from torch.distributed.tensor import DTensor, Replicate, Shard

    count, index = tp_mesh.size(), tp_mesh.get_local_rank()
    placed: dict[int, nn.Parameter] = {}
    for name, dim in param_layouts(module, plan).items():
        whole = module.get_parameter(name)
        if id(whole) in placed:
            continue
        shape = list(whole.shape)
        if dim is not None:
            start, stop = shard_range(shape[dim], count, index)
            shape[dim] = stop - start
        local = torch.empty(shape, dtype=whole.dtype, device=whole.device)
        dtensor = DTensor.from_local(local, tp_mesh, [Shard(dim) if dim is not None else Replicate()],
                                     run_check=False, shape=whole.shape, stride=whole.stride())
        placed[id(whole)] = nn.Parameter(dtensor, requires_grad=whole.requires_grad)
    for name, p in list(module.named_parameters(remove_duplicate=False)):
        if id(p) in placed:
            owner, _, leaf = name.rpartition(".")
            setattr(module.get_submodule(owner), leaf, placed[id(p)])


def local_part(tensor: Any) -> tuple[int, int, int] | None:
    """The part of the whole tensor a DTensor's local shard holds, as (dim, start, stop); None
    for a plain tensor or a replicated DTensor (the whole)."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(tensor, DTensor):
        return None
    assert tensor.device_mesh.ndim == 1, "tp shards over one mesh dimension"
    placement = tensor.placements[0]
    if not isinstance(placement, Shard):
        return None
    start, stop = shard_range(tensor.shape[placement.dim], tensor.device_mesh.size(),
                              tensor.device_mesh.get_local_rank())
    return placement.dim, start, stop
