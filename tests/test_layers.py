"""The project's imports go down its layers, with no circle anywhere (engine/__init__.py lists engine's layers).

Every import is read with ``ast``, those inside functions too. Top level: msda imports nothing of ours; models and
datasets import msda; engine imports models and datasets; the entry points (train.py, predict.py, export.py) and
bench/ sit on top. Inside engine, a package imports only from packages of a lower layer (and from itself).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from helpers import ROOT

CODE = ("msda", "models", "datasets", "engine", "bench")
ENTRY_POINTS = ("train.py", "predict.py", "export.py")
# What each top-level part may import of ours (besides itself); entry points and bench/ may import anything.
TOP_LEVEL = {"msda": set(), "models": {"msda"}, "datasets": {"msda"}, "engine": {"msda", "models", "datasets"}}
# engine's packages (and its modules outside them) by layer: a lower number is a lower layer.
ENGINE_LAYERS = {
    "errors": 1,
    "reporting": 1,
    "config": 2,
    "runtime": 3,
    "compile": 4,
    "checkpoint": 5,
    "evaluation": 6,
    "train": 7,
    "predict": 8,
    "export": 8,
}
MAX_MODULES_PER_FOLDER = 16


def module_name(path: str) -> str:
    name = path.removesuffix(".py").replace("/", ".")
    return name.removesuffix(".__init__")


def project_sources(root: Path = ROOT) -> dict[str, str]:
    """Relative path -> source of every module of the project but the tests."""
    paths = [p for part in CODE for p in (root / part).rglob("*.py")] + [root / name for name in ENTRY_POINTS]
    return {p.relative_to(root).as_posix(): p.read_text() for p in paths if p.is_file()}


def imports_of(path: str, source: str, modules: dict[str, str]) -> list[tuple[str, int]]:
    """(imported module's path, line) for each import of one of ``modules`` (name -> path) in ``source``."""
    name = module_name(path)
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(source, filename=path)):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(parts + ([node.module] if node.module else []))
            # "from package import module" names a module; "from module import name" names the module
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and modules[target] != path:
                found.append((modules[target], node.lineno))
    return found


def import_graph(sources: dict[str, str]) -> dict[str, list[tuple[str, int]]]:
    modules = {module_name(path): path for path in sources}
    return {path: imports_of(path, source, modules) for path, source in sources.items()}


def part_of(path: str) -> str:
    head = path.split("/")[0]
    return head if head in TOP_LEVEL else "top"


def engine_layer(path: str) -> tuple[str, int]:
    """(package, layer) of an engine module; engine/__init__.py imports nothing and sits below everything."""
    parts = path.removesuffix(".py").split("/")
    package = parts[1] if len(parts) > 1 else "__init__"
    return package, ENGINE_LAYERS.get(package, 0)


def layer_violations(graph: dict[str, list[tuple[str, int]]]) -> list[str]:
    problems = []
    for path, imported in graph.items():
        for target, line in imported:
            here, there = part_of(path), part_of(target)
            if here in TOP_LEVEL and here != there and there not in TOP_LEVEL[here]:
                allowed = ", ".join(sorted(TOP_LEVEL[here])) or "nothing of this project"
                problems.append(f"{path}:{line} imports {target}: {here}/ may import {allowed}")
            elif here == there == "engine":
                (package, layer), (other, other_layer) = engine_layer(path), engine_layer(target)
                if package != other and other_layer >= layer:
                    problems.append(
                        f"{path}:{line} imports {target}: engine/{package} (layer {layer}) may import "
                        f"only packages of lower layers, and engine/{other} is layer {other_layer}"
                    )
    return problems


def import_circles(graph: dict[str, list[tuple[str, int]]]) -> list[list[str]]:
    """Each circle (strongly connected group of two or more modules), as a path through it that closes."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w, _ in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(set(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [circle_through(graph, group) for group in groups]


def circle_through(graph: dict[str, list[tuple[str, int]]], group: set[str]) -> list[str]:
    """A closed path inside ``group``, from its first module back to it."""
    start = min(group)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w, _ in graph[v]:
                if w == start:
                    return paths[v] + [start]
                if w in group and w not in paths:
                    paths[w] = paths[v] + [w]
                    nxt.append(w)
        frontier = nxt
    return sorted(group)


def test_every_import_goes_down_the_layers():
    assert layer_violations(import_graph(project_sources())) == []


def test_no_import_circle_anywhere():
    circles = import_circles(import_graph(project_sources()))
    assert circles == [], "import circles: " + "; ".join(" -> ".join(c) for c in circles)


def test_no_code_folder_holds_more_than_16_modules():
    crowded = {}
    for part in CODE:
        for folder in [ROOT / part, *(p for p in (ROOT / part).rglob("*") if p.is_dir())]:
            modules = [p for p in folder.glob("*.py") if p.name != "__init__.py"]
            if len(modules) > MAX_MODULES_PER_FOLDER:
                crowded[folder.relative_to(ROOT).as_posix()] = len(modules)
    assert crowded == {}


@pytest.mark.parametrize(
    "path, source, expected",
    [
        (
            "models/backbone.py",
            "def f():\n    from engine.runtime.precision import Precision\n",
            "models/backbone.py:2 imports engine/runtime/precision.py: models/ may import msda",
        ),
        (
            "msda/ops.py",
            "import models.backbone\n",
            "msda/ops.py:1 imports models/backbone.py: msda/ may import nothing of this project",
        ),
        (
            "engine/compile/plan.py",
            "from engine.train.build import build_training\n",
            "engine/compile/plan.py:1 imports engine/train/build.py: engine/compile (layer 4) may import only "
            "packages of lower layers, and engine/train is layer 7",
        ),
        (
            "engine/errors.py",
            "from .reporting.progress import Progress\n",
            "engine/errors.py:1 imports engine/reporting/progress.py: engine/errors (layer 1) may import only "
            "packages of lower layers, and engine/reporting is layer 1",
        ),
    ],
)
def test_an_import_against_the_layers_fails_naming_both_files(path, source, expected):
    sources = {**project_sources(), path: source}
    assert expected in layer_violations(import_graph(sources))


def test_an_import_circle_fails_naming_its_files():
    sources = {
        **project_sources(),
        "engine/runtime/rng.py": "from engine.runtime import precision\n",
        "engine/runtime/precision.py": "def f():\n    import engine.runtime.rng\n",
    }
    assert import_circles(import_graph(sources)) == [
        ["engine/runtime/precision.py", "engine/runtime/rng.py", "engine/runtime/precision.py"]
    ]
