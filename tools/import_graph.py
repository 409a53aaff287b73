"""The package-level import graph of keel: edges, cycles, and file/function sizes.

    python tools/import_graph.py            # summary: edges, cycles, size statistics
    python tools/import_graph.py --edges    # every package edge with one example import

A package is the first name under ``keel`` (``keel.train.run`` -> ``train``); top-level
modules (``keel.errors``, ``keel.files``) are their own nodes. Imports inside functions
count: a deferred import is still an arrow between concepts. ``tests/unit/test_layering.py``
holds the layering this prints against the code.
"""

from __future__ import annotations

import argparse
import ast
import sys
from dataclasses import dataclass, field
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src" / "keel"


@dataclass
class Graph:
    """Package -> package import edges, each with one example ``file: import`` line."""

    edges: dict[tuple[str, str], str] = field(default_factory=dict)
    nodes: set[str] = field(default_factory=set)

    def successors(self, node: str) -> set[str]:
        return {b for (a, b) in self.edges if a == node}


def package_of(module: str) -> str:
    """``keel.train.run`` -> ``train``; ``keel.errors`` -> ``errors``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "keel"


def _module_name(path: Path, src: Path) -> str:
    rel = path.relative_to(src.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _is_module(src: Path, name: str) -> bool:
    return (src / name).is_dir() or (src / f"{name}.py").is_file()


def _imported_modules(tree: ast.AST, module: str, is_package: bool, src: Path) -> list[str]:
    base = module.split(".") if is_package else module.split(".")[:-1]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = base[: len(base) - node.level + 1]
                target = ".".join(anchor + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.append(target)
            # `from keel import train` names a package, not an attribute
            if target == "keel":
                found += [f"keel.{a.name}" for a in node.names if _is_module(src, a.name)]
    return [name for name in found if name == "keel" or name.startswith("keel.")]


def build_graph(src: Path = SRC) -> Graph:
    """Every package-level edge in ``src`` (a ``keel`` source folder)."""
    graph = Graph()
    for path in sorted(src.rglob("*.py")):
        module = _module_name(path, src)
        source = package_of(module)
        graph.nodes.add(source)
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for target_module in _imported_modules(tree, module, path.name == "__init__.py", src):
            target = package_of(target_module)
            if target in ("keel", source):
                continue
            example = f"{path.relative_to(src.parent)} imports {target_module}"
            graph.edges.setdefault((source, target), example)
    return graph


def package_cycles(graph: Graph) -> list[tuple[str, str]]:
    """Pairs of packages that reach each other (each pair once, sorted)."""
    reach = {node: reachable(graph, node) for node in graph.nodes}
    return sorted(
        (a, b) for a in graph.nodes for b in reach[a] if a < b and a in reach.get(b, set())
    )


def reachable(graph: Graph, start: str) -> set[str]:
    """Every package `start` imports, directly or through others."""
    seen: set[str] = set()
    todo = [start]
    while todo:
        for nxt in graph.successors(todo.pop()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def size_statistics(src: Path = SRC) -> dict[str, int]:
    """Counts of files and functions, and how many exceed 500 and 60 lines."""
    functions = []
    files = []
    for path in sorted(src.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        files.append(len(text.splitlines()))
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                functions.append(node.end_lineno - node.lineno + 1)
    return {
        "files": len(files),
        "lines": sum(files),
        "files_over_500_lines": sum(n > 500 for n in files),
        "largest_file_lines": max(files),
        "functions": len(functions),
        "functions_over_60_lines": sum(n > 60 for n in functions),
        "longest_function_lines": max(functions),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--edges", action="store_true", help="list every package edge")
    parser.add_argument("--src", type=Path, default=SRC, help="a keel source folder")
    args = parser.parse_args(argv)
    graph = build_graph(args.src)
    cycles = package_cycles(graph)
    print(f"packages: {len(graph.nodes)}  package edges: {len(graph.edges)}")
    print(f"cycles ({len(cycles)}): " + (", ".join(f"{a}<->{b}" for a, b in cycles) or "none"))
    for key, value in size_statistics(args.src).items():
        print(f"{key}: {value}")
    if args.edges:
        for (a, b), example in sorted(graph.edges.items()):
            print(f"  {a} -> {b}    ({example})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
