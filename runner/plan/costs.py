"""What the planner times in its own process: every top-level child's forward, full backward,
zero-bubble input and weight backwards (with torch's own split-backward functions), optimizer
update, and the bytes it saves for backward and sends on, on one microbatch; and the per-stage
F/B/I/W costs that follow from a split.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Iterator, Mapping, NamedTuple, Sequence

import torch
from omegaconf import DictConfig

from runner._torch import pp as _torch_pp
from runner.losses import build_loss
from runner.models.split import StageModule, build_meta_model, materialize
from runner.optim import UpdateSnapshot
from runner.ranks.dist import synchronize

__all__ = ["ChildCost", "UnitOnMicrobatch", "units_on_a_microbatch", "measure_child_costs", "stage_costs"]


@dataclass(frozen=True)
class ChildCost:
    forward_s: float
    backward_s: float  # full backward
    input_backward_s: float  # a zero-bubble I: the gradient w.r.t. the input only
    weight_backward_s: float  # the W after it: the weight gradients, from what the I kept
    saved_bytes: int  # tensors autograd keeps from forward to backward
    output_bytes: int  # what the child sends on
    update_s: float = 0.0  # the optimizer step of its parameters, with the global-norm clip's share
    params: int = 0  # parameters it holds (the whole-rank memory estimate: runner.plan.memory)
    # train.optimizer_sync=post_validate/deferred: the copy of its parameters and AdamW state taken
    # before each update (runner.optim.UpdateSnapshot: 12 bytes per parameter)
    snapshot_s: float = 0.0


def _timed(fn, repeats: int, device: torch.device, setup=lambda: None) -> float:
    """Median seconds of ``fn(setup())``; the setup (a backward's forward) is not timed."""
    fn(setup())  # warm-up
    samples = []
    for _ in range(repeats):
        arg = setup()
        synchronize(device)
        start = time.perf_counter()
        fn(arg)
        synchronize(device)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def _measure_child(child: torch.nn.Module, x: torch.Tensor, targets: torch.Tensor, *, loss_fn, last: bool,
                   repeats: int) -> ChildCost:
    device = x.device
    inp = x.detach().requires_grad_(x.is_floating_point())

    def forward() -> torch.Tensor:
        out = child(inp)
        return loss_fn(out, targets) if last else out

    saved = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[0] += t.numel() * t.element_size()
        return t.detach()  # not ``t``: see ``runner.verify.memory.activation_bytes``

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = forward()
    grad = None if last else torch.ones_like(out)
    forward_s = _timed(lambda _: forward(), repeats, device)
    backward_s = _timed(lambda output: output.backward(grad), repeats, device, setup=forward)
    # I and W as torch's zero-bubble stages run them: together they cost more than one backward
    # (W takes one autograd pass per parameter group). The batch (integer ids) takes no gradient.
    input_s = weight_s = 0.0
    if inp.requires_grad:
        input_s = _timed(lambda output: _torch_pp.backward_input(output, grad, [inp], child), repeats, device,
                         setup=forward)
        weight_s = _timed(lambda groups: _torch_pp.backward_weight(child, groups), repeats, device,
                          setup=lambda: _torch_pp.backward_input(forward(), grad, [inp], child))
    update_s, snapshot_s = _update_s(list(child.parameters()), repeats, device)  # the backwards left gradients
    child.zero_grad(set_to_none=True)
    return ChildCost(forward_s, backward_s, input_s, weight_s, saved[0], out.numel() * out.element_size(), update_s,
                     sum(p.numel() for p in child.parameters()), snapshot_s)


def _update_s(params: list[torch.nn.Parameter], repeats: int, device: torch.device) -> tuple[float, float]:
    """What the runner does to these parameters after backward: their share of the global norm,
    the clip, and AdamW (with a negligible learning rate: the planner's model stays as it is); and
    the snapshot ``post_validate`` and ``deferred`` take before it (the runner's own)."""
    if not params:
        return 0.0, 0.0
    optimizer = torch.optim.AdamW(params, lr=1e-12)

    def update() -> None:
        norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
        torch.nn.utils.clip_grads_with_norm_(params, 1.0, norm)
        optimizer.step()

    update_s = _timed(lambda _: update(), repeats, device)  # AdamW's state exists from here on
    snapshot = UpdateSnapshot(optimizer)
    return update_s, _timed(lambda _: snapshot.take(), repeats, device)


class UnitOnMicrobatch(NamedTuple):
    name: str  # the pipeline unit's
    unit: StageModule  # the unit alone, as a stage of its own
    inputs: torch.Tensor  # what it takes: the microbatch through the units before it
    targets: torch.Tensor  # the microbatch's, for the loss after the last unit
    last: bool  # whether its output goes to the loss


def units_on_a_microbatch(cfg: DictConfig, microbatch_size: int,
                          device: torch.device) -> Iterator[UnitOnMicrobatch]:
    """Every pipeline unit of ``cfg``'s model (built on ``device`` under the run's seed) in order,
    with its input on one microbatch of ``microbatch_size`` random token rows; the next unit's input
    is computed once the caller is done with this one."""
    meta = build_meta_model(cfg.model, cfg.parallel.get("stage_modules"))
    model = materialize(meta, meta.unit_names, seed=cfg.train.seed, device=device)
    vocab = cfg.data.get("vocab_size") or 2
    x = torch.randint(vocab, (microbatch_size, cfg.train.seq_len), device=device)
    targets = torch.randint(vocab, (microbatch_size, cfg.train.seq_len), device=device)
    names = meta.unit_names
    for i, name in enumerate(names):
        unit = StageModule(meta.spec, [name], {n: model.get_submodule(n) for n in [*meta.spec.unit(name).modules,
                                                                                   *meta.spec.shared]})
        yield UnitOnMicrobatch(name, unit, x, targets, i == len(names) - 1)
        with torch.no_grad():
            x = unit(x)


def measure_child_costs(cfg: DictConfig, microbatch_size: int, repeats: int,
                        device: torch.device) -> dict[str, ChildCost]:
    """Time every top-level child's forward, backward and input-only backward on one microbatch."""
    loss_fn = build_loss(cfg.loss)
    return {u.name: _measure_child(u.unit, u.inputs, u.targets, loss_fn=loss_fn, last=u.last, repeats=repeats)
            for u in units_on_a_microbatch(cfg, microbatch_size, device)}


def stage_costs(stages: Sequence[Sequence[str]], child: Mapping[str, ChildCost]) -> dict[tuple[int, str], float]:
    """Per (stage, kind): the F, B, I and W seconds of a stage from its children's."""
    costs = {}
    for s, names in enumerate(stages):
        f = sum(child[n].forward_s for n in names)
        b = sum(child[n].backward_s for n in names)
        # The first stage's input (the batch) takes no gradient: torch's I there does nothing and
        # its W runs the whole backward, at the W's place in the order (the tail of ZB schedules).
        i = sum(child[n].input_backward_s for n in names) if s > 0 else 0.0
        w = sum(child[n].weight_backward_s for n in names) if s > 0 else b
        costs.update({(s, "F"): f, (s, "B"): b, (s, "I"): i, (s, "W"): w})
    return costs

