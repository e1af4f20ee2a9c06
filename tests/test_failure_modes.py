"""docs/failure-modes.md says what happens: each row whose first cell shows a command
(`runner ...` or `python -m runner.plan ...`, decided before launch) behaves as the row's second
cell says, here, in this process: a row that says "exit 2" (or opens with "error" or "Hydra's
message") must end in exit 2 with every message the row quotes ("..." and `<...>` stand for what
the row leaves out); any other row's command must pass the pre-launch checks. The rows without a
command name what happens at run time; the tests named in the page hold those."""

from __future__ import annotations

import re

import pytest
from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from omegaconf import open_dict

from runner.exits import expand_home, outcome
from runner.plan.planner import check_plan_keys
from runner.validate import validate

from helpers.config import ROOT

PAGE = ROOT / "docs" / "failure-modes.md"
_COMMAND = re.compile(r"`(?:python -m )?(runner(?:\.plan)?) ([^`]*)`")
FILL = "experiment=smoke"


def _cells(line: str) -> list[str]:
    return [c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]


def rows() -> list[tuple[list[tuple[str, str]], str]]:
    """([(module, its arguments) of each command the row shows], what the row says happens) of
    every row showing a command. A ``...`` in a command stands for a small config (``FILL``)."""
    found = []
    for line in PAGE.read_text().splitlines():
        if not line.startswith("|") or set(line) <= set("|- "):
            continue
        cells = _cells(line)
        commands = [(m.group(1), re.sub(r"(?<!\S)\.\.\.(?!\S)", FILL, m.group(2)))
                    for m in _COMMAND.finditer(cells[0])]
        if commands and len(cells) >= 2:
            found.append((commands, cells[1]))
    return found


def fragments(said: str) -> list[str]:
    """The parts of the messages a row quotes, without what it leaves out (``...``, ``<...>``)."""
    parts = []
    for quote in re.findall(r'"([^"]+)"', said):
        parts += [p.strip(" .,") for p in re.split(r"\.\.\.|<[^>]*>", quote)]
    return [p for p in parts if len(p) >= 6]


def refused(said: str) -> bool:
    return "exit 2" in said or said.lower().startswith(("error", "hydra's message"))


def _checked(module: str, args: list[str]) -> tuple[int, str]:
    """(exit code, message) of the pre-launch checks on the command's arguments; (0, "") if they pass."""
    try:
        with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
            cfg = hydra_compose("config", overrides=expand_home(args), return_hydra_config=True)
        with open_dict(cfg):
            del cfg["hydra"]
        if module == "runner.plan":
            check_plan_keys(cfg)
        validate(cfg)
    except Exception as e:  # noqa: BLE001 - whatever the command line would report
        ended = outcome(e, started=False)
        assert ended is not None, f"a crash, not a message: {e!r}"
        return ended
    return 0, ""


ROWS = rows()


def test_the_page_shows_commands_for_its_refusals():
    assert len(ROWS) >= 25 and sum(refused(said) for _, said in ROWS) >= 18  # the extraction found them
    assert all(fragments(said) for _, said in ROWS if refused(said) and '"' in said)


@pytest.mark.parametrize("commands,said", ROWS, ids=[" | ".join(rest for _, rest in c) for c, _ in ROWS])
def test_each_row_with_a_command_does_what_it_says(commands, said, monkeypatch, tmp_path):
    """Each command as the row says (passes, or exit 2 with one of the row's quoted messages);
    each message the row quotes comes from one of its commands."""
    monkeypatch.chdir(tmp_path)  # nothing the pages do not name: no checkout beside the command
    messages = []
    for module, rest in commands:
        code, message = _checked(module, rest.split())
        if not refused(said):
            assert code == 0, f"{rest}: the row says it runs, the checks said: {message}"
            continue
        assert code == 2, f"{rest}: the row says exit 2, the checks passed"
        assert not fragments(said) or any(part in message for part in fragments(said)), (rest, message)
        messages.append(message)
    for part in fragments(said) if messages else ():
        assert any(part in m for m in messages), f"the row quotes {part!r}; the messages are: {messages}"
