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


# -- the session as a modifier sees it -------------------------------------------------------------------------
from recipe_engine.api import ModifierSession  # noqa: E402

PROTOCOL = {name for name in vars(ModifierSession) if not name.startswith("_")}
PROTOCOL_METHODS = sorted(name for name in PROTOCOL if not isinstance(vars(ModifierSession)[name], property))


def _is_session_annotation(node: ast.AST | None) -> bool:
    return node is not None and "ModifierSession" in ast.unparse(node)


def _session_expression(node: ast.AST, names: set[str], members: set[str]) -> bool:
    """``node`` evaluates to a session: a session name, ``self.<member>``, ``<session>.branch(...)``,
    ``<session>.reference``, or a conditional with a session on either side."""
    if isinstance(node, ast.Name):
        return node.id in names
    if isinstance(node, ast.Attribute):
        if isinstance(node.value, ast.Name) and node.value.id == "self" and node.attr in members:
            return True
        return node.attr == "reference" and _session_expression(node.value, names, members)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "branch":
        return _session_expression(node.func.value, names, members)
    if isinstance(node, ast.IfExp):
        return _session_expression(node.body, names, members) or _session_expression(node.orelse, names, members)
    return False


def session_uses(tree: ast.AST) -> list[tuple[int, str, bool]]:
    """``(line, attribute, written)`` for every attribute a modifier reaches on a session object: a parameter
    annotated ``ModifierSession`` (or named ``session``), a name or ``self`` attribute assigned a session
    expression (``probe = session.branch(...)``, ``self.sub = ...``), in the function or one enclosing it."""
    members: set[str] = set()  # self.<member> holding a session, per file (classes are small)
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef):
            params = {a.arg for a in [*node.args.args, *node.args.kwonlyargs]
                      if a.arg == "session" or _is_session_annotation(a.annotation)}
            for sub in ast.walk(node):
                if isinstance(sub, ast.Assign) and _session_expression(sub.value, params, set()):
                    members |= {t.attr for t in sub.targets if isinstance(t, ast.Attribute)
                                and isinstance(t.value, ast.Name) and t.value.id == "self"}
    found: list[tuple[int, str, bool]] = []

    def visit(function: ast.FunctionDef, inherited: set[str]) -> None:
        names = set(inherited) | {a.arg for a in [*function.args.args, *function.args.kwonlyargs]
                                  if a.arg == "session" or _is_session_annotation(a.annotation)}
        body = [n for n in ast.walk(function) if n is not function]
        while True:  # names assigned a session expression, to a fixpoint (``fitter = probe if ... else fit``)
            more = {t.id for n in body if isinstance(n, ast.Assign) and _session_expression(n.value, names, members)
                    for t in n.targets if isinstance(t, ast.Name)}
            if more <= names:
                break
            names |= more
        for node in body:
            if isinstance(node, ast.Attribute) and _session_expression(node.value, names, members) \
                    and not (isinstance(node.value, ast.Name) and node.value.id == "self"):
                found.append((node.lineno, node.attr, isinstance(node.ctx, (ast.Store, ast.Del))))
        for node in ast.iter_child_nodes(function):
            for inner in ast.walk(node):
                if isinstance(inner, ast.FunctionDef):
                    visit(inner, names)

    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef):
            visit(node, set())
    return sorted(set(found))


@pytest.mark.parametrize("path", MODIFIERS, ids=[p.name for p in MODIFIERS])
def test_modifier_uses_only_the_modifier_session(path):
    uses = session_uses(ast.parse(path.read_text()))
    outside = sorted({f"{attr} (line {line})" for line, attr, _ in uses if attr not in PROTOCOL})
    assert not outside, f"{path.name} uses session attributes outside ModifierSession: {outside}"
    written = sorted({f"{attr} (line {line})" for line, attr, write in uses if write})
    assert not written, f"{path.name} writes session attributes: {written}"


def test_the_session_check_sees_the_modifiers():
    """The walk finds what modifiers do through every kind of session name (not a vacuous pass)."""
    seen = {attr for path in MODIFIERS for _, attr, _ in session_uses(ast.parse(path.read_text()))}
    assert {"layers", "set_layers", "layer_pass", "calibration_nll", "branch", "placed", "passes",
            "current_layer", "original_outputs", "outputs", "shape"} <= seen


def test_the_session_check_catches_a_violation():
    snippet = '''
class Step:
    def apply(self, session):
        probe = session.branch(session.calibration, copy=False)
        probe.memo = None
        self.sub = session.branch(session.calibration[:2], copy=False)
        fitter = probe if self else None
        def inner(x):
            return fitter.final_nll(x)
        session.layer_origin = []
        return session.stream, self.sub.parallel, session.reference.checkpoint

def helper(probe: "ModifierSession | None", layers):
    return probe.stream_units(), layers.count
'''
    uses = session_uses(ast.parse(snippet))
    outside = {attr for _, attr, _ in uses if attr not in PROTOCOL}
    assert outside == {"memo", "final_nll", "stream", "parallel", "checkpoint", "stream_units"}
    assert {attr for _, attr, written in uses if written} == {"memo", "layer_origin"}


def test_the_modifier_session_is_small_and_the_session_implements_it():
    """At most twelve methods (the module docstring names each); the engine's view of a session
    (``Session.view``, a ``ModifierView``) has every member,
    a method with the protocol's parameters (names, kinds, defaults), a fact as a property or attribute."""
    import inspect

    import torch

    import recipe_engine.execution.modifier_session as protocol_module
    from recipe_engine.architectures.adapters import adapter_for
    from recipe_engine.execution.context import RunContext
    from recipe_engine.execution.session import Session
    from recipe_engine.recipe.schema import CalibrationConfig
    from tests.helpers import random_tokens, tiny_model

    assert len(PROTOCOL_METHODS) <= 12, PROTOCOL_METHODS
    assert all(f"~ModifierSession.{name}`" in protocol_module.__doc__ for name in PROTOCOL_METHODS)
    model = tiny_model()
    session = Session(RunContext(None, adapter_for(model.config), CalibrationConfig(), torch.device("cpu")),
                      model, random_tokens(4, 16)).view
    for name in sorted(PROTOCOL):
        declared = vars(ModifierSession)[name]
        actual = inspect.getattr_static(session, name)  # a property is not evaluated
        if isinstance(declared, property):
            assert not inspect.isfunction(actual), f"Session.{name} is a method, the protocol's a fact"
            continue
        wanted = list(inspect.signature(declared).parameters.values())
        got = list(inspect.signature(actual).parameters.values())
        assert [(p.name, p.kind, p.default) for p in got] == [(p.name, p.kind, p.default) for p in wanted], name


def test_no_engine_module_writes_a_session_attribute():
    """The runner hands its collaborators (memo, outputs, stream, checkpoints) to the session at construction
    or per call; nothing outside ``Session`` itself assigns to a session's attributes."""
    names = {"session", "branch", "reference", "sub", "probe", "scorer", "sibling"}
    engine = Path(__file__).resolve().parents[1] / "recipe_engine"
    offenders = []
    for path in sorted(engine.rglob("*.py")):
        if path.name == "session.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
            for target in targets:
                while isinstance(target, (ast.Subscript, ast.Attribute)) and not (
                        isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name)):
                    target = target.value
                if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) \
                        and target.value.id in names:
                    offenders.append(f"{path.relative_to(engine)}:{node.lineno} {target.value.id}.{target.attr}")
    assert not offenders, offenders
