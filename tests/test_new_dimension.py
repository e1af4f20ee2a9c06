"""A parallel dimension is added where docs/architecture.md says ("Adding a parallel dimension"):
the owner (``runner/parallel/dims.py``: a field and its place in ``ORDER``) and its config key
(``runner/parallel/config.py``). A fourth degree, context parallelism (``cp``), is added here to a
copy of the owner alone, and every part of the run that reads degrees takes it: coordinates and
groups, the product check, the check of each degree, the SLURM task count, the summary. Nothing
else in runner/ names the degrees by hand. In-process, no torch work."""

from __future__ import annotations

import ast
import re
import sys
import types

import pytest
from omegaconf import OmegaConf

import runner.outputs.metrics  # noqa: F401  (imported before the fixture swaps the owner in every
import runner.validate  # noqa: F401  module holding it: alone, this test would import them after)
from runner.errors import ConfigError
from runner.parallel.dims import ParallelDims

from helpers.config import ROOT, TINY, compose

STEP_ONE = {"runner/parallel/dims.py", "runner/parallel/config.py"}  # what docs/architecture.md lists


def _with_cp() -> types.ModuleType:
    """runner/parallel/dims.py as someone adding context parallelism would edit it."""
    source = (ROOT / "runner" / "parallel" / "dims.py").read_text()
    edited = source.replace("    dp: int  # replicas of the whole pipeline\n",
                            "    dp: int  # replicas of the whole pipeline\n    cp: int = 1  # context shards\n")
    edited = edited.replace('ORDER: ClassVar[tuple[str, ...]] = ("pp", "dp", "tp")',
                            'ORDER: ClassVar[tuple[str, ...]] = ("pp", "dp", "cp", "tp")')
    assert '"cp"' in edited and "cp: int = 1" in edited, "dims.py changed: update the edit above"
    module = types.ModuleType("dims_with_cp")
    sys.modules["dims_with_cp"] = module  # dataclasses look their module up
    exec(compile(edited, "dims_with_cp.py", "exec"), module.__dict__)
    return module


@pytest.fixture
def cp_dims(monkeypatch):
    """The edited owner, seen by every module that imported the owner's class."""
    fake = _with_cp().ParallelDims
    for module in list(sys.modules.values()):
        if module is not None and getattr(module, "ParallelDims", None) is ParallelDims:
            monkeypatch.setattr(module, "ParallelDims", fake)
    yield fake
    sys.modules.pop("dims_with_cp", None)


def test_a_fourth_degree_in_the_owner_is_counted_placed_and_checked_everywhere(cp_dims):
    dims = cp_dims.from_config({"pp": 2, "dp": 1, "cp": 2, "tp": 2, "dp_mode": "none"})
    assert dims.world_size == 8 and dims.stage_ranks == 4
    assert list(dims.mesh_dims) == ["pp", "dp", "cp", "tp"]
    assert dims.coords(5).asdict() == {"pp": 1, "dp": 0, "cp": 0, "tp": 1} and dims.coords(5).cp == 0
    assert dims.ranks_of("cp", 5) == [5, 7] and dims.groups_of("cp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert [dims.rank_of(dims.coords(r)) for r in range(8)] == list(range(8))
    with pytest.raises(ConfigError, match=r"parallel\.pp=2 x parallel\.dp=1 x parallel\.cp=2 x parallel\.tp=2"):
        dims.check(4)

    cfg = OmegaConf.create(OmegaConf.to_container(compose(*TINY), resolve=True))  # the schema with cp added
    cfg.parallel.cp = 0
    from runner.validate import _check_numbers

    with pytest.raises(ConfigError, match=r"parallel\.cp=0 must be at least 1"):
        _check_numbers(cfg)
    tasks = OmegaConf.create({"parallel": {"pp": 2, "dp": 1, "cp": 3, "dp_mode": "none"},
                              "tasks": "${world_size:${parallel}}"})
    assert tasks.tasks == 6  # the SLURM launcher's count asks the owner

    from runner.outputs.metrics import format_table

    summary = {"schedule": "1f1b", "pp": 2, "dp": 1, "cp": 2, "tp": 1, "num_stages": 2, "microbatches": 4,
               "losses": [2.0, 1.0], "final_loss": 1.0, "steps": 2, "step_time_s": 0.1, "tokens_per_s": 10.0,
               "startup_s": 1.0, "peak_mem_bytes": [0, 0],
               "bubble": {"mean": 0.2, "theoretical": 0.2, "theoretical_source": "closed form"}}
    assert "(pp=2, cp=2, stages=2" in format_table(summary)


def _degree_lists(path) -> list[str]:
    """Literal lists of two or more degree names (("pp", "dp", "tp")), written by hand."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            names = [e.value for e in node.elts if isinstance(e, ast.Constant) and e.value in ParallelDims.ORDER]
            if len(names) >= 2:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {names}")
    return found


def test_only_the_owner_lists_the_degrees_and_the_docs_name_the_files_a_dimension_takes():
    lists = [hit for p in sorted((ROOT / "runner").rglob("*.py")) for hit in _degree_lists(p)]
    assert all(hit.startswith("runner/parallel/dims.py") for hit in lists), lists
    assert "Coords(**" not in (ROOT / "runner" / "parallel" / "mesh.py").read_text()
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text[text.index("## Adding a parallel dimension"):]
    section = section[:section.index("\n**A logger**")]
    step_one = section[section.index("\n1. "):section.index("\n2. ")]
    assert set(re.findall(r"`(runner/[\w/]+\.py)`", step_one)) == STEP_ONE
    for path in re.findall(r"`(runner/[\w/]+\.py)`", section):
        assert (ROOT / path).is_file(), path
