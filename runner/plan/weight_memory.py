"""M_W / M_B measured on the model: of the activations a forward saves for backward (M_B), the
share its weight gradients still need once the input gradient has run (M_W): the saved tensors of
the autograd nodes that compute a parameter's gradient (a matmul's input, a norm's input and
statistics), not those only the input gradient reads (attention probabilities, activation
inputs). Read from the autograd graph of one microbatch's forward, child by child, as the planner
times them (``runner.plan.costs``)."""

from __future__ import annotations

import torch
from omegaconf import DictConfig

from runner.losses import build_loss
from runner.plan.costs import units_on_a_microbatch

__all__ = ["saved_split", "measure_weight_grad_fraction"]


def _saved(node) -> list[torch.Tensor]:
    out = []
    for name in dir(node):
        if name.startswith("_saved_"):
            try:
                value = getattr(node, name)
            except RuntimeError:  # freed, or not a tensor it can unpack
                continue
            out += [value] if isinstance(value, torch.Tensor) else [v for v in value if isinstance(v, torch.Tensor)] \
                if isinstance(value, (tuple, list)) else []
    return out


def saved_split(output: torch.Tensor, params: list[torch.nn.Parameter]) -> tuple[int, int]:
    """(bytes saved for backward, of them the bytes a weight gradient reads) in ``output``'s graph;
    each tensor counted once, parameters (and views of them) not at all."""
    param_ptrs = {p.data_ptr() for p in params}
    param_only: dict[object, bool] = {}

    def only_params(node) -> bool:  # its whole subgraph ends in parameters: a weight's path
        if node not in param_only:
            if type(node).__name__ == "AccumulateGrad":  # a leaf: a parameter, or the stage's input
                param_only[node] = node.variable.data_ptr() in param_ptrs
            else:
                nexts = [n for n, _ in node.next_functions if n is not None]
                param_only[node] = bool(nexts) and all(only_params(n) for n in nexts)
        return param_only[node]

    seen, total, weight = set(), {}, {}
    stack = [output.grad_fn] if output.grad_fn is not None else []
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        nexts = [n for n, _ in node.next_functions if n is not None]
        stack += nexts
        feeds_weight = any(only_params(n) for n in nexts) and not only_params(node)
        for t in _saved(node):
            if t.data_ptr() in param_ptrs:
                continue
            key = (t.data_ptr(), t.numel(), t.dtype)
            total[key] = t.numel() * t.element_size()
            if feeds_weight:
                weight[key] = total[key]
    return sum(total.values()), sum(weight.values())


def measure_weight_grad_fraction(cfg: DictConfig, microbatch_size: int, device: torch.device) -> float:
    """M_W / M_B over the whole model on one microbatch of ``microbatch_size`` samples."""
    loss_fn = build_loss(cfg.loss)
    total = weight = 0
    for u in units_on_a_microbatch(cfg, microbatch_size, device):
        out = u.unit(u.inputs.detach().requires_grad_(u.inputs.is_floating_point()))
        out = loss_fn(out, u.targets) if u.last else out
        saved, needed = saved_split(out, list(u.unit.parameters()))
        total, weight = total + saved, weight + needed
    return weight / total if total else 0.0
