"""``plan.costs=<file.yaml|json>``: the costs a user measured on their cluster, read and checked
before anything is planned (``runner.plan.from_costs`` plans them).

    pp: 8
    microbatches: 24
    F: 0.018522          # seconds per microbatch: one number for every stage, or a list per stage
    B: 0.018086          # the input-gradient pass (I)
    W: 0.009337          # the weight-gradient pass
    comm_s: 0.000601     # a message between neighbouring ranks
    weight_grad_fraction: 0.4   # M_W / M_B (default 0.4)
    memory_limit: 1f1b   # 1f1b, 2x1f1b, or bytes (then activation_bytes: M_B per stage)
    activation_bytes: 2GB
    tied: {stages: [0, 7], bytes: 525MB}   # optional: a weight tied across stages (embedding and head)

``tied``: the stages holding a tied weight's copies (one stage per rank: their ranks) and the bytes
of the gradient each sums; the sum is priced as every plan prices it (``runner.plan.link``: a ring
all-reduce on ``plan.comm_latency_s`` / ``plan.comm_bandwidth``). Without it no sum is modelled.

Every mistake is a ``ConfigError`` naming the file, the key, the value and a fix.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from runner.config import parse_bytes
from runner.errors import ConfigError, shown
from runner.layout import TiedSpan
from runner.plan.problem import Problem

__all__ = ["GivenCosts", "is_costs_file", "read_costs", "check_fraction", "memory_limit", "RELATIVE_LIMITS",
           "DEFAULT_WEIGHT_GRAD_FRACTION"]

# Memory limits relative to 1F1B's (``Problem.one_f_one_b_memory``), as the zero-bubble paper sets them.
RELATIVE_LIMITS = {"1f1b": 1.0, "2x1f1b": 2.0}

# M_W / M_B: the zero-bubble paper's Table 1 (M_B = 34bsh + 5as^2b, M_W = 32bsh) gives 0.37-0.43 for
# its four models; a user's own figure goes in weight_grad_fraction.
DEFAULT_WEIGHT_GRAD_FRACTION = 0.4
KEYS = ("pp", "microbatches", "F", "B", "W", "comm_s", "weight_grad_fraction", "memory_limit", "activation_bytes",
        "tied")
SUFFIXES = (".yaml", ".yml", ".json")
# A costs file nests 2 levels (a list per stage in the mapping); a deeper one is refused while it is
# read, before the parsers' recursion (Python's limit: a RecursionError) or anything else meets it.
MAX_NESTING = 16


@dataclass(frozen=True)
class GivenCosts:
    path: str
    pp: int
    microbatches: int
    forward_s: list[float]  # per stage (one stage per rank)
    input_backward_s: list[float]  # B in the file: the input-gradient pass
    weight_backward_s: list[float]
    comm_s: float
    weight_grad_fraction: float
    memory_limit: str | float | None  # as given: 1f1b, 2x1f1b, or bytes
    activation_bytes: list[float] | None  # M_B per stage; None: counted in microbatches' activations
    tied: tuple[TiedSpan, ...] = ()  # a weight tied across stages: its stages (= ranks) and gradient bytes

    def costs(self) -> dict[tuple[int, str], float]:
        """(stage, F/B/I/W) -> seconds; a whole backward (B) costs I + W."""
        out = {}
        for s in range(self.pp):
            f, i, w = self.forward_s[s], self.input_backward_s[s], self.weight_backward_s[s]
            out.update({(s, "F"): f, (s, "I"): i, (s, "W"): w, (s, "B"): i + w})
        return out


def is_costs_file(value: object) -> bool:
    """Whether ``plan.costs`` names a costs file rather than a previous run (its directory or
    summary.json)."""
    path = Path(str(value))
    return path.suffix.lower() in SUFFIXES and path.name != "summary.json"


def check_fraction(key: str, value: object) -> float:
    """M_W / M_B: a number from 0 (a W needs nothing an I freed) to 1 (an I frees nothing)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise ConfigError(f"{key}={shown(value)}: the share of a microbatch's activations its weight gradient still "
                          "needs after the input gradient (M_W / M_B) is a number from 0 to 1. Fix: measure it, or use "
                          f"{DEFAULT_WEIGHT_GRAD_FRACTION} (the zero-bubble paper's models: 0.37-0.43).")
    return float(value)


def memory_limit(key: str, value: object, problem: Problem | None = None) -> float | None:
    """A limit as users give it, in the problem's unit: bytes (a number or with a unit: 2GB), or
    ``1f1b`` / ``2x1f1b`` (that many times 1F1B's memory of ``problem``; without one, only
    checked). None stays None."""
    if value is None:
        return None
    relative = RELATIVE_LIMITS.get(str(value).strip().lower())
    if relative is not None:
        return relative * problem.one_f_one_b_memory() if problem is not None else relative
    try:
        return float(parse_bytes(key, value) or 0)
    except ConfigError as e:
        raise ConfigError(f"{str(e).split(' Fix:')[0]} Fix: bytes as a number (2000000000, 2e9) or with a unit (2GB, "
                          "1.5GiB), or 1f1b (p microbatches' activations on every rank, as 1F1B holds on its first) "
                          "or 2x1f1b.") from e


def _bad(path: str, key: str, value: Any, problem: str, fix: str) -> ConfigError:
    return ConfigError(f"plan.costs={path}: {key}={shown(value)} {problem}. Fix: {fix}")


def _count(path: str, data: dict, key: str) -> int:
    value = data.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise _bad(path, key, value, "is not a whole number of at least 1",
                   f"{key}: <count> (e.g. {key}: 8), as an integer.")
    return value


def _per_stage(path: str, data: dict, key: str, pp: int, *, positive: bool, unit: str = "seconds") -> list[float]:
    """One number for every stage, or a list of ``pp`` numbers; finite, >= 0 (> 0 if ``positive``)."""
    value = data.get(key)
    items = value if isinstance(value, list) else [value] * pp
    fix = f"{key}: <{unit}> for every stage, or a list of {pp} (one per stage, pp={pp})."
    if isinstance(value, list) and len(value) != pp:
        raise _bad(path, key, value, f"has {len(value)} entries for {pp} stages", fix)
    out = []
    for item in items:
        number = _number(item) if unit == "seconds" else _bytes(path, key, item)
        if number is None or not math.isfinite(number) or number < 0 or (positive and number == 0):
            raise _bad(path, key, value, f"is not a {'positive' if positive else 'non-negative'} number of {unit}", fix)
        out.append(number)
    return out


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _bytes(path: str, key: str, value: Any) -> float | None:
    try:
        return float(parse_bytes(key, value) or 0) if not isinstance(value, bool) and value is not None else None
    except ConfigError:
        return None


def _tied(path: str, data: dict, pp: int) -> tuple[TiedSpan, ...]:
    """The file's ``tied`` (a mapping of ``stages`` and ``bytes``), or none."""
    value = data.get("tied")
    if value is None:
        return ()
    fix = (f"tied: {{stages: [0, {pp - 1}], bytes: <bytes>}}: the stages holding a tied weight's copies (two or "
           f"more of 0 to {pp - 1}) and the bytes of the gradient each of them sums (fp32: 4 per parameter), or no "
           "tied key for a model without one.")
    if not isinstance(value, dict):
        several = isinstance(value, list) and value and all(isinstance(v, dict) for v in value)
        raise _bad(path, "tied", value, "is not a mapping of stages and bytes" +
                   (" (a file names one tied weight; several on the same stages: one entry, their bytes summed)"
                    if several else ""), fix)
    missing, unknown = sorted({"stages", "bytes"} - set(value)), sorted(set(value) - {"stages", "bytes"}, key=str)
    if missing or unknown:
        raise _bad(path, "tied", value, "; ".join([f"lacks {', '.join(missing)}"] * bool(missing) +
                                                  [f"has unknown key(s) {unknown}"] * bool(unknown)), fix)
    stages = value["stages"]
    if (not isinstance(stages, list) or len(set(map(repr, stages))) < 2
            or any(isinstance(s, bool) or not isinstance(s, int) or not 0 <= s < pp for s in stages)):
        raise _bad(path, "tied.stages", stages, f"is not a list of two or more distinct stages of 0 to {pp - 1}", fix)
    nbytes = _bytes(path, "tied.bytes", value["bytes"])
    if nbytes is None or not math.isfinite(nbytes) or nbytes <= 0:
        raise _bad(path, "tied.bytes", value["bytes"], "is not a positive number of bytes", fix)
    return (TiedSpan(tuple(sorted(set(stages))), round(nbytes)),)


class _Refused(yaml.YAMLError):
    """What ``_load`` refuses in a file that parses: a message naming the problem and the fix."""


def _too_deep(depth: int, line: int) -> _Refused:
    return _Refused(f"nested {depth} levels deep at line {line}, deeper than the {MAX_NESTING} a costs file may "
                    "nest (it needs 2: a list per stage inside the mapping). Fix: one number or a list of numbers "
                    "for each key (docs/planner.md, 'Plans from given costs').")


class _CostsLoader(yaml.SafeLoader):
    """YAML's safe loader without aliases (each one is a reference to a node, so nine levels of
    nine expand a few hundred bytes to 9^9 values) and no deeper than ``MAX_NESTING``."""

    depth = 0

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node | None:
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise _Refused(f"line {event.start_mark.line + 1} has an alias (*{event.anchor}): aliases are refused "
                           "in costs files. Fix: write the value out where the alias stands.")
        self.depth += 1
        if self.depth > MAX_NESTING:
            raise _too_deep(self.depth, self.peek_event().start_mark.line + 1)
        try:
            return super().compose_node(parent, index)
        finally:
            self.depth -= 1


def _json_nesting(text: str) -> None:
    """Refuses JSON nested deeper than ``MAX_NESTING``: brackets counted outside strings."""
    depth = 0
    for token in re.finditer(r'"(?:[^"\\]|\\.)*"|[\[{\]}]', text):
        bracket = token.group()
        depth += 1 if bracket in "[{" else -1 if bracket in "]}" else 0
        if depth > MAX_NESTING:
            raise _too_deep(depth, text.count("\n", 0, token.start()) + 1)


def _parse(text: str, suffix: str) -> object:
    if suffix == ".json":
        _json_nesting(text)
        return json.loads(text)
    return yaml.load(text, Loader=_CostsLoader)  # a safe loader: no aliases, depth bounded


def _load(path: str) -> dict:
    file = Path(path).expanduser()
    try:
        text = file.read_text()
    except OSError as e:
        raise ConfigError(f"plan.costs={path}: cannot read it ({e.strerror or e}). Fix: the path of a .yaml or .json "
                          "file of costs (docs/planner.md, 'Plans from given costs').") from e
    try:
        data = _parse(text, file.suffix.lower())
    except _Refused as e:
        raise ConfigError(f"plan.costs={path}: {e}") from e
    except json.JSONDecodeError as e:
        raise ConfigError(f"plan.costs={path}: not JSON, line {e.lineno}: {e.msg}. Fix: the JSON there.") from e
    except yaml.YAMLError as e:
        where = getattr(e, "problem_mark", None)
        line = f", line {where.line + 1}" if where is not None else ""
        raise ConfigError(f"plan.costs={path}: not YAML{line}: {getattr(e, 'problem', e)}. Fix: the YAML "
                          "there.") from e
    except ValueError as e:  # a number Python will not read (an integer of more than 4300 digits)
        raise ConfigError(f"plan.costs={path}: not {'JSON' if file.suffix.lower() == '.json' else 'YAML'}: "
                          f"{e}. Fix: numbers of a few digits there.") from e
    if not isinstance(data, dict):
        raise ConfigError(f"plan.costs={path}: holds {type(data).__name__}, not a mapping of keys. Fix: a file of "
                          f"keys {', '.join(KEYS)}.")
    return data


def read_costs(path: str, limit: object = None) -> GivenCosts:
    """The file's costs, every key checked; raises ``ConfigError`` naming the first bad one.
    ``limit`` (``plan.memory_limit`` on the command line) replaces the file's memory_limit."""
    data = _load(path)
    unknown = [k for k in data if k not in KEYS]
    if unknown:
        raise _bad(path, unknown[0], data[unknown[0]], "is not a key of a costs file",
                   f"one of {', '.join(KEYS)} (B is the input-gradient pass, W the weight-gradient pass).")
    for key in ("pp", "microbatches", "F", "B", "W"):
        if key not in data:
            raise ConfigError(f"plan.costs={path}: no {key}. Fix: add {key} (pp, microbatches, F, B, W are "
                              "required; seconds per microbatch for F, B and W).")
    pp, m = _count(path, data, "pp"), _count(path, data, "microbatches")
    comm = _number(data.get("comm_s", 0.0))
    if comm is None or not math.isfinite(comm) or comm < 0:
        raise _bad(path, "comm_s", data.get("comm_s"), "is not a non-negative number of seconds",
                   "comm_s: <seconds per message between neighbouring ranks> (0 for none).")
    fraction = data.get("weight_grad_fraction", DEFAULT_WEIGHT_GRAD_FRACTION)
    try:
        check_fraction("weight_grad_fraction", fraction)
    except ConfigError as e:
        raise ConfigError(f"plan.costs={path}: {e}") from e
    key = "plan.memory_limit" if limit is not None else "memory_limit"
    limit = limit if limit is not None else data.get("memory_limit")
    activations = (_per_stage(path, data, "activation_bytes", pp, positive=True, unit="bytes")
                   if data.get("activation_bytes") is not None else None)
    if limit is not None:
        try:
            memory_limit(key, limit)
        except ConfigError as e:
            raise ConfigError(f"plan.costs={path}: {e}") from e
        if str(limit).strip().lower() not in RELATIVE_LIMITS and activations is None:
            raise _bad(path, key, limit, "is in bytes, but the file gives no activation_bytes to count "
                       "them with", "add activation_bytes (the bytes one microbatch's forward keeps on a stage: one "
                       "number or a list per stage), or give memory_limit as 1f1b or 2x1f1b.")
    return GivenCosts(path, pp, m, _per_stage(path, data, "F", pp, positive=True),
                      _per_stage(path, data, "B", pp, positive=True), _per_stage(path, data, "W", pp, positive=False),
                      comm, float(fraction), None if limit is None else str(limit), activations,
                      _tied(path, data, pp))
