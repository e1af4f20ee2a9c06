"""The machine a benchmark runs on: what it is, waiting until it is quiet, and watching whether
other processes shared it while a run ran."""

from __future__ import annotations

import os
import platform
import statistics
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

__all__ = ["device_name", "machine", "wait_for_quiet", "LoadMonitor"]


def device_name(device: str) -> str:
    import torch

    return f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}" if device == "cuda" else "CPU"


def machine(device: str = "cpu") -> dict[str, Any]:
    import torch

    from runner.outputs.provenance import cpu_name

    return {"arch": platform.machine(), "cpu": cpu_name(), "cores": os.cpu_count(), "platform": platform.platform(),
            "python": platform.python_version(), "torch": torch.__version__, "device": device,
            "device_name": device_name(device)}


def _pytest_running() -> bool:
    try:
        return subprocess.run(["pgrep", "-f", "pytest"], capture_output=True).returncode == 0
    except FileNotFoundError:
        return False


def wait_for_quiet(label: str, max_wait_s: float, poll_s: float = 30.0, threshold: float = 1.0) -> dict[str, Any]:
    """Wait until the 1-minute load average is <= threshold and no pytest runs (or max_wait_s)."""
    start = time.time()
    while True:
        load1, tests = os.getloadavg()[0], _pytest_running()
        waited = time.time() - start
        if (load1 <= threshold and not tests) or waited >= max_wait_s:
            quiet = load1 <= threshold and not tests
            if not quiet:
                print(f"[bench] {label}: still busy after {waited:.0f} s (load {load1:.2f}, pytest {tests}); "
                      "running anyway", flush=True)
            return {"label": label, "waited_s": round(waited, 1), "quiet": quiet, "load1": load1, "pytest": tests}
        print(f"[bench] {label}: waiting for a quiet machine (load {load1:.2f}, pytest running: {tests})", flush=True)
        time.sleep(poll_s)


def _cpu_busy_s() -> float | None:
    """Seconds of busy CPU time on the whole machine since boot (/proc/stat), or None."""
    try:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _tree_cpu_s(root: int) -> float | None:
    """CPU seconds of a process tree: each live process's own and its reaped children's time
    (/proc/<pid>/stat utime, stime, cutime, cstime), so time moves, and is kept, from a child
    to its parent as the child is reaped. None off Linux."""
    clock = os.sysconf("SC_CLK_TCK")
    children: dict[int, list[int]] = {}
    times: dict[int, float] = {}
    try:
        entries = [e for e in os.listdir("/proc") if e.isdigit()]
    except OSError:
        return None
    for entry in entries:
        try:
            rest = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        pid = int(entry)
        children.setdefault(int(rest[1]), []).append(pid)
        times[pid] = sum(int(v) for v in rest[11:15]) / clock
    total, todo = 0.0, [root]
    while todo:
        pid = todo.pop()
        total += times.get(pid, 0.0)
        todo += children.get(pid, [])
    return total


class LoadMonitor:
    """Samples, every ``interval_s`` during a section: whether a pytest runs, and the share of the
    machine's CPU that processes outside this script's tree used since the last sample (busy CPU
    time from /proc/stat minus this tree's). ``loaded(start, end)`` says whether a run in that
    window shared the machine."""

    def __init__(self, interval_s: float = 10.0, threshold: float = 0.1):
        self.interval_s, self.threshold = interval_s, threshold
        self.samples: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _read(self) -> tuple[float, float | None, float | None]:
        return time.time(), _cpu_busy_s(), _tree_cpu_s(os.getpid())

    def sample(self) -> None:
        with self._lock:
            now, busy, own = self._read()
            t0, busy0, own0 = self._last
            foreign = None
            if None not in (busy, own, busy0, own0) and now > t0:
                foreign = max(0.0, (busy - busy0) - (own - own0)) / ((now - t0) * (os.cpu_count() or 1))
            self.samples.append({"t0": t0, "t": now, "foreign": None if foreign is None else round(foreign, 3),
                                 "pytest": _pytest_running()})
            self._last = (now, busy, own)

    def _watch(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def loaded(self, start: float | None, end: float | None) -> bool | None:
        """Whether another process used the machine while a run went from ``start`` to ``end``."""
        if start is None or end is None:
            return None
        self.sample()  # close the interval the run ended in
        with self._lock:
            over = [s for s in self.samples if s["t"] > start and s["t0"] < end]
        if not over:
            return None
        shares = [s["foreign"] for s in over if s["foreign"] is not None]
        return any(s["pytest"] for s in over) or (bool(shares) and statistics.fmean(shares) > self.threshold)

    def __enter__(self) -> LoadMonitor:
        self.start = time.time()
        self._last = self._first = self._read()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()
        t0, busy0, own0 = self._first
        t1, busy1, own1 = self._last
        share = None
        if None not in (busy0, own0, busy1, own1) and t1 > t0:
            share = max(0.0, (busy1 - busy0) - (own1 - own0)) / ((t1 - t0) * (os.cpu_count() or 1))
        self.report = {"pytest_samples": sum(s["pytest"] for s in self.samples), "samples": len(self.samples),
                       "loaded_samples": sum(bool(s["pytest"] or (s["foreign"] or 0) > self.threshold)
                                             for s in self.samples),
                       "foreign_cpu_share": None if share is None else round(share, 3)}
