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

Stage modules are built whole and then distributed (``distribute_tensor`` keeps each rank's
slice of the whole tensor): every tp gives the unsplit model's initial values, which a seeded
``normal_`` on a sharded tensor would not."""

from __future__ import annotations

import fnmatch
from typing import TYPE_CHECKING, Any, Mapping

from runner.errors import ConfigError

if TYPE_CHECKING:
    from torch import nn

    from runner.mesh import Mesh
    from runner.split import MetaModel, StageModule

__all__ = ["STYLE_NAMES", "REPLICATED_WITH_GRAD_SUM", "model_plan", "stage_plan", "check_tp", "apply_tp",
           "sum_partial_grads"]

REPLICATED_WITH_GRAD_SUM = "replicated_with_grad_allreduce"
# transformers' style names the runner translates (torch's class, and its layouts).
STYLE_NAMES = ("colwise", "rowwise", "colwise_gather_output", "embedding_rowwise", REPLICATED_WITH_GRAD_SUM)
# The dimension of a module's weight each style shards (a Linear's [out, in], an Embedding's [vocab,
# dim]): one weight tied between two modules must be sharded alike in both.
WEIGHT_SHARD_DIM = {"colwise": 0, "colwise_gather_output": 0, "embedding_rowwise": 0, "rowwise": 1}


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
    for names in meta.tied:
        owners = {name.rpartition(".")[0] for name in names}
        dims = {o: WEIGHT_SHARD_DIM.get(_style_of(o, plan) or "") for o in owners}
        if len(set(dims.values())) > 1:
            raise ConfigError(f"parallel.tp={tp}: the tied weight {names} would be sharded differently in "
                              f"{', '.join(f'{o} ({_style_of(o, plan)})' for o in sorted(owners))}. Fix: a tp_plan "
                              "that shards both alike (embedding_rowwise with colwise_gather_output), or untie them.")
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
