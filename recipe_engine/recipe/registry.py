"""Modifier registry: one decorator per modifier file, plugins through entry points.

Modifiers register through the entry-point group ``recipe_engine.modifiers``: an entry point names a class,
a module, or a package whose public modules (names without a leading ``_``) hold ``@register`` classes.
The built-ins are such a package entry point (``builtin = "recipe_engine.modifiers"`` in pyproject.toml,
installed from the repository's top-level ``modifiers/`` folder); the registry scans that package even when
the installed metadata predates the entry point (a source checkout on ``PYTHONPATH``). A duplicate name or a
module that fails to import raises :class:`RegistryError` (one line at the CLI); nothing is swallowed.
"""
from __future__ import annotations

import importlib
import pkgutil
from functools import partial
from importlib.metadata import entry_points

from ..errors import RecipeError
from ..suggest import did_you_mean
from .modifier import Modifier

ENTRY_POINT_GROUP = "recipe_engine.modifiers"
BUILTIN_PACKAGE = "recipe_engine.modifiers"
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
        """Import every entry point of the group (and the built-in package), once."""
        if self._loaded:
            return
        self._loaded = True
        targets = {BUILTIN_PACKAGE: ("builtin", lambda: importlib.import_module(BUILTIN_PACKAGE))}
        targets.update({entry.value: (entry.name, entry.load) for entry in entry_points(group=ENTRY_POINT_GROUP)})
        for value, (name, load) in targets.items():
            loaded = _loaded(name, value, load)
            if isinstance(loaded, type):
                self.register(loaded)
                continue
            modules = [loaded]
            if hasattr(loaded, "__path__"):  # a package: its public modules
                modules = [_loaded(name, value, partial(importlib.import_module, f"{loaded.__name__}.{info.name}"))
                           for info in pkgutil.iter_modules(loaded.__path__) if not info.name.startswith("_")]
            for module in modules:
                for member in vars(module).values():
                    if isinstance(member, type) and member.__dict__.get(_MARK):
                        self.register(member)

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


def _loaded(name: str, value: str, load):
    """``load()``: an entry point's object or a module of a package entry point; a failure is one line."""
    try:
        return load()
    except Exception as exc:  # reported, never swallowed
        raise RegistryError(f"plugin '{name}' ({value}) failed to import: {type(exc).__name__}: {exc}") from exc


def register(cls: type[Modifier]) -> type[Modifier]:
    """Class decorator: ``@register`` adds a modifier under its class name."""
    REGISTRY.register(cls)
    setattr(cls, _MARK, True)
    return cls
