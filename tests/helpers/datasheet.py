"""Figures of torch's datasheet table that differ between torch versions, read from the table the
runner reads (``runner._torch.datasheet``), each checked against the versions' known values."""

from __future__ import annotations

import torch

__all__ = ["h100_fp32_flops"]


def h100_fp32_flops() -> float:
    """The H100's dense fp32 FLOP/s in torch's table: 67 TFLOP/s in torch 2.13, 67.5 in torch 2.11
    (the GPU image's). fp32 figures carry no sparsity in either version."""
    from torch._inductor.analysis import device_info

    flops = device_info.lookup_device_info("NVIDIA H100").tops[torch.float32] * 1e12
    assert flops in (67e12, 67.5e12), f"torch {torch.__version__}'s table gives the H100 {flops / 1e12} fp32 TFLOP/s"
    return flops
