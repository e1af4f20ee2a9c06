"""The runner's exceptions and exit codes. Code raises the exceptions; only the outermost entry
(``runner.__main__.cli``) turns them into exit codes, with ``exit_code``."""

import reprlib
import signal

__all__ = ["RunnerError", "ConfigError", "RankFailedError", "StalledRankError", "VerifyError",
           "NonFiniteLossError", "CheckpointError", "DoesNotFitError", "EXIT_CONFIG", "EXIT_FAILED", "EXIT_INTERRUPTED",
           "Rejected", "exit_code", "interrupted_exit_code", "shown"]

# Exit codes: distinct from each other and from 1, Python's own status for an uncaught exception
# (a bug in the runner, shown with its traceback).
EXIT_CONFIG = 2  # the configuration cannot run: nothing was started (argparse's usage-error code)
EXIT_FAILED = 3  # the run started and failed: a rank raised, died or stalled, a non-finite step, ...
# Stopped by a signal: the shell's 128 + the signal number, whichever way the signal arrived.
EXIT_INTERRUPTED: dict[int, int] = {signal.SIGINT: 130, signal.SIGTERM: 143}


# A value as a message quotes it: a few elements of each container, the ends of a long string. A
# value read from a file can be huge, or share its parts (YAML aliases) so that its full repr
# would never end.
SHOWN_CHARS = 200
_SHOWN = reprlib.Repr()  # (its keyword arguments are Python 3.12's)
_SHOWN.maxlevel, _SHOWN.maxstring, _SHOWN.maxother, _SHOWN.maxlong = 3, 160, 60, 60  # (a path whole)


def shown(value: object) -> str:
    """``repr(value)``, at most ``SHOWN_CHARS`` long: for a value quoted in an error message."""
    text = _SHOWN.repr(value)
    return text if len(text) <= SHOWN_CHARS else text[:SHOWN_CHARS - 3] + "..."


class RunnerError(Exception):
    """A failure the user should see as one clear message, without a Python traceback."""


class ConfigError(RunnerError):
    """The configuration cannot run; raised before any rank starts. Names the key, value and fix."""


class RankFailedError(RunnerError):
    """A rank process failed; the message carries its traceback."""


class StalledRankError(RankFailedError):
    """A rank made no progress for ``launch.timeout_s``; the message names it and its last action."""


class VerifyError(RunnerError):
    """``verify=true`` found the pipelined gradients differ from the unsplit model's."""


class NonFiniteLossError(RunnerError):
    """The step's loss or gradient norm is NaN or infinite; every rank stops at the same step,
    before the optimizer applies it."""


class CheckpointError(RunnerError):
    """A checkpoint cannot be saved or loaded; the message names the file and the reason."""


class DoesNotFitError(RunnerError):
    """A rehearsal (``rehearse=on``) ran, and a rank's peak exceeds ``rehearse.capacity``: the
    message names each such rank, its peak, the capacity and what to try."""


class Rejected(BaseException):
    """Carries a ``RunnerError`` out of a Hydra callback (there a plain exception would become a
    warning): ``runner.exits.run_entry`` unwraps it."""

    def __init__(self, error: RunnerError):
        super().__init__(str(error))
        self.error = error


def exit_code(error: BaseException) -> int:
    """The process's exit status for an error that ended the run (1 for a bug: not ours)."""
    if isinstance(error, ConfigError):
        return EXIT_CONFIG
    if isinstance(error, RunnerError):
        return EXIT_FAILED
    if isinstance(error, KeyboardInterrupt):
        return EXIT_INTERRUPTED[signal.SIGINT]
    return 1


def interrupted_exit_code(signum: int) -> int:
    return EXIT_INTERRUPTED.get(signum, 128 + signum)
