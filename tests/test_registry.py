"""Registry: decorator registration, duplicate names, plugin entry points (errors reported)."""
import importlib.metadata

import pytest

from recipe_engine.recipe.modifier import Modifier
from recipe_engine.recipe.registry import REGISTRY, Registry, RegistryError


def test_builtin_modifiers_are_registered():
    assert "FuseNorm" in REGISTRY.names()


def test_duplicate_name_raises():
    registry = Registry()

    class Twice(Modifier):
        """One."""

    registry.register(Twice)
    Other = type("Twice", (Modifier,), {"__doc__": "Two.", "__module__": "elsewhere"})
    with pytest.raises(RegistryError, match="registered twice"):
        registry.register(Other)


def test_non_modifier_is_rejected():
    with pytest.raises(RegistryError, match="not a Modifier subclass"):
        Registry().register(int)


class FakeEntryPoint:
    def __init__(self, name, value, target=None, error=None):
        self.name, self.value, self._target, self._error = name, value, target, error

    def load(self):
        if self._error:
            raise self._error
        return self._target


def _patch_entry_points(monkeypatch, entries):
    import recipe_engine.recipe.registry as registry_module

    monkeypatch.setattr(registry_module, "entry_points",
                        lambda group: entries if group == "recipe_engine.modifiers" else [])


def test_plugin_modifier_is_added(monkeypatch):
    class PluginStep(Modifier):
        """A third-party step."""

    _patch_entry_points(monkeypatch, [FakeEntryPoint("plugin", "pkg.mod:PluginStep", PluginStep)])
    registry = Registry()
    assert registry.get("PluginStep") is PluginStep
    assert "FuseNorm" in registry.names()


def test_plugin_import_error_is_reported_not_swallowed(monkeypatch):
    _patch_entry_points(monkeypatch, [FakeEntryPoint("broken", "broken_pkg.mod",
                                                     error=ModuleNotFoundError("No module named 'torchx'"))])
    with pytest.raises(RegistryError, match=r"plugin 'broken' \(broken_pkg.mod\) failed to import: "
                                            r"ModuleNotFoundError: No module named 'torchx'"):
        Registry().load()


def test_cli_reports_plugin_error(monkeypatch, capsys):
    import recipe_engine.cli.commands as cli
    import recipe_engine.recipe.registry as registry_module

    _patch_entry_points(monkeypatch, [FakeEntryPoint("broken", "x", error=ImportError("boom"))])
    monkeypatch.setattr(registry_module, "REGISTRY", Registry())
    monkeypatch.setattr(cli, "REGISTRY", registry_module.REGISTRY)
    assert cli.run(["list-modifiers"]) == 2
    assert "plugin 'broken' (x) failed to import: ImportError: boom" in capsys.readouterr().err


def test_entry_point_group_name():
    # the documented group; a plugin package declares [project.entry-points."recipe_engine.modifiers"]
    assert isinstance(importlib.metadata.entry_points(group="recipe_engine.modifiers"), object)


def test_builtins_register_under_our_namespace():
    classes = REGISTRY.classes()
    assert classes and all(cls.__module__.startswith("recipe_engine.modifiers.") for cls in classes)


def test_broken_builtin_module_is_one_line_at_the_cli(monkeypatch, capsys, tmp_path):
    import recipe_engine.cli.commands as cli
    import recipe_engine.recipe.registry as registry_module

    package = tmp_path / "broken_builtins"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "step.py").write_text("import no_such_module_here\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(registry_module, "BUILTIN_PACKAGE", "broken_builtins")
    _patch_entry_points(monkeypatch, [])
    monkeypatch.setattr(registry_module, "REGISTRY", Registry())
    monkeypatch.setattr(cli, "REGISTRY", registry_module.REGISTRY)
    assert cli.run(["list-modifiers"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "(broken_builtins) failed to import: ModuleNotFoundError" in err
