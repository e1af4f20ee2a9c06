"""The shape of `runner/` stays readable: short import chains, modules of a screen or two, and
registries that every list of names reads (adding a schedule is one entry plus its config file).
And of `tests/`: shared code in `tests/helpers/` only, one way to run a command line.
In-process, no torch work: a fraction of a second."""

from __future__ import annotations

import ast
from pathlib import Path

from runner.parallel.dp import DP_MODES
from runner.pipeline.registry import SCHEDULES, schedule_names
from runner.pipeline.schedule import default_stages_per_rank, placement, schedule_order

from helpers.config import ROOT

RUNNER = ROOT / "runner"
TESTS = ROOT / "tests"
MAX_CHAIN = 8  # modules in the longest chain of runner-internal imports
MAX_LINES = 400


def _module_name(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


def _runner_imports(path: Path, names: set[str], *, annotations: bool = False) -> set[str]:
    """The runner modules ``path`` imports, at the top or inside functions; those imported under
    ``if TYPE_CHECKING:`` (annotations only, never at run time) only with ``annotations``."""
    found: set[str] = set()

    def visit(statements: list[ast.stmt]) -> None:
        for node in statements:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                visit([*node.body, *node.orelse] if annotations else node.orelse)
                continue
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.update({node.module, *(f"{node.module}.{a.name}" for a in node.names)})
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.stmt):
                    visit([child])
                elif isinstance(child, ast.ExceptHandler):
                    visit(child.body)

    visit(ast.parse(path.read_text()).body)
    # Importing runner.a.b runs runner/a/__init__.py first.
    found |= {".".join(m.split(".")[:i]) for m in found for i in range(2, m.count(".") + 1)}
    return found & names


def _longest_chain(graph: dict[str, set[str]]) -> list[str]:
    memo: dict[str, list[str]] = {}

    def longest(module: str, seen: frozenset[str]) -> list[str]:
        if module not in memo:
            assert module not in seen, f"an import cycle through {module}"
            chains = [longest(dep, seen | {module}) for dep in sorted(graph[module])]
            memo[module] = [module, *max(chains, key=len, default=[])]
        return memo[module]

    return max((longest(m, frozenset()) for m in graph), key=len)


def test_no_import_chain_is_longer_than_8_modules():
    paths = {_module_name(p): p for p in RUNNER.rglob("*.py")}
    graph = {name: _runner_imports(path, set(paths)) - {name} for name, path in paths.items()}
    chain = _longest_chain(graph)
    assert len(chain) <= MAX_CHAIN, " -> ".join(chain)


def _cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle of ``graph`` (its modules in order, the first repeated at the end), or []."""
    done: set[str] = set()

    def walk(module: str, path: list[str]) -> list[str]:
        if module in path:
            return [*path[path.index(module):], module]
        if module in done:
            return []
        for dep in sorted(graph[module]):
            if found := walk(dep, [*path, module]):
                return found
        done.add(module)
        return []

    return next((c for m in sorted(graph) if (c := walk(m, []))), [])


def test_no_import_cycle_even_through_imports_for_annotations():
    # A module that needs another's types for its annotations only depends on it all the same:
    # hooks get a StepContext, not the Trainer, so runner.hooks never imports runner.train.
    paths = {_module_name(p): p for p in RUNNER.rglob("*.py")}
    graph = {name: _runner_imports(path, set(paths), annotations=True) - {name} for name, path in paths.items()}
    assert graph["runner.train"] >= {"runner.hooks", "runner.checkpoint"}  # the graph holds the edges
    assert "runner.faults" not in graph["runner.checkpoint"]  # fault points live behind runner.faults
    assert _cycle(graph) == [], " -> ".join(_cycle(graph))
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]  # the search finds one


def test_no_module_is_longer_than_a_screen_or_two():
    modules = [*RUNNER.rglob("*.py"), *(ROOT / "bench").rglob("*.py")]  # the runner and the benchmarks
    long = {str(p.relative_to(ROOT)): n for p in modules if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, long


def test_the_schedule_registry_agrees_with_torch_and_every_schedule_has_its_config():
    for name, kind in SCHEDULES.items():
        spr = default_stages_per_rank(name)
        order = schedule_order(name, 2, 4, spr)  # what torch declares it runs
        assert any(op.kind in ("I", "W") for ops in order.values() for op in ops) == kind.splits_backward, name
        ran_on = {op.stage: rank for rank, ops in order.items() for op in ops}
        assert ran_on == placement(name, 2, 2 * spr), name
        assert (spr > 1 and ran_on[2 * spr - 1] == 0) == kind.v_shape, name  # V: rank 0 holds the last stage
    configs = {p.stem for p in (ROOT / "conf" / "schedule").glob("*.yaml")}
    assert configs == set(schedule_names())  # one file per schedule, and csv
    assert set(DP_MODES) == {"none", "ddp", "fsdp"}


def _imported_modules(tree: ast.AST) -> set[str]:
    return {a.name for node in ast.walk(tree) if isinstance(node, ast.Import) for a in node.names} | {
        node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}


def test_test_modules_share_code_through_helpers_only_and_run_commands_through_one_helper():
    # Anything in tests/ but helpers/: test modules, conftest.py, stray helper modules.
    local = ({p.stem for p in TESTS.glob("*.py")} | {p.name for p in TESTS.iterdir() if p.is_dir()}) - {"helpers"}
    modules = [*TESTS.glob("test_*.py"), *(TESTS / "helpers").glob("*.py")]
    assert len(modules) > 20  # found them
    for path in modules:
        tree = ast.parse(path.read_text())
        imported = {name.split(".")[0] for name in _imported_modules(tree)}
        assert not imported & local, f"{path.relative_to(ROOT)} imports {imported & local}: move it to tests/helpers/"
        if path.name != "cli.py":  # helpers/cli.py: start_cli, run_cli
            calls = {ast.unparse(node.func) for node in ast.walk(tree) if isinstance(node, ast.Call)}
            started = {c for c in calls if c.startswith("subprocess.") and c != "subprocess.CompletedProcess"}
            assert not started, f"{path.relative_to(ROOT)} calls {started}: use helpers.cli.run_cli / start_cli"
