"""A device's peak figures, and the roofline time of what a module computes, counted op by op on
fake tensors (no memory, no device): each aten op costs the longer of its FLOPs at the device's
peak for its dtype and its bytes (inputs and outputs) at the device's memory bandwidth.

torch's own ``RuntimeEstimator`` does this too, but asserts a GPU; this counts on any host. The
FLOP formulas are torch's (``torch.utils.flop_counter``), plus the CPU attention kernel that a
fake CPU tensor dispatches to (its FLOPs are those of the GPU kernels it stands in for).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

from runner.errors import ConfigError

__all__ = ["DevicePeaks", "device_peaks", "lookup_peaks", "known_devices", "OpCounter"]

# torch's datasheet figures for tensor-core dtypes include 2:4 structured sparsity on some devices
# (tops_sparsity_factor: the H100's bf16 1979 TFLOPS are 989.5 dense); fp32 and fp64 figures are
# dense already (the H100's fp32 67 TFLOPS is its datasheet's dense figure).
_TENSOR_CORE = {torch.bfloat16, torch.float16, "torch.tf32"}
_ATTENTION: dict[Any, Callable[..., int]] = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default:
        lambda q, k, v, *a, **kw: sdpa_flop_count(q.shape, k.shape, v.shape),
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default:
        lambda g, q, k, v, *a, **kw: sdpa_backward_flop_count(g.shape, q.shape, k.shape, v.shape),
}

# Entries of torch 2.13's table that disagree with the vendor's datasheet, corrected here (and said
# in the plan's header): the L4's bandwidth is an H100's, and its bf16/fp16 figures include
# sparsity without a sparsity factor (datasheet: 300 GB/s; 121 dense bf16 TFLOPS).
# torch before 2.12 (2.11 on the GPU image) has no tops_sparsity_factor, and its H100 entry's
# tensor-core figures are already the with-sparsity ones (bf16 1979 TFLOPS, read there).
_SPARSE_BEFORE_FACTOR = {"NVIDIA H100": 2}
_CORRECTIONS = {"NVIDIA L4": {"bandwidth": 300e9, "torch.bfloat16": 121e12, "torch.float16": 121e12}}
_METADATA = {torch.ops.aten._unsafe_view.default}


def known_devices() -> list[str]:
    from torch._inductor.analysis.device_info import _device_mapping

    return sorted(_device_mapping)


@dataclass(frozen=True)
class DevicePeaks:
    name: str
    flops: dict[str, float]  # dense FLOP/s per dtype name ("torch.bfloat16", "torch.float32")
    bandwidth: float  # memory bytes/s
    memory_bytes: int  # the device's memory
    corrected: tuple[str, ...] = ()  # the table's figures replaced by the datasheet's (_CORRECTIONS)

    def peak(self, dtype: torch.dtype) -> float:
        """FLOP/s for matmuls in ``dtype`` (fp32 runs as fp32: the runner does not enable TF32)."""
        return self.flops.get(str(dtype), self.flops["torch.float32"])


def device_peaks(name: str) -> DevicePeaks:
    """The named device's dense peak FLOP/s, memory bandwidth and memory, from torch's datasheet
    table (``torch._inductor.analysis.device_info``: exact names, any case)."""
    from torch._inductor.analysis.device_info import lookup_device_info

    info = lookup_device_info(name)
    if info is None:
        raise ConfigError(f"plan.target={name!r} is not a device torch's datasheet table knows (exact names only). "
                          f"Fix: plan.target=<one of {', '.join(repr(n) for n in known_devices())}>.")
    sparsity = getattr(info, "tops_sparsity_factor", None) or _SPARSE_BEFORE_FACTOR.get(name.upper(), 1)
    flops = {str(dtype): tops * 1e12 / (sparsity if dtype in _TENSOR_CORE else 1)
             for dtype, tops in info.tops.items() if dtype in (torch.float32, torch.bfloat16, torch.float16)}
    fixes = _CORRECTIONS.get(name.upper(), {})
    flops.update({k: v for k, v in fixes.items() if k != "bandwidth"})
    return DevicePeaks(name.upper(), flops, fixes.get("bandwidth", info.dram_bw_gbs * 1e9), int(info.dram_gb * 2**30),
                       tuple(fixes))


def lookup_peaks(device_name: str) -> DevicePeaks | None:
    """The peaks of a device by the name ``torch.cuda.get_device_name`` gives it: the table's entry
    of that name, else of the longest table name it begins with ("NVIDIA H100 80GB HBM3": "NVIDIA
    H100", whose figures are the SXM part's); None where the table has neither."""
    upper = device_name.upper()
    names = [n for n in known_devices() if upper == n or upper.startswith(n + " ")]
    return device_peaks(max(names, key=len)) if names else None


def _nbytes(tensors: list[Any]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


class OpCounter(TorchDispatchMode):
    """While active: the FLOPs, bytes and roofline seconds (at the device's peaks, efficiency 1)
    of every aten op that runs. Use inside ``FakeTensorMode`` to count without computing."""

    def __init__(self, peaks: DevicePeaks):
        super().__init__()
        self.peaks = peaks
        self.flops = 0
        self.bytes = 0
        self.seconds = 0.0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        outputs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        if func.is_view or func in _METADATA or not outputs:  # a view, detach, a device query: no traffic
            return out
        if func in _ATTENTION:
            flops = _ATTENTION[func](*args, **kwargs)
        elif func._overloadpacket in flop_registry:
            flops = flop_registry[func._overloadpacket](*args, **kwargs, out_val=out)
        else:
            flops = 0
        nbytes = _nbytes(tree_flatten((args, kwargs))[0]) + _nbytes(outputs)
        dtype = next((t.dtype for t in tree_flatten(args)[0] if isinstance(t, torch.Tensor)), torch.float32)
        self.flops += flops
        self.bytes += nbytes
        self.seconds += max(flops / self.peaks.peak(dtype), nbytes / self.peaks.bandwidth)
        return out
