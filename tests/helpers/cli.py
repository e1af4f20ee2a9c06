"""The one way tests run a command line in a subprocess, as users do: ``python -m runner ...`` by
default, or another module (``runner.plan``, ``torch.distributed.run``, ``pip``) or program (an
installed console script, a script). ``start_cli`` returns the running process (to run several at
once, or signal one); ``finish`` waits for it; ``run_cli`` does both."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from helpers import tier
from helpers.config import ROOT, TESTS

# Left out of every command's environment: a developer's shell must not change what a test sees
# (a full Hydra traceback, an injected fault, another checkout first on the path).
# A command as a user types it in a shell: not inside torchrun or a SLURM task (a test that wants
# ranks from them passes their variables itself).
CLEARED = ("PYTHONPATH", "HYDRA_FULL_ERROR", "RUNNER_FAULT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
           "MASTER_ADDR", "MASTER_PORT",
           # what runner.ranks.console.quiet_libraries sets unless the user did: the runner's own default is tested
           "HF_DATASETS_DISABLE_PROGRESS_BARS", "HF_HUB_DISABLE_PROGRESS_BARS", "MLFLOW_LOGGING_LEVEL",
           "TRANSFORMERS_NO_ADVISORY_WARNINGS")
SHOWN = 4000  # characters of each stream an assertion shows


def cli_env(extra: dict[str, str] | None = None, *, checkout: bool = True) -> dict[str, str]:
    """This process's environment without ``CLEARED``, plus ``extra``. ``checkout``: this
    checkout's ``runner`` and tests/ (``helpers.models`` targets, ranks importing ``helpers``)
    first on ``PYTHONPATH``; False for an installed package."""
    env = {k: v for k, v in os.environ.items() if k not in CLEARED}
    if checkout:
        env["PYTHONPATH"] = os.pathsep.join([str(TESTS), str(ROOT)])
    env.update(extra or {})
    return env


def start_cli(*args: str, cwd: Path | None = None, module: str = "runner", program: Sequence[str] | None = None,
              env: dict[str, str] | None = None, checkout: bool = True,
              ignore_sigint: bool = False, stdin: bool = False, nice: int = 0) -> subprocess.Popen:
    """Start ``python -m <module> *args`` (or ``*program, *args``) in ``cwd`` with ``cli_env(env)``.
    ``ignore_sigint``: with SIGINT ignored, as ``cmd &`` in a script starts a command. ``stdin``: a
    pipe to write to (``finish(input=...)``), else the test's own. ``nice``: added to its niceness
    (19: it runs on the cycles nothing else wants)."""
    tier.check("runs a command line")
    argv = [*(program or (sys.executable, "-m", module)), *args]

    def prepare() -> None:
        if ignore_sigint:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        if nice:
            os.nice(nice)

    return subprocess.Popen(argv, cwd=cwd, env=cli_env(env, checkout=checkout), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, stdin=subprocess.PIPE if stdin else None, text=True,
                            preexec_fn=prepare if ignore_sigint or nice else None)


def _shown(stdout: str | None, stderr: str | None) -> str:
    return (f"\n--- stdout (last {SHOWN} characters) ---\n{(stdout or '')[-SHOWN:]}"
            f"\n--- stderr (last {SHOWN} characters) ---\n{(stderr or '')[-SHOWN:]}")


def finish(proc: subprocess.Popen, *, timeout: float = 120, check: bool = False,
           input: str | None = None) -> subprocess.CompletedProcess:
    """Wait for ``proc`` and return its exit code and output. Past ``timeout`` it is killed and the
    test fails showing what it printed; ``check``: so does a non-zero exit code."""
    try:
        out, err = proc.communicate(input=input, timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"{' '.join(map(str, proc.args))} still ran after {timeout} s" + _shown(out, err)) \
            from None
    done = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    if check and done.returncode != 0:
        raise AssertionError(f"{' '.join(map(str, proc.args))} exited {done.returncode}" + _shown(out, err))
    return done


def run_cli(*args: str, cwd: Path | None = None, module: str = "runner", program: Sequence[str] | None = None,
            env: dict[str, str] | None = None, checkout: bool = True, timeout: float = 120,
            check: bool = False, input: str | None = None) -> subprocess.CompletedProcess:
    """``start_cli`` then ``finish``: the finished command's exit code, stdout and stderr.
    ``input``: written to its stdin."""
    proc = start_cli(*args, cwd=cwd, module=module, program=program, env=env, checkout=checkout,
                     stdin=input is not None)
    return finish(proc, timeout=timeout, check=check, input=input)
