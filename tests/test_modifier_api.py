"""Modifiers use the declared API only: engine names come from ``recipe_engine.api`` (never a private one),
and no modifier reaches into a private attribute of an engine object."""
import ast
from pathlib import Path

import pytest

import recipe_engine.api as api

MODIFIERS = sorted((Path(__file__).resolve().parents[1] / "recipe_engine" / "modifiers").glob("*.py"))


def _engine_imports(tree: ast.AST) -> list[tuple[str, str]]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "recipe_engine":
            found += [(node.module, alias.name) for alias in node.names]
        elif isinstance(node, ast.Import):
            found += [(alias.name, "") for alias in node.names if alias.name.split(".")[0] == "recipe_engine"]
    return found


@pytest.mark.parametrize("path", MODIFIERS, ids=[p.name for p in MODIFIERS])
def test_modifier_imports_only_the_declared_api(path):
    tree = ast.parse(path.read_text())
    for module, name in _engine_imports(tree):
        assert module == "recipe_engine.api", f"{path.name} imports {module} (use recipe_engine.api)"
        assert name in api.__all__, f"{path.name} imports {name}, which recipe_engine.api does not declare"
    private = sorted({node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)
                      and node.attr.startswith("_") and not node.attr.startswith("__")
                      and isinstance(node.value, ast.Name) and node.value.id in ("session", "reference", "sub")})
    assert not private, f"{path.name} uses private session attributes {private}"


def test_api_names_exist():
    assert all(hasattr(api, name) for name in api.__all__)


def test_check_catches_a_private_import(tmp_path):
    tree = ast.parse("from recipe_engine.execution.session import _to\nfrom recipe_engine.api import Modifier\n")
    assert _engine_imports(tree) == [("recipe_engine.execution.session", "_to"), ("recipe_engine.api", "Modifier")]
