"""What the command lines (``python -m runner``, ``python -m runner.plan``) share: their arguments
as the user meant them (``~`` in a value), and their end: an error becomes one message and its exit
code (``runner.errors``: 2 the configuration cannot run, 3 it failed, 130/143 stopped); a bug in
the runner keeps Python's traceback and status 1."""

from __future__ import annotations

import difflib
import os
import re
import sys
from collections.abc import Callable

from hydra.errors import HydraException
from omegaconf import DictConfig
from omegaconf.errors import OmegaConfBaseException

from runner.errors import EXIT_CONFIG, Rejected, RunnerError, exit_code

__all__ = ["expand_home", "known_keys", "outcome", "run_entry"]

# An unquoted `~` opening an override's value (or an element of a sweep or list): Hydra's grammar
# rejects it, and shells expand `~` only at the start of a word, not after `key=`.
_HOME = re.compile(r"(?<=[=,\[])~(?=[/,\]]|$)")


def expand_home(args: list[str]) -> list[str]:
    """``model.path=~/models/x`` as the user meant it: ``~`` replaced by the home directory in the
    values of ``key=value`` overrides (``~key`` alone is Hydra's deletion, left as it is)."""
    home = os.path.expanduser("~")
    return [_HOME.sub(lambda _: home, a) if "=" in a and not a.startswith("-") else a for a in args]


def _keys(node: DictConfig, path: str) -> list[str]:
    """The dotted keys of a config node and of the nodes it holds."""
    keys = []
    for key in map(str, node.keys()):
        keys.append(f"{path}{key}")
        child = node._get_node(key)  # without resolving: a MISSING group stays unread
        if isinstance(child, DictConfig):
            keys += _keys(child, f"{path}{key}.")
    return keys


def known_keys() -> list[str]:
    """Every key a command line can set: the schemas' (registered with Hydra's config store) and
    those of each group's options in conf/ (the model, data, loss and schedule configs)."""
    import yaml
    from hydra.core.config_store import ConfigStore

    from runner.compose import SCHEMAS, config_dir, register_configs

    register_configs()
    repo = ConfigStore.instance().repo
    keys = set(_keys(repo["base_config.yaml"].node, ""))
    for name, (group, _) in SCHEMAS.items():  # the schemas the groups' options extend
        keys.update(_keys(repo[f"{name}.yaml"].node, f"{group}."))
    for option in config_dir().glob("*/*.yaml"):
        node = yaml.safe_load(option.read_text()) or {}
        keys.update(f"{option.parent.name}.{k}" for k in node if isinstance(k, str) and k != "defaults")
    # logging.* is the loggers' older spelling, refused (runner.validate): no typo is pointed at it.
    return sorted(k for k in keys if not k.rpartition(".")[2].startswith("_") and k.partition(".")[0] != "logging")


_NOT_A_KEY = re.compile(r"Could not override '([^']+)'\.\nTo append to your config use \+\S+?=(.*)\n")


def _nearest_keys(message: str) -> str:
    """Hydra's message for a key that is not in the config, with the nearest valid keys instead of
    its suggestion to add it with ``+`` (which would only be refused next: ``runner.validate``)."""
    match = _NOT_A_KEY.search(message)
    if match is None:
        return message
    key, value = match.groups()
    keys = known_keys()
    parent, _, leaf = key.rpartition(".")
    if key in keys:  # another option of the group has it (model.dim with model=hf): no typo to point at
        hint = (f"{key} is a key of other {parent} options, not of the one this run selects. Fix: leave {key}={value} "
                f"out, or select a {parent} option that has it.")
        return message.replace(match.group(0), f"Could not override '{key}'.\n") + f"\n{hint}"
    siblings = {k.rpartition(".")[2]: k for k in keys if k.rpartition(".")[0] == parent}  # by their own names
    close = ([siblings[n] for n in difflib.get_close_matches(leaf, siblings, n=3)]
             or difflib.get_close_matches(key, keys, n=3))  # a misspelt group: against every key
    if not close:
        return message
    hint = f"{key} is not a key of the config. Did you mean {' or '.join(close)}? Fix: {close[0]}={value}"
    return message.replace(match.group(0), f"Could not override '{key}'.\n") + f"\n{hint}"


_NO_OPTION = re.compile(r"Could not find '[^']*?([^'/]+)'\n\nAvailable options in '([^']+)':\n((?:\t.*\n?)+)")


def _nearest_option(message: str) -> str:
    """Hydra's message for a group option that does not exist (``schedule=zbvv``), with the
    nearest options and the fix."""
    match = _NO_OPTION.search(message)
    if match is None:
        return message
    option, group = match.group(1), match.group(2)
    options = [line.strip() for line in match.group(3).splitlines() if line.strip()]
    close = difflib.get_close_matches(option, options, n=3, cutoff=0.5)
    fix = (f"Did you mean {' or '.join(f'{group}={c}' for c in close)}? Fix: {group}={close[0]}" if close
           else f"Fix: one of {', '.join(f'{group}={o}' for o in options)}")
    return f"{message}\n{group}={option} is not an option of {group}. {fix}"


_WRONG_TYPE = re.compile(r"Error merging override ([^=\s]+)=(.*)\n(.*)")
# What a key of that type takes, and an example value: by OmegaConf's reason.
_TYPES = {"to Integer": ("an integer", "<an integer>"), "to Float": ("a number", "<a number>"),
          "not a valid bool": ("true or false", "true"), "is not a ListConfig": ("a list", "[{}]")}


def _typed_value(message: str) -> str:
    """OmegaConf's message for a value of the wrong type (``parallel.pp=two``), with what the key takes."""
    match = _WRONG_TYPE.search(message)
    if match is None:
        return message
    key, value, reason = match.groups()
    for marker, (what, example) in _TYPES.items():
        if marker in reason:
            return f"{message}\n{key}={value}: {key} takes {what}. Fix: {key}={example.format(value)}"
    return message


def _run_dir_unwritable(e: BaseException, started: bool) -> bool:
    """Hydra creates the run directory, saves ``.hydra/`` and opens the log before the task
    starts: an ``OSError`` then, or logging's ``ValueError`` wrapping one (an existing directory
    that cannot be written), means the run directory. Not once the task has ``started``."""
    if started:
        return False
    cause = e.__cause__ or e.__context__
    return isinstance(e, OSError) or (isinstance(e, ValueError) and str(e).startswith("Unable to configure")
                                      and isinstance(cause, OSError))


def outcome(e: BaseException, *, started: bool, failed_jobs: str = "") -> tuple[int, str] | None:
    """(exit code, message) for an error that ended the command; None for one to re-raise.
    ``started``: the Hydra task had begun; ``failed_jobs``: a sweep's failed jobs, shown instead
    of the error that ended it."""
    if isinstance(e, (HydraException, OmegaConfBaseException)):  # a typo, a wrong type, an unknown option
        # (Hydra's MissingConfigException is also an OSError: checked first.)
        cause = f"\n{e.__cause__}" if isinstance(e.__cause__, OmegaConfBaseException) else ""
        return EXIT_CONFIG, _typed_value(_nearest_option(_nearest_keys(f"{e}{cause}")))
    if isinstance(e, RunnerError):
        return exit_code(e), failed_jobs or f"error: {e}"
    if isinstance(e, KeyboardInterrupt):  # SIGINT before a launcher's own handler was set
        return exit_code(e), "interrupted"
    if _run_dir_unwritable(e, started):
        error = e if isinstance(e, OSError) else (e.__cause__ or e.__context__)
        return EXIT_CONFIG, (f"error: cannot write the run directory: {error}\n"
                             "Fix: hydra.run.dir=<a writable directory>.")
    return None


def run_entry(entry: Callable[[], object], *, started: Callable[[], bool],
              failed_jobs: Callable[[], str] = lambda: "") -> None:
    """Run a Hydra entry point; an error that ends it exits with its code and one message."""
    # Let our errors reach the handler below instead of Hydra's traceback printer; Hydra's own
    # config errors stay compact.
    os.environ.setdefault("HYDRA_FULL_ERROR", "1")
    try:
        entry()
    except (Exception, KeyboardInterrupt, Rejected) as caught:
        e = caught.error if isinstance(caught, Rejected) else caught  # refused before Hydra's run directory
        jobs = failed_jobs()
        ended = outcome(e, started=started(), failed_jobs=jobs)
        if ended is None:  # a crash: its traceback, after the sweep's list of failed jobs if any
            print(jobs, file=sys.stderr)
            raise
        print(ended[1], file=sys.stderr)
        sys.exit(ended[0])
