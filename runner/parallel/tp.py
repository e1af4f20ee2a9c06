"""Tensor parallelism inside each stage (``parallel.tp``): the model's own plan, applied to the
modules a stage holds, with torch's parallel styles over the stage's tp group.

A plan is the model's ``tp_plan`` attribute: module name patterns (``*`` for a layer's number) to
style names, in transformers' vocabulary, so a Hugging Face family brings its own (its merged
``model.tp_plan``) and the built-in transformer declares one (``runner.models.builtin``); any other model
may set one. Each style maps to a torch ``ParallelStyle`` (``_style``); one torch has no style for,
``replicated_with_grad_allreduce`` (Qwen3's ``q_norm``/``k_norm``: a weight every shard holds whole
but applies to its own heads), leaves the weight replicated and sums its gradient over the tp
group after every backward, or each shard would step with its own heads' part of it.

Messages between stages stay plain tensors: every plan ends its layers replicated (rowwise outputs
are all-reduced, the head's logits gathered), so every schedule sends what it sends without tp
(under sequence parallelism, each rank's slice of it: below).

Sequence parallelism (``parallel.sequence_parallel``) is derived from the same plan, not declared
apart (``_sequence_layout``): the residual stream between the blocks is sharded on the sequence
(dim 1), so the norms on it run on each rank's slice of the tokens (torch's ``SequenceParallel``),
a rowwise layer reduce-scatters instead of all-reducing, the module holding a layer's colwise
projections (attention, MLP) gathers its input whole first (``_GatherSequence``), the embedding
unit's output is scattered and the head gathers its input. The messages between stages are then
each tp rank's slice of the sequence, a plain ``(batch, seq / tp, dim)`` tensor sent to the same
tp rank of the next stage; a stage's spec builds positions, rotary embeddings and masks for the
whole sequence: it is told how many slices the sequence is in (``TPPlan.seq_shards``, given to
``stage_skeleton`` and so to the spec's ``run``).

Loss parallelism (``parallel.loss_parallel``) leaves the head's logits sharded on the vocabulary
(a DTensor) into ``runner.losses.cross_entropy``, computed by torch's ``loss_parallel()``, which
the pipeline enters around the last stage's whole step (the backward runs inside it). Both
options' own checks (``_option_problem``) run before launch with the others (``check_tp``; those that need
only the config before torch is imported: ``runner.parallel.dims.check_tp_options``).

The plan is applied to a stage still on the meta device (``runner.pipeline.step``): no memory, no
message. ``runner.models.split.fill`` then allocates each rank's shards and fills them with its
part of each module built whole on CPU, one module at a time, or read by slice from pretrained
weights: every tp gives the unsplit model's initial values, which a seeded ``normal_`` on a
sharded tensor would not, and no rank holds a stage whole. Weights replicated
as DTensors (the norms under sequence parallelism) get partial gradients, summed over the group
after the backward (``sum_partial_grads``), with the weights ``apply_tp`` names: it returns them
to its caller, which hands them to the step (nothing is left on the module to be read back)."""

from __future__ import annotations

import inspect
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from runner.errors import ConfigError
from runner.models.shards import param_layouts, stage_plan, style_of
from runner.ranks.watchdog import waiting

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from runner.models.split import MetaModel, StageModule
    from runner.models.units import ModelSpec
    from runner.parallel.dims import ParallelDims
    from runner.parallel.mesh import Mesh

__all__ = ["STYLE_NAMES", "REPLICATED_WITH_GRAD_SUM", "TPPlan", "tp_plan", "model_plan", "stage_plan", "check_tp",
           "apply_tp", "loss_context", "sum_partial_grads"]

REPLICATED_WITH_GRAD_SUM = "replicated_with_grad_allreduce"
# transformers' style names the runner translates (torch's class, and its layouts).
STYLE_NAMES = ("colwise", "rowwise", "colwise_gather_output", "embedding_rowwise", REPLICATED_WITH_GRAD_SUM)


@dataclass(frozen=True)
class TPPlan:
    """What each stage applies over its tp group: the model's plan and the two options."""

    styles: Mapping[str, str]  # the model's tp_plan: module name pattern -> transformers' style name
    sequence_parallel: bool = False
    loss_parallel: bool = False
    seq_shards: int = 1  # the slices of the sequence between a stage's units: tp under sequence_parallel


def tp_plan(model: nn.Module, dims: ParallelDims) -> TPPlan | None:
    """The run's plan from the model and the run's degrees and options (None at tp=1)."""
    if dims.tp <= 1:
        return None
    return TPPlan(model_plan(model), dims.sequence_parallel, dims.loss_parallel,
                  seq_shards=dims.tp if dims.sequence_parallel else 1)


def _style(name: str, *, sequence: bool = False, head: bool = False, loss_parallel: bool = False) -> Any:
    """The torch ``ParallelStyle`` of a transformers style name (None: no torch style).
    ``sequence``: the residual stream is sharded on the sequence; ``head``: the module is the
    model's head, whose logits stay vocabulary-sharded under ``loss_parallel``."""
    stream = Shard(1) if sequence else Replicate()  # between the blocks
    if name == "colwise_gather_output" and head:  # the logits: whole, or sharded into the loss
        return ColwiseParallel(input_layouts=stream, output_layouts=Shard(-1) if loss_parallel else Replicate(),
                               use_local_output=not loss_parallel)
    return {
        "colwise": ColwiseParallel(),  # output dim sharded: each rank its heads, its MLP columns
        "rowwise": RowwiseParallel(output_layouts=stream),  # input dim sharded, outputs summed (or scattered)
        "colwise_gather_output": ColwiseParallel(output_layouts=Replicate()),  # whole outputs
        "embedding_rowwise": RowwiseParallel(input_layouts=Replicate()),  # vocabulary rows sharded
        REPLICATED_WITH_GRAD_SUM: None,
    }[name]


class _GatherSequence(ParallelStyle):
    """A module that mixes the whole sequence or holds colwise projections (attention, an MLP)
    takes its hidden states whole: its first input, given positionally or by the name of its
    forward's first parameter (transformers' decoder layers pass ``hidden_states`` to attention
    by keyword, the MLP positionally), is all-gathered from this rank's slice of the sequence. It
    stays a replicated DTensor, so the gradients of its users sum as one partial DTensor and
    the backward reduce-scatters them once."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        name = next(iter(inspect.signature(module.forward).parameters))

        def whole(x: Any) -> Any:
            sharded = x if isinstance(x, DTensor) else DTensor.from_local(x, device_mesh, (Shard(1),), run_check=False)
            return sharded.redistribute(device_mesh, (Replicate(),))

        def gather(_: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            if args:
                return (whole(args[0]), *args[1:]), kwargs
            return args, {**kwargs, name: whole(kwargs[name])}

        module.register_forward_pre_hook(gather, with_kwargs=True)
        return module


def _is_norm(module: nn.Module) -> bool:
    return isinstance(module, (nn.LayerNorm, nn.RMSNorm)) or type(module).__name__.endswith(("LayerNorm", "RMSNorm"))


@dataclass(frozen=True)
class _SequenceLayout:
    """Where a module's residual stream changes layout under sequence parallelism (full names)."""

    embed: str | None  # the embedding unit's module: its output is scattered on the sequence
    head: str | None  # the head (the last unit's module): its input is gathered
    gathered: frozenset[str]  # modules that take their hidden states whole
    norms: frozenset[str]  # norms on the sharded residual stream


def _sequence_layout(module: nn.Module, spec: ModelSpec, planned: Mapping[str, str]) -> _SequenceLayout:
    """Derived from the plan: the parents of colwise layers take whole inputs; norms outside them
    see the residual stream. ``planned``: ``stage_plan`` of ``module``."""
    names = {name for name, _ in module.named_modules()}
    first, last = spec.units[0].modules, spec.units[-1].modules
    embed = first[0] if len(first) == 1 and first[0] in names else None
    head = last[0] if len(last) == 1 and last[0] in names else None
    gathered = frozenset(name.rpartition(".")[0] for name, style in planned.items()
                         if style in ("colwise", "colwise_gather_output") and name != head and "." in name)
    norms = frozenset(name for name, m in module.named_modules() if _is_norm(m) and name not in planned
                      and not any(name.startswith(f"{g}.") for g in gathered))
    return _SequenceLayout(embed, head, gathered, norms)


def _torch_styles(module: nn.Module, spec: ModelSpec, plan: TPPlan) -> dict[str, Any]:
    """The torch style of each planned module of ``module`` (and, with sequence parallelism, of
    its norms, the modules that gather their inputs, and the embedding unit)."""
    planned = stage_plan(module, plan.styles)
    layout = _sequence_layout(module, spec, planned)
    sp = plan.sequence_parallel
    styles = {name: _style(style, sequence=sp, head=name == layout.head, loss_parallel=plan.loss_parallel)
              for name, style in planned.items() if style != REPLICATED_WITH_GRAD_SUM}
    if not sp:
        return styles
    styles.update({name: SequenceParallel(use_local_output=True) for name in layout.norms})
    styles.update({name: _GatherSequence() for name in layout.gathered})
    if layout.embed is not None:  # the vocabulary-parallel sum reduce-scattered, or the unit's output scattered
        styles[layout.embed] = (RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
                                if planned.get(layout.embed) == "embedding_rowwise" else
                                PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(1)))
    return styles


def model_plan(model: nn.Module) -> dict[str, str]:
    """The model's declared plan (``tp_plan``: transformers' merged plan, or ours), {} if none."""
    plan = getattr(model, "tp_plan", None)
    return dict(plan) if isinstance(plan, Mapping) else {}


def _heads(meta: MetaModel) -> list[tuple[str, int]]:
    """What each shard must hold whole numbers of: attention heads and key/value heads, by key."""
    config = getattr(meta.module, "config", None)
    if config is not None and hasattr(config, "num_attention_heads"):  # Hugging Face
        heads = [("num_attention_heads", int(config.num_attention_heads))]
        kv = getattr(config, "num_key_value_heads", None)
        return heads + ([("num_key_value_heads", int(kv))] if kv else [])
    counts = {n for m in meta.module.modules() if isinstance(n := getattr(m, "n_heads", None), int)}
    return [("model.n_heads", n) for n in sorted(counts)]


def _option_problem(meta: MetaModel, plan: Mapping[str, str], key: str) -> str | None:
    """Why the model cannot run ``parallel.<key>`` (None: it can): the head must be one planned
    colwise_gather_output module; under sequence parallelism every parameter must be where the
    derived layout accounts for it (planned, a norm, in a module that gathers its input, or the
    embedding unit), or a module the runner knows nothing of would see a slice of the tokens and
    hold a part of its gradient."""
    planned = stage_plan(meta.module, plan)
    layout = _sequence_layout(meta.module, meta.spec, planned)
    if layout.head is None or planned.get(layout.head) != "colwise_gather_output":
        head = "/".join(meta.spec.units[-1].modules)
        return (f"the model's last unit ({head}) is not one module its tp_plan shards as colwise_gather_output, "
                "where the logits leave the stage.")
    if key == "loss_parallel":
        return None
    if layout.embed is None:
        return (f"the model's first unit holds several modules ({', '.join(meta.spec.units[0].modules)}), whose "
                "sum the runner cannot scatter on the sequence.")
    known = set(planned) | layout.gathered | layout.norms | {layout.embed}
    unknown = [name for name, _ in meta.module.named_parameters()
               if not any(name.startswith(f"{owner}.") for owner in known)]
    if unknown:
        return (f"{', '.join(unknown[:3])}{' ...' if len(unknown) > 3 else ''} would see only this rank's slice of "
                "the sequence: not in the tp_plan, not a norm (LayerNorm, RMSNorm), nor in a module whose inputs "
                "are gathered.")
    return None


def check_tp(meta: MetaModel, parallel: Any) -> None:
    """The checks of ``parallel.tp`` and its options that need the model, before launch (those that
    need only the config: ``runner.parallel.dims.check_tp_options``, earlier)."""
    tp = int(parallel.get("tp", 1))
    if tp == 1:
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
    layouts = param_layouts(meta.module, plan)  # the dimension each planned weight is sharded on
    for names in meta.tied:  # one weight tied between two modules must be sharded alike in both
        owners = {name.rpartition(".")[0] for name in names}
        if len({layouts.get(n, "whole") for n in names}) > 1:
            raise ConfigError(f"parallel.tp={tp}: the tied weight {names} would be sharded differently in "
                              f"{', '.join(f'{o} ({style_of(o, plan)})' for o in sorted(owners))}. Fix: a tp_plan "
                              "that shards both alike (embedding_rowwise with colwise_gather_output), or untie them.")
    for key, n in _heads(meta):
        if n % tp:
            fits = [d for d in range(2, n + 1) if n % d == 0 and all(m % d == 0 for _, m in _heads(meta))]
            raise ConfigError(f"parallel.tp={tp} does not divide {key}={n}: each shard holds whole heads. "
                              f"Fix: parallel.tp={' or '.join(map(str, fits[:4])) or 1}.")
    for key in ("sequence_parallel", "loss_parallel"):
        if parallel.get(key) and (problem := _option_problem(meta, plan, key)):
            raise ConfigError(f"parallel.{key}=true with parallel.tp={tp}: {problem} Fix: parallel.{key}=false.")


def apply_tp(module: StageModule, mesh: Mesh, plan: TPPlan) -> tuple[str, ...]:
    """Shard ``module``'s planned layers over this rank's tp group, in place. Weights tied within
    the module (embedding and head of one stage) are tied again after distribution. Returns the
    names of the weights whose gradients the tp group sums (``sum_partial_grads``)."""
    assert mesh.tp_mesh is not None
    before = dict(module.named_parameters(remove_duplicate=False))
    planned = stage_plan(module, plan.styles)
    parallelize_module(module, mesh.tp_mesh, _torch_styles(module, module.spec, plan))
    first_name: dict[int, str] = {}
    for name, p in before.items():  # a weight two modules shared was distributed once per module: share again
        first = first_name.setdefault(id(p), name)
        if first != name:
            owner, _, leaf = name.rpartition(".")
            setattr(module.get_submodule(owner), leaf, module.get_parameter(first))
    return tuple(f"{name}.{p}" for name, style in planned.items() if style == REPLICATED_WITH_GRAD_SUM
                 for p, _ in module.get_submodule(name).named_parameters())


def loss_context(enabled: bool) -> Callable[[], AbstractContextManager]:
    """What a step enters around the losses and their backward: torch's ``loss_parallel`` under
    ``parallel.loss_parallel`` (cross-entropy of vocabulary-sharded logits), else nothing."""
    return loss_parallel if enabled else nullcontext


def sum_partial_grads(modules: Sequence[nn.Module], grad_sums: Sequence[tuple[str, ...]], mesh: Mesh) -> None:
    """Sum over the tp group the gradients each shard holds only its part of: those ``apply_tp``
    named for each module (``grad_sums``, in the order of ``modules``), and a replicated DTensor
    weight's gradient left partial by DTensor (a norm's under sequence parallelism: each rank's
    slice of the tokens adds its part), as its weight is placed."""
    group = mesh.group("tp") if mesh.tp_mesh is not None else None
    if group is None:
        return
    with waiting("the tp group's sum of partial gradients"):  # after the schedule: outside any action
        for module, names in zip(modules, grad_sums, strict=True):
            _sum_partial(module, names, group)


def _sum_partial(module: nn.Module, names: tuple[str, ...], group) -> None:
    import torch.distributed as dist

    for name in names:
        grad = module.get_parameter(name).grad
        if grad is not None:
            dist.all_reduce(grad.to_local() if isinstance(grad, DTensor) else grad, group=group)
    for p in module.parameters():
        grad = p.grad
        if isinstance(grad, DTensor) and isinstance(p, DTensor) and any(pl.is_partial() for pl in grad.placements):
            p.grad = grad.redistribute(grad.device_mesh, p.placements)
