"""What counting ops on fake tensors (``runner.plan.target``, ``runner.plan.roofline``) takes from
torch's private modules: fake tensors, the dispatch mode, pytree's flattening, and the private aten
ops the count names. Tested with torch 2.13.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

__all__ = ["FakeTensorMode", "TorchDispatchMode", "tree_flatten", "CPU_ATTENTION_FLOPS", "METADATA_OPS"]

# The attention kernels a fake CPU tensor dispatches to, which torch's FLOP counter does not list:
# their FLOPs are those of the GPU kernels they stand in for.
CPU_ATTENTION_FLOPS: dict[Any, Callable[..., int]] = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default:
        lambda q, k, v, *a, **kw: sdpa_flop_count(q.shape, k.shape, v.shape),
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default:
        lambda g, q, k, v, *a, **kw: sdpa_backward_flop_count(g.shape, q.shape, k.shape, v.shape),
}
# Ops that only relabel a tensor's metadata, as views do (no memory traffic), but are no views to torch.
METADATA_OPS = {torch.ops.aten._unsafe_view.default}
