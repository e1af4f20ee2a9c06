"""A device's peak figures, and the roofline time of what a module computes, counted op by op on
fake tensors (no memory, no device): each aten op costs the longer of its FLOPs at the device's
peak for its dtype and its bytes (inputs and outputs) at the device's memory bandwidth.

torch's own ``RuntimeEstimator`` does this too, but asserts a GPU; this counts on any host. The
FLOP formulas are torch's (``torch.utils.flop_counter``), plus the CPU attention kernel that a
fake CPU tensor dispatches to (its FLOPs are those of the GPU kernels it stands in for).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.flop_counter import flop_registry

from runner._torch.datasheet import datasheet_names, read_datasheet
from runner._torch.dispatch import CPU_ATTENTION_FLOPS, METADATA_OPS, TorchDispatchMode, tree_flatten
from runner.errors import ConfigError

__all__ = ["DevicePeaks", "device_peaks", "lookup_peaks", "known_devices", "OpCounter"]

# Entries of torch 2.13's table that disagree with the vendor's datasheet, corrected here (and said
# in the plan's header): the L4's bandwidth is an H100's, and its bf16/fp16 figures include
# sparsity without a sparsity factor (datasheet: 300 GB/s; 121 dense bf16 TFLOPS). (The table's
# sparse figures, and torch 2.11's table without the factor: runner._torch.datasheet.)
_CORRECTIONS = {"NVIDIA L4": {"bandwidth": 300e9, "torch.bfloat16": 121e12, "torch.float16": 121e12}}


def known_devices() -> list[str]:
    return datasheet_names()


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
    table (``runner._torch.datasheet``: exact names, any case), corrected where it is wrong."""
    sheet = read_datasheet(name)
    if sheet is None:
        raise ConfigError(f"plan.target={name!r} is not a device torch's datasheet table knows (exact names only). "
                          f"Fix: plan.target=<one of {', '.join(repr(n) for n in known_devices())}>.")
    fixes = _CORRECTIONS.get(sheet.name, {})
    flops = {**sheet.flops, **{k: v for k, v in fixes.items() if k != "bandwidth"}}
    return DevicePeaks(sheet.name, flops, fixes.get("bandwidth", sheet.bandwidth), sheet.memory_bytes, tuple(fixes))


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
        if func.is_view or func in METADATA_OPS or not outputs:  # a view, detach, a device query: no traffic
            return out
        if func in CPU_ATTENTION_FLOPS:
            flops = CPU_ATTENTION_FLOPS[func](*args, **kwargs)
        elif func.overloadpacket in flop_registry:
            flops = flop_registry[func.overloadpacket](*args, **kwargs, out_val=out)
        else:
            flops = 0
        nbytes = _nbytes(tree_flatten((args, kwargs))[0]) + _nbytes(outputs)
        dtype = next((t.dtype for t in tree_flatten(args)[0] if isinstance(t, torch.Tensor)), torch.float32)
        self.flops += flops
        self.bytes += nbytes
        self.seconds += max(flops / self.peaks.peak(dtype), nbytes / self.peaks.bandwidth)
        return out
