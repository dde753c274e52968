"""The engine's layers: every import points down (or within its own layer), no engine modules import each
other in a loop, and an import inside a function is a deliberate, commented exception.

The layers, lowest first, are :data:`LAYERS` (``docs/architecture.md`` draws them). A module may import its
own layer and any lower one. Imports under ``if TYPE_CHECKING:`` are annotations only (never executed) and
are not counted. An import inside a function is counted like any other (layer and cycle), and must say why
it is deferred with a ``# deferred: ...`` comment on its line or above its block of imports.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "recipe_engine"

#: Lowest first; a module belongs to the longest prefix listed. ``recipe_engine.modifiers`` (the built-in
#: modifiers) import ``recipe_engine.api`` only, which ``tests/test_modifier_api.py`` checks. What the engine reads
#: and writes: the run records, the rule for output paths, the format registry (and checkpoint formats), the
#: checkpoint, the sources; above them a format that reads and writes (its package reaches sources and checkpoint)
#: and the model card (made from a report, it names the source and the export's format).
LAYERS: list[list[str]] = [
    ["recipe_engine.errors", "recipe_engine.suggest"],
    ["recipe_engine.system", "recipe_engine.numerics"],
    ["recipe_engine.architectures"],
    ["recipe_engine.recipe"],
    ["recipe_engine.records"],
    ["recipe_engine.paths"],
    ["recipe_engine.formats"],
    ["recipe_engine.checkpoint"],
    ["recipe_engine.sources"],
    ["recipe_engine.formats.gguf", "recipe_engine.records.card"],
    ["recipe_engine.execution"],
    ["recipe_engine.evaluation"],
    ["recipe_engine.plan"],
    ["recipe_engine.workflows"],
    ["recipe_engine.cli"],
    ["recipe_engine.api", "recipe_engine"],
    ["recipe_engine.modifiers"],
]
DEFERRED_MARK = "# deferred:"


@dataclass(frozen=True)
class Import:
    source: str  # importing module
    target: str  # imported module (engine modules resolved to the module or package imported)
    line: int
    local: bool  # inside a function
    commented: bool  # carries the deferred mark


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking(node: ast.If) -> bool:
    return "TYPE_CHECKING" in ast.unparse(node.test)


def imports_of(path: Path, root: Path, modules: set[str]) -> list[Import]:
    """Every import of one file (TYPE_CHECKING blocks left out), engine targets resolved to module names."""
    source = module_name(path, root)
    package = source if path.name == "__init__.py" else source.rpartition(".")[0]
    text = path.read_text()
    lines = text.splitlines()
    found: list[Import] = []

    def commented(node: ast.stmt) -> bool:
        """The mark on the import's line, or on the comment line above its block of imports."""
        if DEFERRED_MARK in lines[node.lineno - 1]:
            return True
        above = node.lineno - 2
        while above >= 0 and lines[above].strip().startswith(("import ", "from ")):
            above -= 1
        return above >= 0 and lines[above].strip().startswith(DEFERRED_MARK)

    def add(node: ast.stmt, target: str, local: bool) -> None:
        found.append(Import(source, target, node.lineno, local, commented(node)))

    def visit(node: ast.AST, local: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _type_checking(child):
                for sub in child.orelse:
                    visit(sub, local)
                continue
            if isinstance(child, ast.Import):
                for alias in child.names:
                    add(child, alias.name, local)
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = package.split(".")[:len(package.split(".")) - (child.level - 1)]
                    module = ".".join(base + ([child.module] if child.module else []))
                else:
                    module = child.module or ""
                submodules = [f"{module}.{a.name}" for a in child.names if f"{module}.{a.name}" in modules]
                for target in submodules or [module]:
                    add(child, target, local)
            visit(child, local or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(ast.parse(text), False)
    return found


def layer_of(module: str, layers: list[list[str]]) -> int | None:
    best: tuple[int, int] | None = None
    for index, prefixes in enumerate(layers):
        for prefix in prefixes:
            if module == prefix or module.startswith(prefix + "."):
                if best is None or len(prefix) > best[1]:
                    best = (index, len(prefix))
    return None if best is None else best[0]


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in edges.get(node, ()):
            if nxt not in index:
                connect(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            connect(node)
    return found


def layering_problems(root: Path, package: str, layers: list[list[str]]) -> list[str]:
    """One line per upward import, cycle, uncommented function-local import or module outside the layers."""
    files = sorted((root / package).rglob("*.py"))
    modules = {module_name(path, root) for path in files}
    problems: list[str] = []
    edges: dict[str, set[str]] = {}
    for path in files:
        for imp in imports_of(path, root, modules):
            if imp.local and not imp.commented:
                problems.append(f"{imp.source}:{imp.line}: import of {imp.target} inside a function without "
                                f"a '{DEFERRED_MARK}' comment")
            if imp.target not in modules or imp.target == imp.source:
                continue
            edges.setdefault(imp.source, set()).add(imp.target)
            low, high = layer_of(imp.target, layers), layer_of(imp.source, layers)
            if low is None or high is None:
                continue
            if low > high:
                problems.append(f"{imp.source}:{imp.line}: imports {imp.target}, a higher layer")
    problems += [f"{module}: in no layer" for module in sorted(modules) if layer_of(module, layers) is None]
    problems += ["import cycle: " + " -> ".join(cycle) for cycle in cycles(edges)]
    return problems


def test_engine_layers_point_down_without_cycles():
    problems = layering_problems(ROOT, PACKAGE, LAYERS)
    assert not problems, "\n".join(problems)


def test_every_layer_exists():
    modules = {module_name(path, ROOT) for path in (ROOT / PACKAGE).rglob("*.py")}
    for prefixes in LAYERS:
        for prefix in prefixes:
            assert any(m == prefix or m.startswith(prefix + ".") for m in modules), f"{prefix} is gone"


def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = tmp_path / "pkg" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


SYNTHETIC_LAYERS = [["pkg.low"], ["pkg.high", "pkg"]]


def test_the_pass_modules_stay_short():
    """Each module of ``recipe_engine/execution`` (the pass, its activations, streaming, resume) holds one concern
    in at most 400 lines."""
    long = {path.name: n for path in sorted((ROOT / PACKAGE / "execution").glob("*.py"))
            if (n := len(path.read_text().splitlines())) > 400}
    assert not long, long


def test_checker_sees_an_upward_import(tmp_path):
    root = _package(tmp_path, {"__init__.py": "", "low/__init__.py": "", "low/a.py": "from ..high import b\n",
                               "high/__init__.py": "", "high/b.py": "x = 1\n"})
    assert layering_problems(root, "pkg", SYNTHETIC_LAYERS) == ["pkg.low.a:1: imports pkg.high.b, a higher layer"]


def test_checker_sees_a_cycle_hidden_in_a_function(tmp_path):
    root = _package(tmp_path, {"__init__.py": "", "low/__init__.py": "",
                               "low/a.py": "from . import b\n",
                               "low/b.py": "def f():\n    from .a import g  # deferred: testing\n    return g\n"})
    assert layering_problems(root, "pkg", SYNTHETIC_LAYERS) == ["import cycle: pkg.low.a -> pkg.low.b"]


@pytest.mark.parametrize("comment, expected", [("", 1), ("  # deferred: heavy", 0)])
def test_checker_wants_a_reason_for_a_function_local_import(tmp_path, comment, expected):
    root = _package(tmp_path, {"__init__.py": "", "low/__init__.py": "",
                               "low/a.py": f"def f():\n    import json{comment}\n    return json\n"})
    problems = layering_problems(root, "pkg", SYNTHETIC_LAYERS)
    assert len(problems) == expected and all("inside a function" in p for p in problems)


def test_checker_skips_type_checking_imports(tmp_path):
    root = _package(tmp_path, {"__init__.py": "", "low/__init__.py": "", "high/__init__.py": "",
                               "high/b.py": "x = 1\n",
                               "low/a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                           "    from ..high.b import x\n"})
    assert layering_problems(root, "pkg", SYNTHETIC_LAYERS) == []
