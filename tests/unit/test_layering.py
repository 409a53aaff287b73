"""The package layering of docs/STYLE.md, checked against the code's imports.

cli -> train -> {stages, models, data, losses, distributed, checkpoint, plan}; config (with
the stage registry it asks) and the single-file modules at the bottom. The graph comes from tools/import_graph.py (imports
inside functions count: a deferred import is still an arrow between concepts). Each rule
holds whether or not keel/checkpoint, keel/export and keel/stages exist.
"""

from __future__ import annotations

import ast
import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "keel"

# keel's single-file modules below every package: they may import only one another.
BOTTOM = {"console", "errors", "extras", "faults", "files", "hub_cache", "owner", "signals"}


def _import_graph_tool():
    spec = importlib.util.spec_from_file_location("import_graph", ROOT / "tools/import_graph.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


TOOL = _import_graph_tool()


@pytest.fixture(scope="module")
def graph():
    return TOOL.build_graph(SRC)


def _imports(graph, source: str) -> dict[str, str]:
    """The packages `source` imports, each with one example import line."""
    return {b: example for (a, b), example in graph.edges.items() if a == source}


def _importers(graph, target: str) -> dict[str, str]:
    """The packages that import `target`, each with one example import line."""
    return {a: example for (a, b), example in graph.edges.items() if b == target}


def test_no_package_cycles(graph):
    cycles = TOOL.package_cycles(graph)
    examples = {pair: graph.edges.get(pair) for a, b in cycles for pair in ((a, b), (b, a))}
    assert cycles == [], f"packages that reach each other: {cycles}; direct edges: {examples}"


@pytest.mark.parametrize("top, allowed", [("cli", {"__main__"}), ("train", {"cli"})])
def test_nothing_imports_the_top(graph, top, allowed):
    wrong = {a: ex for a, ex in _importers(graph, top).items() if a not in allowed}
    assert not wrong, f"only {sorted(allowed)} may import keel.{top}: {wrong}"


def test_distributed_imports_no_caller(graph):
    callers = {"train", "data", "cli", "models"}
    wrong = {b: ex for b, ex in _imports(graph, "distributed").items() if b in callers}
    assert not wrong, f"keel.distributed is applied to models by train, never the reverse: {wrong}"


def test_config_reaches_only_the_bottom_and_the_stage_registry(graph):
    # Validation asks the stage registry which stages exist and what each reads (issue 21:
    # one record per stage that every package asks); the registry in turn may name only its
    # loss functions. Nothing else is below config.
    below = BOTTOM | {"stages", "losses"}
    wrong = {b: ex for b, ex in _imports(graph, "config").items() if b not in BOTTOM | {"stages"}}
    assert not wrong, f"keel.config must load without anything above it: {wrong}"
    reached = TOOL.reachable(graph, "config") - below
    assert not reached, f"keel.config reaches {sorted(reached)} through stages or losses"


def test_the_bottom_imports_only_the_bottom(graph):
    wrong = {
        f"{a} -> {b}": ex for (a, b), ex in graph.edges.items() if a in BOTTOM and b not in BOTTOM
    }
    assert not wrong, f"single-file modules sit below every package: {wrong}"


@pytest.mark.parametrize("consumer", ["infer", "export"])
def test_consumers_never_import_train(graph, consumer):
    # a consumer of trained folders (absent packages import nothing: the rule holds)
    example = graph.edges.get((consumer, "train"))
    assert example is None, f"keel.{consumer} must not import keel.train: {example}"


def test_rewards_import_no_caller(graph):
    # keel.rewards scores completions for the rollout source (train); it reads rows from
    # nobody and must load without the trainer, the data pipeline or the CLI
    callers = {"train", "data", "cli"}
    wrong = {b: ex for b, ex in _imports(graph, "rewards").items() if b in callers}
    assert not wrong, f"keel.rewards is called by train, never the reverse: {wrong}"
    assert "rewards" not in TOOL.reachable(graph, "config"), "config must not load user rewards"


def _torch_distributed_imports(path: Path) -> list[str]:
    """`file:line` of each import of torch.distributed in `path` (comments do not count)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            module = node.module or ""
            names = [f"{module}.{alias.name}" for alias in node.names] + [module]
        else:
            continue
        if any(
            name == "torch.distributed" or name.startswith("torch.distributed.") for name in names
        ):
            found.append(f"{path.parent.name}/{path.name}:{node.lineno}")
    return found


def test_models_has_no_torch_distributed():
    found = [
        hit
        for path in sorted((SRC / "models").rglob("*.py"))
        for hit in _torch_distributed_imports(path)
    ]
    assert not found, f"parallelism is applied to models by keel.distributed: {found}"


def test_the_rules_see_a_bad_edge(tmp_path):
    """The checks above read real imports: a planted back-edge is found (cycle included)."""
    for package, text in {
        "config": "from keel.plan.devices import GIB\n",
        "plan": "import keel.config\n",
    }.items():
        (tmp_path / "keel" / package).mkdir(parents=True)
        (tmp_path / "keel" / package / "__init__.py").write_text(text)
    (tmp_path / "keel" / "models").mkdir()
    (tmp_path / "keel" / "models" / "load.py").write_text("from torch import distributed\n")
    planted = TOOL.build_graph(tmp_path / "keel")
    assert ("config", "plan") in planted.edges and "config" not in BOTTOM
    assert TOOL.package_cycles(planted) == [("config", "plan")]
    assert _torch_distributed_imports(tmp_path / "keel" / "models" / "load.py")
