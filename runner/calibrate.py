"""What the planner cannot learn from timing modules in one process: the cost of a message
between two ranks (latency and bandwidth, over the transport the runs use: gloo on CPU, NCCL
between two GPUs) and what the pipelining runtime adds to every compute action (stage
bookkeeping, buffers, Python).

Measured on two real ranks, started the way a run starts them: a ping-pong for the message
cost, then a 1F1B pipeline of almost-free stages, whose step time the simulator must reproduce
with a per-action overhead (solved for, since the predicted time is linear in it); and how much
slower a rank computes while its neighbour computes too.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B

from runner.dist import pick_device
from runner.launch import start_method
from runner.schedule import schedule_order
from runner.simulate import simulate

__all__ = ["Calibration", "calibrate", "solve_action_overhead"]

_MICROBATCHES = 8


@dataclass(frozen=True)
class Calibration:
    latency_s: float  # one message between two ranks, whatever its size
    bandwidth: float  # bytes/s beyond the latency
    action_overhead_s: float  # added to every F/B/I/W by the pipelining runtime
    # Compute time with the other rank computing too, over alone: ranks of one host share caches
    # and memory bandwidth, and the planner times each child alone.
    corunning_slowdown: float = 1.0

    def message_s(self, nbytes: int) -> float:
        return self.latency_s + nbytes / self.bandwidth


def _sync(device: torch.device) -> None:
    if device.type == "cuda":  # NCCL and kernels return before the work is done
        torch.cuda.synchronize(device)


def _one_way_s(tensor: torch.Tensor, rank: int, repeats: int) -> float:
    """Median half round trip of ``tensor`` between ranks 0 and 1."""
    samples = []
    for _ in range(repeats + 2):
        _sync(tensor.device)
        start = time.perf_counter()
        if rank == 0:
            dist.send(tensor, 1)
            dist.recv(tensor, 1)
        else:
            dist.recv(tensor, 0)
            dist.send(tensor, 0)
        _sync(tensor.device)
        samples.append((time.perf_counter() - start) / 2)
    return statistics.median(samples[2:])  # the first exchanges set up the connection


def _pipeline_step_s(rank: int, repeats: int, device: torch.device) -> float:
    """Median step time of a 2-stage 1F1B pipeline whose stages compute next to nothing."""
    torch.manual_seed(0)
    stage = PipelineStage(nn.Linear(8, 8).to(device), rank, 2, device)
    schedule = Schedule1F1B(stage, _MICROBATCHES, loss_fn=lambda out, target: (out - target).pow(2).mean())
    x, y = torch.randn(_MICROBATCHES, 8, device=device), torch.randn(_MICROBATCHES, 8, device=device)
    samples = []
    for _ in range(repeats + 2):
        dist.barrier()
        start = time.perf_counter()
        schedule.step(x) if rank == 0 else schedule.step(target=y)
        _sync(device)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples[2:])  # the first step infers shapes


def _corunning_slowdown(rank: int, repeats: int, device: torch.device) -> float:
    """How much slower rank 0 runs a transformer feed-forward block's forward and backward (1024
    tokens of width 256: weights and activations beyond a core's private caches) while rank 1 runs
    the same than while rank 1 waits. Alone and together alternate and each pair gives a ratio, so
    that a slow spell of a shared host lands on both sides of a ratio, not on one."""
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256)).to(device)
    x = torch.randn(1024, 256, device=device)

    def timed(active: bool) -> float:
        dist.barrier()
        start = time.perf_counter()
        if active:
            block(x).sum().backward()
            _sync(device)
        elapsed = time.perf_counter() - start
        dist.barrier()
        return elapsed

    ratios = []
    for i in range(repeats + 2):
        alone = timed(rank == 0)  # rank 1 only waits at the barriers
        both = timed(True)
        if rank == 0 and i >= 2:  # the first blocks warm up
            ratios.append(both / alone)
    return statistics.median(ratios) if rank == 0 else 0.0


def _rank(rank: int, store_path: str, kind: str, message_bytes: int, repeats: int, out: str) -> None:
    torch.set_num_threads(1)
    device = pick_device(kind, rank)
    dist.init_process_group("nccl" if kind == "cuda" else "gloo", store=dist.FileStore(store_path, 2), rank=rank,
                            world_size=2, device_id=device if kind == "cuda" else None)
    try:
        small = _one_way_s(torch.zeros(1, device=device), rank, repeats)
        large = _one_way_s(torch.zeros(message_bytes // 4, device=device), rank, repeats)
        step = _pipeline_step_s(rank, repeats, device)
        slowdown = _corunning_slowdown(rank, repeats, device)
        if rank == 0:
            torch.save({"small": small, "large": large, "step": step, "slowdown": slowdown}, out)
    finally:
        dist.destroy_process_group()


def solve_action_overhead(step_s: float, comm_s: float) -> float:
    """The per-action overhead that makes the simulated 2-rank 1F1B step last ``step_s``."""
    order = schedule_order("1f1b", 2, _MICROBATCHES, 1)

    def predicted(overhead: float) -> float:
        return max(a.end for a in simulate(order, {"F": overhead, "B": overhead}, num_stages=2, comm_s=comm_s))

    base, slope = predicted(0.0), predicted(1.0) - predicted(0.0)
    return max(0.0, (step_s - base) / slope)


def calibrate(message_bytes: int, *, device: str = "cpu", repeats: int = 20) -> Calibration:
    """Two ranks on this host, on ``device`` (``cpu``: gloo, forked where the runner would fork
    them; ``cuda``: NCCL between GPUs 0 and 1): the message cost at 4 bytes and at
    ``message_bytes`` (at least 4 MiB, so that the transfer, not the noise, sets the bandwidth),
    then the runtime's per-action overhead and the co-running slowdown."""
    message_bytes = max(message_bytes, 4 * 2**20)
    with tempfile.TemporaryDirectory(prefix="runner-calibrate-") as tmp:
        out = str(Path(tmp) / "result.pt")
        mp.start_processes(_rank, args=(str(Path(tmp) / "store"), device, message_bytes, repeats, out), nprocs=2,
                           join=True, start_method=start_method("auto", device))
        result = torch.load(out, weights_only=True)
    bandwidth = (message_bytes - 4) / max(result["large"] - result["small"], 1e-9)
    latency = result["small"]
    comm_s = latency + 8 * 4 / bandwidth  # one microbatch of Linear(8, 8) outputs: 8 floats
    return Calibration(latency, bandwidth, solve_action_overhead(result["step"], comm_s),
                       max(1.0, result["slowdown"]))
