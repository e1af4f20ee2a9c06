"""The reported step times (``runner.outputs.step_timer``): the host's on CPU; on CUDA the device's,
between two events per step, read once the device has passed them, never by a wait of their own
during the run. CUDA's events are played here by a stand-in whose device runs a step behind."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import runner.train
from runner.outputs.step_timer import StepTimer
from runner.ranks.dist import DistEnv
from runner.train import Trainer
from runner.validate import validate

from helpers.config import TINY, compose


def device_seconds(step: int) -> float:
    """The stand-in device's time of step ``step``'s work: a different one each step."""
    return 0.05 + 0.01 * step


class FakeDevice:
    """Events in the order recorded: the 2k-th begins step k+1, the next ends it. The device runs a
    step behind the host: an event has completed once two more were recorded after it (the next
    step's wait for its loss), or once it or a later one was waited for (``synchronize``: one
    stream, in order); ``waits`` holds how many events had been recorded at each wait."""

    def __init__(self) -> None:
        self.events: list[FakeEvent] = []
        self.clock_ms = 0.0
        self.waits: list[int] = []
        self.waited = -1  # the last event waited for

    def event(self) -> FakeEvent:
        return FakeEvent(self)


class FakeEvent:
    def __init__(self, device: FakeDevice):
        self.device, self.index, self.at_ms = device, -1, 0.0

    def record(self) -> None:
        d = self.device
        self.index = len(d.events)
        if self.index % 2:  # a step's end: its work done on the device
            d.clock_ms += device_seconds(self.index // 2 + 1) * 1e3
        else:
            d.clock_ms += 7.0  # idle between steps: outside both
        self.at_ms = d.clock_ms
        d.events.append(self)

    def query(self) -> bool:
        return self.index <= self.device.waited or len(self.device.events) - self.index > 2

    def synchronize(self) -> None:
        self.device.waits.append(len(self.device.events))
        self.device.waited = max(self.device.waited, self.index)

    def elapsed_time(self, end: FakeEvent) -> float:
        assert self.query() and end.query(), "cudaErrorNotReady: an event not completed yet"
        return end.at_ms - self.at_ms


def test_on_cpu_a_steps_time_is_the_hosts_and_on_cuda_the_devices_between_its_events_once_completed():
    cpu = StepTimer(torch.device("cpu"))
    cpu.begin(1)
    cpu.end(1, 0.25)
    assert not cpu.on_device and cpu.ready(1) and cpu.seconds(1) == 0.25 and cpu.all_seconds() == [0.25]

    device = FakeDevice()
    timer = StepTimer(torch.device("cpu"), event=device.event)
    assert timer.on_device
    for step in (1, 2):
        timer.begin(step)
        timer.end(step, 0.001)  # the host's: launches only
    assert timer.ready(1) and not timer.ready(2) and device.waits == []
    assert timer.seconds(1) == pytest.approx(device_seconds(1)) and timer.host == {1: 0.001, 2: 0.001}
    with pytest.raises(AssertionError, match="cudaErrorNotReady"):
        timer.seconds(2)  # read before the device finished it: what ready() guards
    assert timer.seconds(2, wait=True) == pytest.approx(device_seconds(2)) and device.waits == [4]
    assert timer.all_seconds() == pytest.approx([device_seconds(1), device_seconds(2)])


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("sync", ["barrier", "deferred"])
def test_a_runs_reported_step_times_are_the_devices_written_as_the_device_passes_them_with_no_wait_until_the_end(
        sync, tmp_path, monkeypatch):
    # Under deferred nothing waits at a step's end; under barrier the update's kernels run after it:
    # the host's times are launches. Each metrics line holds the device's time of its step, written
    # once the device has passed the step (a step or two later here), and the only waits come
    # after the last step; the summary's median is of the device's times.
    device = FakeDevice()
    monkeypatch.setattr(runner.train, "StepTimer", lambda d: StepTimer(d, event=device.event))
    written: list[tuple[int, int]] = []  # (step, events recorded by then)
    write = Trainer._write
    monkeypatch.setattr(Trainer, "_write", lambda self, r: written.append((r["step"], len(device.events)))
                        or write(self, r))
    steps = 5
    cfg = compose(*TINY, "parallel.pp=1", f"train.steps={steps}", f"train.optimizer_sync={sync}")
    trainer = Trainer(validate(cfg, tmp_path), cfg, DistEnv(0, 1, torch.device("cpu")))
    summary = trainer.run().summary
    assert summary is not None
    records = _metrics(tmp_path)
    assert [r["step"] for r in records] == [s for s, _ in written] == list(range(1, steps + 1))
    for r in records:
        assert r["step_time_s"] == pytest.approx(device_seconds(r["step"]))
        assert r["tokens_per_s"] == pytest.approx(trainer.resolved.tokens_per_step / device_seconds(r["step"]))
        assert r["step_time_s"] != trainer.step_times[r["step"] - 1]  # not the host's
    # Each step written only after the device passed its end (two more events), none before its
    # call ended; the waits all after the last step's end event.
    assert all(seen >= 2 * step + 2 or step == steps for step, seen in written), written
    assert device.waits and set(device.waits) == {2 * steps}
    assert summary["step_time_s"] == pytest.approx(device_seconds(3.5))  # the median of steps 2 to 5
    assert summary["tokens_per_s"] == pytest.approx(trainer.resolved.tokens_per_step / summary["step_time_s"])


@pytest.mark.gpu
@pytest.mark.timeout(60)
def test_on_cuda_a_steps_time_is_its_kernels_not_their_launch_and_reading_it_adds_no_wait():
    import time

    timer = StepTimer(torch.device("cuda", 0))
    torch.cuda.synchronize()
    timer.begin(1)
    began = time.perf_counter()
    torch.cuda._sleep(200_000_000)  # a kernel of 2e8 cycles: about 0.1 s at the H100's clock
    timer.end(1, time.perf_counter() - began)
    assert timer.on_device and not timer.ready(1)  # the kernel still runs: nothing waited for it
    torch.cuda.synchronize()
    assert timer.ready(1) and timer.seconds(1) > 0.03 and timer.seconds(1) > 10 * timer.host[1], (
        timer.seconds(1), timer.host)
