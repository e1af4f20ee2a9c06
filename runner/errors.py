"""The runner's exceptions. Code raises them; only the outermost entry turns them into exit codes."""

__all__ = ["RunnerError", "ConfigError", "RankFailedError", "VerifyError", "NonFiniteLossError"]


class RunnerError(Exception):
    """A failure the user should see as one clear message, without a Python traceback."""


class ConfigError(RunnerError):
    """The configuration cannot run; raised before any rank starts. Names the key, value and fix."""


class RankFailedError(RunnerError):
    """A rank process failed; the message carries its traceback."""


class VerifyError(RunnerError):
    """``verify=true`` found the pipelined gradients differ from the unsplit model's."""


class NonFiniteLossError(RunnerError):
    """The step's loss is NaN or infinite; every rank stops at the same step."""
