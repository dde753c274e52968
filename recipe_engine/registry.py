"""Modifier registry: one decorator per modifier file, plugins through entry points.

Built-in modifiers live in the top-level ``modifiers`` package; third-party packages add theirs through
the entry-point group ``recipe_engine.modifiers`` (each entry point names a module or a class). A duplicate
name or a plugin that fails to import raises :class:`RegistryError`; nothing is swallowed.
"""
from __future__ import annotations

import importlib
import pkgutil
from importlib.metadata import entry_points

from .errors import RecipeError
from .modifier import Modifier
from .suggest import did_you_mean

ENTRY_POINT_GROUP = "recipe_engine.modifiers"
BUILTIN_PACKAGE = "modifiers"
_MARK = "__recipe_step__"


class RegistryError(RuntimeError):
    """A broken modifier registration (duplicate name, failing plugin import)."""


class Registry:
    """Name → modifier class. The process-wide instance is :data:`REGISTRY`."""

    def __init__(self) -> None:
        self._classes: dict[str, type[Modifier]] = {}
        self._loaded = False

    def register(self, cls: type[Modifier]) -> type[Modifier]:
        if not (isinstance(cls, type) and issubclass(cls, Modifier)):
            raise RegistryError(f"{cls!r} is not a Modifier subclass")
        name = cls.step_name()
        existing = self._classes.get(name)
        if existing is not None and existing is not cls:
            raise RegistryError(f"modifier name '{name}' registered twice: "
                                f"{existing.__module__} and {cls.__module__}")
        self._classes[name] = cls
        return cls

    def load(self) -> None:
        """Import the built-in modifiers and every plugin entry point (once)."""
        if self._loaded:
            return
        self._loaded = True
        package = importlib.import_module(BUILTIN_PACKAGE)
        for info in pkgutil.iter_modules(package.__path__):
            if not info.name.startswith("_"):
                module = importlib.import_module(f"{BUILTIN_PACKAGE}.{info.name}")
                for value in vars(module).values():
                    if isinstance(value, type) and value.__dict__.get(_MARK):
                        self.register(value)
        for entry in entry_points(group=ENTRY_POINT_GROUP):
            try:
                loaded = entry.load()
            except Exception as exc:  # reported, never swallowed
                raise RegistryError(f"plugin '{entry.name}' ({entry.value}) failed to import: "
                                    f"{type(exc).__name__}: {exc}") from exc
            if isinstance(loaded, type):
                self.register(loaded)

    def get(self, name: str) -> type[Modifier]:
        self.load()
        try:
            return self._classes[name]
        except KeyError:
            raise RecipeError(f"unknown modifier '{name}'{did_you_mean(name, self._classes)}"
                              f" (see `recipe list-modifiers`)") from None

    def names(self) -> list[str]:
        self.load()
        return sorted(self._classes)

    def classes(self) -> list[type[Modifier]]:
        return [self._classes[n] for n in self.names()]


REGISTRY = Registry()


def register(cls: type[Modifier]) -> type[Modifier]:
    """Class decorator: ``@register`` adds a modifier under its class name."""
    REGISTRY.register(cls)
    setattr(cls, _MARK, True)
    return cls
