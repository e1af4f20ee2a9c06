"""What the planner cannot learn from timing modules in one process: the cost of a message
between two ranks (latency and bandwidth, over the transport the runs use: gloo on CPU, NCCL
between two GPUs) and what the pipelining runtime adds to every compute action (stage
bookkeeping, buffers, Python).

Measured on two real ranks, started the way a run starts them: a ping-pong for the message
cost, and the same message sent while its sender computes (as in a pipeline); then a 1F1B pipeline
of almost-free stages, whose step time the simulator must reproduce with a per-action overhead
(solved for, since the predicted time is linear in it); and how much slower, and how much less
evenly, a rank computes while its neighbour computes too.
"""

from __future__ import annotations

import math
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B

from runner.pipeline.schedule import schedule_order
from runner.pipeline.simulate import simulate
from runner.plan.link import Link
from runner.ranks.dist import DistEnv, synchronize
from runner.ranks.processes import spawn

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
    # Added to a message whose sender is computing when its receiver asks for it, as in a running
    # pipeline: the sender's transport thread first has to get a core (gloo on shared CPU cores).
    busy_delay_s: float = 0.0
    # Coefficient of variation of a compute's time with both ranks busy. A pipeline waits on its
    # slower actions, so varying times make a step longer than the one of mean times.
    action_jitter: float = 0.0
    # An all-reduce between the two ranks (tensor parallelism's collectives, runner.plan.tp_cost):
    # its fixed cost and bytes/s beyond it; None where not measured (plan.comm_* given).
    allreduce_latency_s: float | None = None
    allreduce_bandwidth: float | None = None

    def message_s(self, nbytes: int, sender_action_s: float = math.inf) -> float:
        """A message between two busy ranks of a pipeline whose actions take ``sender_action_s``:
        the busy delay waits out the sender's compute, so it is never longer than one action."""
        return self.latency_s + nbytes / self.bandwidth + min(self.busy_delay_s, sender_action_s)

    def all_reduce_link(self) -> Link:
        """The link a ring all-reduce's messages take (``runner.plan.link.ring_all_reduce_s``): the
        measured all-reduce between two ranks is two of them, so half its fixed cost per message and
        its bytes/s; where it was not measured (``plan.comm_*`` given), the message's."""
        if self.allreduce_latency_s is None or self.allreduce_bandwidth is None:
            return Link(self.latency_s, self.bandwidth)
        return Link(self.allreduce_latency_s / 2, self.allreduce_bandwidth)


def _one_way_s(tensor: torch.Tensor, rank: int, repeats: int) -> tuple[float, float]:
    """Median and least half round trip of ``tensor`` between ranks 0 and 1."""
    samples = []
    for _ in range(repeats + 2):
        synchronize(tensor.device)
        start = time.perf_counter()
        if rank == 0:
            dist.send(tensor, 1)
            dist.recv(tensor, 1)
        else:
            dist.recv(tensor, 0)
            dist.send(tensor, 0)
        synchronize(tensor.device)
        samples.append((time.perf_counter() - start) / 2)
    samples = samples[2:]  # the first exchanges set up the connection
    return statistics.median(samples), min(samples)


def _all_reduce_s(tensor: torch.Tensor, repeats: int) -> float:
    """The least time of an all-reduce of ``tensor`` over the two ranks (barrier-aligned starts)."""
    samples = []
    for _ in range(repeats + 2):
        dist.barrier()
        synchronize(tensor.device)
        start = time.perf_counter()
        dist.all_reduce(tensor)
        synchronize(tensor.device)
        samples.append(time.perf_counter() - start)
    return min(samples[2:])


def _compute_for(seconds: float, device: torch.device) -> None:
    """Keep this rank's thread (and its device) computing for ``seconds``."""
    a = torch.randn(128, 128, device=device)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        a @ a
        synchronize(device)


def _busy_one_way_s(tensor: torch.Tensor, rank: int, repeats: int) -> float:
    """Mean time rank 0 waits for ``tensor`` from rank 1, asking for it while rank 1 computes on
    after sending it: what a pipeline's receive costs (the mean, since every wait adds up)."""
    samples = []
    for _ in range(repeats + 2):
        dist.barrier()
        if rank == 1:
            request = dist.isend(tensor, 0)
            assert request is not None  # None only on a rank outside the group
            _compute_for(0.025, tensor.device)
            request.wait()
        else:
            _compute_for(0.005, tensor.device)
            start = time.perf_counter()
            dist.recv(tensor, 1)
            synchronize(tensor.device)
            samples.append(time.perf_counter() - start)
    return statistics.fmean(samples[2:]) if rank == 0 else 0.0


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
        synchronize(device)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples[2:])  # the first step infers shapes


def _corunning(rank: int, repeats: int, device: torch.device) -> tuple[float, float]:
    """How much slower rank 0 runs a transformer feed-forward block's forward and backward (1024
    tokens of width 256: weights and activations beyond a core's private caches) while rank 1 runs
    the same than while rank 1 waits, and the coefficient of variation of its times together.
    Alone and together alternate and each pair gives a ratio, so that a slow spell of a shared
    host lands on both sides of a ratio, not on one."""
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256)).to(device)
    x = torch.randn(1024, 256, device=device)

    def timed(active: bool) -> float:
        dist.barrier()
        start = time.perf_counter()
        if active:
            block(x).sum().backward()
            synchronize(device)
        elapsed = time.perf_counter() - start
        dist.barrier()
        return elapsed

    ratios, together = [], []
    for i in range(2 * repeats + 2):  # twice: a spread needs more samples than a median
        alone = timed(rank == 0)  # rank 1 only waits at the barriers
        both = timed(True)
        if rank == 0 and i >= 2:  # the first blocks warm up
            ratios.append(both / alone)
            together.append(both)
    if rank != 0:
        return 0.0, 0.0
    return statistics.median(ratios), statistics.stdev(together) / statistics.fmean(together)


def _rank(env: DistEnv, message_bytes: int, bandwidth_bytes: int, repeats: int, out: str) -> None:
    rank, device = env.rank, env.device
    small, small_min = _one_way_s(torch.zeros(1, device=device), rank, repeats)
    _, large_min = _one_way_s(torch.zeros(bandwidth_bytes // 4, device=device), rank, repeats)
    message = torch.zeros(message_bytes // 4, device=device)
    (idle, _), busy = _one_way_s(message, rank, repeats), _busy_one_way_s(message, rank, repeats)
    reduce_small = _all_reduce_s(torch.zeros(1, device=device), repeats)
    reduce_large = _all_reduce_s(torch.zeros(bandwidth_bytes // 4, device=device), repeats)
    step = _pipeline_step_s(rank, repeats, device)
    slowdown, jitter = _corunning(rank, repeats, device)
    if rank == 0:
        # The transfer time is the difference of the least disturbed exchanges: medians on a
        # loaded host can put the large message's below the small one's (an infinite bandwidth).
        torch.save({"small": small, "transfer": large_min - small_min, "step": step, "slowdown": slowdown,
                    "jitter": jitter, "busy_delay": busy - idle, "reduce_small": reduce_small,
                    "reduce_transfer": reduce_large - reduce_small}, out)


def solve_action_overhead(step_s: float, comm_s: float) -> float:
    """The per-action overhead that makes the simulated 2-rank 1F1B step last ``step_s``."""
    order = schedule_order("1f1b", 2, _MICROBATCHES, 1)

    def predicted(overhead: float) -> float:
        return max(a.end for a in simulate(order, {"F": overhead, "B": overhead}, num_stages=2, comm_s=comm_s))

    base, slope = predicted(0.0), predicted(1.0) - predicted(0.0)
    return max(0.0, (step_s - base) / slope)


def calibrate(message_bytes: int, *, device: str = "cpu", repeats: int = 20,
              cpus: Sequence[Sequence[int]] | None = None) -> Calibration:
    """Two ranks on this host, on ``device`` (``cpu``: gloo, forked where the runner would fork
    them, pinned to ``cpus`` as its first two ranks would be; ``cuda``: NCCL between GPUs 0 and
    1): the message cost at 4 bytes and at ``message_bytes`` or 4 MiB, whichever is larger (so
    that the transfer, not the noise, sets the bandwidth), what a ``message_bytes`` message costs
    more while its sender computes, then the runtime's per-action overhead and the co-running
    slowdown and jitter, and an all-reduce of the same two sizes (tensor parallelism's collectives)."""
    bandwidth_bytes = max(message_bytes, 4 * 2**20)
    with tempfile.TemporaryDirectory(prefix="runner-calibrate-") as tmp:
        out = str(Path(tmp) / "result.pt")
        # Started as a run's ranks are: gloo bound to loopback, the calibration listens on no address.
        with spawn(2, _rank, max(message_bytes, 4), bandwidth_bytes, repeats, out, device=device, directory=Path(tmp),
                   threads=1, cpus=cpus) as ranks:
            ranks.join()
        result = torch.load(out, weights_only=True)
    bandwidth = (bandwidth_bytes - 4) / max(result["transfer"], 1e-9)
    latency = result["small"]
    comm_s = latency + 8 * 4 / bandwidth  # one microbatch of Linear(8, 8) outputs: 8 floats
    return Calibration(latency, bandwidth, solve_action_overhead(result["step"], comm_s),
                       max(1.0, result["slowdown"]), max(0.0, result["busy_delay"]), result["jitter"],
                       result["reduce_small"], (bandwidth_bytes - 4) / max(result["reduce_transfer"], 1e-9))
