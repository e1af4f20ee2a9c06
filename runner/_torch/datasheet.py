"""torch's table of device datasheets (``torch._inductor.analysis.device_info``, private), read as
dense figures whatever torch's version. Tested with torch 2.13 and 2.11 (the GPU image's), on CPU.

The table's tensor-core figures (bf16, fp16, tf32) include 2:4 structured sparsity on some devices:
torch 2.12 and later give the factor (``tops_sparsity_factor``: the H100's bf16 1979 TFLOPS are
989.5 dense); torch before 2.12 (2.11 on the GPU image) has no factor, and its H100 entry's
tensor-core figures are already the with-sparsity ones (bf16 1979 TFLOPS, read there). fp32 and
fp64 figures are dense in both (the H100's fp32 67 TFLOPS is its datasheet's dense figure).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Datasheet", "datasheet_names", "read_datasheet"]

_TENSOR_CORE = {torch.bfloat16, torch.float16, "torch.tf32"}
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # the dtypes a run computes in
# Tables without tops_sparsity_factor (torch < 2.12): the devices whose tensor-core figures include
# sparsity there, and by what factor.
_SPARSE_BEFORE_FACTOR = {"NVIDIA H100": 2}


@dataclass(frozen=True)
class Datasheet:
    name: str  # the table's name of the device, upper case ("NVIDIA H100")
    flops: dict[str, float]  # dense FLOP/s per dtype name: "torch.float32", "torch.bfloat16", "torch.float16"
    bandwidth: float  # memory bytes/s
    memory_bytes: int  # the device's memory


def datasheet_names() -> list[str]:
    """Every device the table knows, by its exact name, sorted."""
    from torch._inductor.analysis import device_info

    return sorted(device_info._device_mapping)


def read_datasheet(name: str) -> Datasheet | None:
    """The named device's dense figures (exact names, any case); None where the table lacks it.
    The table's own spelling is looked up: torch 2.11's lookup is case-sensitive ("NVIDIA A100"
    found, "nvidia a100" not), 2.13's is not."""
    from torch._inductor.analysis import device_info

    upper = name.upper()
    spelled = next((n for n in device_info._device_mapping if n.upper() == upper), None)
    info = device_info.lookup_device_info(spelled) if spelled is not None else None
    if info is None:
        return None
    sparsity = getattr(info, "tops_sparsity_factor", None) or _SPARSE_BEFORE_FACTOR.get(upper, 1)
    flops = {str(dtype): tops * 1e12 / (sparsity if dtype in _TENSOR_CORE else 1)
             for dtype, tops in info.tops.items() if dtype in _DTYPES}
    return Datasheet(upper, flops, info.dram_bw_gbs * 1e9, int(info.dram_gb * 2**30))
