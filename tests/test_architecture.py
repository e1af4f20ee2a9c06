"""The shape of `runner/` stays readable: packages that mirror the config tree, imports between them
by the rules of one table (the layers below), functions of a screen, and registries that every list
of names reads (adding a schedule is one entry plus its config file).
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

# Which part of runner/ may import which: the one statement of the rule. A unit is a package
# (runner/<name>/) or a top-level module; it may import the units of the layers below its own, never
# one of its own layer or above (within a package, its modules import each other freely; no cycle).
# Lowest first.
LAYERS: list[tuple[str, ...]] = [
    ("runner", "errors"),  # the version; the exception hierarchy
    ("options", "config_nodes", "losses", "_torch"),  # enums of values; torch's private internals
    ("config",),  # the run-wide schemas (train, eval, plan)
    ("ranks", "optim"),  # processes, the process group, the console; AdamW
    ("models", "rundir"),  # model families, pipeline units, the split; a run directory's lock and guard
    # datasets (never parallel: a batch is a function of seed, split and step); degrees, mesh, tp, dp
    ("data", "parallel"),
    ("layout", "compose"),  # the ResolvedRun; the config tree assembled
    ("hooks", "checkpoint", "pipeline"),  # what a step offers hooks; saving, loading; schedules and the step
    ("outputs", "verify", "faults", "callbacks"),  # what a run writes (never imported by pipeline); the hooks
    ("validate",),  # the checks before launch -> ResolvedRun
    ("train",),  # the Trainer
    ("launch", "exits"),  # the ranks started; how a command line ends (a typo's nearest keys: compose's)
    ("plan", "export", "study", "generate"),  # applications of the run: nothing below imports them
    ("rehearse",),  # the run rehearsed rank by rank: the planner's device table and FLOP counts
    # the command line and the Python API (runner.run); shims at old paths (issue #34)
    ("__main__", "api", "loggers", "report", "hf"),
]
# A package's schema (runner/<package>/config.py) may be imported from any layer: the config tree
# (compose) and the ResolvedRun (layout) need every group's. It imports only the lowest layers and its
# own package's registries (test_schemas_import_only_the_base_and_their_own_registries).
SCHEMA = "config"
# Imports that break the layering on purpose, each with its reason: (importer, imported) -> why.
EXCEPTIONS: dict[tuple[str, str], str] = {
    # (an annotation only: the launcher passes them)
    ("ranks", "parallel"): "the watchdog's table holds each rank's Coords",
    # (the registry imports nothing: names and closed forms)
    ("config", "pipeline"): "plan.schedules' choices are the schedule registry's names",
}


def _unit(module: str) -> str:
    """``runner.parallel.tp`` -> ``parallel``; ``runner.validate`` -> ``validate``; ``runner`` -> ``runner``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def layering_violations(graph: dict[str, set[str]], layers=None, exceptions=None) -> list[str]:
    """Every import of ``graph`` (module -> the runner modules it imports) that the table forbids."""
    layers = LAYERS if layers is None else layers
    exceptions = EXCEPTIONS if exceptions is None else exceptions
    level = {unit: i for i, units in enumerate(layers) for unit in units}
    # A package's face (its __init__, run by importing any of its modules) imports nothing: the module
    # imported is what is judged.
    names = set(graph).union(*graph.values())
    faces = {m for m in names if any(other.startswith(m + ".") for other in names)}
    found = []
    for module, deps in sorted(graph.items()):
        for dep in sorted(deps - faces):
            a, b = _unit(module), _unit(dep)
            if a == b or (a, b) in exceptions or dep.rsplit(".", 1)[-1] == SCHEMA and dep.count(".") == 2:
                continue
            if a not in level or b not in level:
                found.append(f"{module} -> {dep}: {a if a not in level else b} is in no layer of LAYERS")
            elif level[b] >= level[a]:
                found.append(f"{module} -> {dep}: {a} (layer {level[a]}) may not import {b} (layer {level[b]})")
    return found


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


def _graph(*, annotations: bool) -> dict[str, set[str]]:
    paths = {_module_name(p): p for p in RUNNER.rglob("*.py")}
    return {name: _runner_imports(path, set(paths), annotations=annotations) - {name} for name, path in paths.items()}


def test_imports_between_packages_follow_the_table_of_layers():
    # Counting imports for annotations only: a module needs what it names.
    violations = layering_violations(_graph(annotations=True))
    assert not violations, "\n".join(violations)
    assert set(EXCEPTIONS) <= {(_unit(m), _unit(d)) for m, deps in _graph(annotations=True).items() for d in deps}


def test_the_layering_check_fails_on_a_planted_violation():
    graph = _graph(annotations=True)
    graph["runner.pipeline.step"] |= {"runner.outputs.metrics"}  # pipeline never imports outputs
    graph["runner.data.tokens"] |= {"runner.parallel.mesh"}  # data never imports parallel
    graph["runner.models.split"] |= {"runner.plan.planner"}  # nothing below plan imports plan
    graph["runner.newthing"] = {"runner.errors"}  # a new unit belongs in a layer
    assert layering_violations(graph) == [
        "runner.data.tokens -> runner.parallel.mesh: data (layer 5) may not import parallel (layer 5)",
        "runner.models.split -> runner.plan.planner: models (layer 4) may not import plan (layer 12)",
        "runner.newthing -> runner.errors: newthing is in no layer of LAYERS",
        "runner.pipeline.step -> runner.outputs.metrics: pipeline (layer 7) may not import outputs (layer 8)",
    ]
    # a named exception lets exactly its pair through; a schema is importable from anywhere
    assert layering_violations({"runner.data.tokens": {"runner.parallel.mesh"}},
                               exceptions={("data", "parallel"): "why"}) == []
    assert layering_violations({"runner.ranks.env": {"runner.parallel", "runner.parallel.config"},
                                "runner.parallel.config": set()}) == []


def test_schemas_import_only_the_base_and_their_own_registries():
    base = {unit for units in LAYERS[:3] for unit in units}
    for module, deps in _graph(annotations=True).items():
        if module.rsplit(".", 1)[-1] == SCHEMA and module.count(".") == 2:
            package = module.rsplit(".", 1)[0]
            heavy = {d for d in deps if _unit(d) not in base and not d.startswith(package)}
            assert not heavy, f"{module} imports {heavy}"


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
    assert graph["runner.train"] >= {"runner.hooks", "runner.checkpoint.checkpointer"}  # the graph holds the edges
    assert "runner.faults" not in graph["runner.checkpoint.checkpointer"]  # fault points live behind runner.faults
    assert _cycle(graph) == [], " -> ".join(_cycle(graph))
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]  # the search finds one


MAX_FUNCTION_LINES = 60  # a screen: a longer function is named steps waiting to be named
# Functions over the limit (none today; an entry that fits fails the test, so it is struck off).
LONG_FUNCTIONS: set[str] = set()


def test_no_function_is_longer_than_a_screen():
    # Modules are as long as their subject needs (files were once split to meet a line cap: merged back).
    long = set()
    for path in [*RUNNER.rglob("*.py"), *(ROOT / "bench").rglob("*.py")]:  # the runner and the benchmarks
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES:
                    long.add(f"{path.relative_to(ROOT)}:{node.name}")
    assert long == LONG_FUNCTIONS, (long - LONG_FUNCTIONS, LONG_FUNCTIONS - long)


def _private(names: list[str]) -> bool:
    return any(n.startswith("_") and not (n.startswith("__") and n.endswith("__")) for n in names)


def private_torch_uses(source: str) -> list[str]:
    """Each use of torch's private internals in ``source`` (by line): an import of a torch module
    through a private name (``torch._inductor``, ``torch.utils._pytree``) or of a private name from
    one (``_Action``), and an attribute path through a private name from ``torch`` or a torch module
    imported under another name (``torch.ops.aten._unsafe_view``, ``dist._functional_collectives``)."""
    tree = ast.parse(source)
    roots = {"torch"} | {a.asname for node in ast.walk(tree) if isinstance(node, ast.Import) for a in node.names
                         if a.asname and a.name.split(".")[0] == "torch"}
    found: dict[int, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            private = _private(node.module.split(".")) or _private([a.name for a in node.names])
        elif isinstance(node, ast.Import):
            private = any(a.name.split(".")[0] == "torch" and _private(a.name.split(".")) for a in node.names)
        elif isinstance(node, ast.Attribute):
            chain, base = [], node
            while isinstance(base, ast.Attribute):
                chain.append(base.attr)
                base = base.value
            private = isinstance(base, ast.Name) and base.id in roots and _private(chain)
        else:
            continue
        if private and node.lineno not in found:  # (an attribute path's outermost node first)
            found[node.lineno] = f"{node.lineno}: {ast.unparse(node)}"
    return [found[line] for line in sorted(found)]


def test_torchs_private_internals_are_used_in_runner_torch_only():
    # A torch upgrade touches runner/_torch/ only: e.g. the datasheet table plan.target reads
    # (runner/_torch/datasheet.py), not runner/plan/roofline.py.
    checked = [p for p in RUNNER.rglob("*.py") if p.relative_to(RUNNER).parts[0] != "_torch"]
    assert RUNNER / "plan" / "roofline.py" in checked and RUNNER / "plan" / "target.py" in checked
    found = [f"{p.relative_to(ROOT)}:{use}" for p in checked for use in private_torch_uses(p.read_text())]
    assert not found, "\n".join(found) + "\nFix: move these into a module of runner/_torch/."
    # The rule sees what roofline.py held before the datasheet moved, and lets public names through.
    before = ("import torch\nimport torch.distributed as dist\nfrom torch.utils._pytree import tree_flatten\n"
              "from torch.utils.flop_counter import flop_registry\n"
              "from torch.distributed.pipelining.schedules import _Action, get_schedule_class\n"
              "def known():\n    from torch._inductor.analysis.device_info import _device_mapping\n"
              "VIEW = {torch.ops.aten._unsafe_view.default, torch.ops.aten.view.default}\n"
              "dist._functional_collectives.all_reduce\nimport torch._dynamo\n"
              "print(torch.__version__, torch.__config__.parallel_info(), dist.get_rank(), func._overloadpacket)\n")
    assert private_torch_uses(before) == [
        "3: from torch.utils._pytree import tree_flatten",
        "5: from torch.distributed.pipelining.schedules import _Action, get_schedule_class",
        "7: from torch._inductor.analysis.device_info import _device_mapping",
        "8: torch.ops.aten._unsafe_view.default",
        "9: dist._functional_collectives.all_reduce",
        "10: import torch._dynamo",
    ]


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


def test_the_module_map_in_docs_names_every_module_and_no_other():
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text[text.index("## Module map"):text.index("## Where to add things")]
    mapped = [line.split("`")[1] for line in section.splitlines() if line.startswith("| `")]
    modules = sorted(str(p.relative_to(RUNNER)) for p in RUNNER.rglob("*.py"))
    assert len(mapped) == len(set(mapped)), "a module listed twice"
    assert set(mapped) == set(modules), {"missing": set(modules) - set(mapped), "stale": set(mapped) - set(modules)}
