"""Where a run's numbers come from: the runner, torch, Hydra and Python versions, the commit of a
checkout, the host and the devices. ``runner --version`` prints the versions; ``summary.json``
records all of it. Imports no torch (versions come from the installed distributions)."""

from __future__ import annotations

import importlib.metadata
import platform
import socket
import subprocess
from pathlib import Path

import runner

__all__ = ["versions", "git_commit", "cpu_name", "device_name", "provenance"]


def _distribution_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def versions() -> dict[str, str | None]:
    return {"runner": runner.__version__, "torch": _distribution_version("torch"),
            "hydra": _distribution_version("hydra-core"), "python": platform.python_version()}


def git_commit() -> str | None:
    """The commit of the checkout the runner's code comes from (``+dirty`` with uncommitted
    changes), or None for an installed package. Only the package's own repository counts, not
    one that happens to enclose site-packages."""
    root = Path(runner.__file__).resolve().parent.parent
    if not (root / ".git").exists():
        return None
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10)
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):  # no git on this host
        return None
    if head.returncode != 0:
        return None
    return head.stdout.strip() + ("+dirty" if dirty.returncode == 0 and dirty.stdout.strip() else "")


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_name(device) -> str:
    """A ``torch.device``'s model name: the GPU's, or the CPU's."""
    if device.type == "cuda":
        import torch

        return torch.cuda.get_device_name(device)
    return f"CPU ({cpu_name()})"


def provenance() -> dict[str, str | None]:
    v = versions()
    return {"runner_version": v["runner"], "git_commit": git_commit(), "host": socket.gethostname(),
            "torch_version": v["torch"], "hydra_version": v["hydra"], "python_version": v["python"]}
