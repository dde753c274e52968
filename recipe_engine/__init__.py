"""recipe: a declarative YAML recipe engine for composable compression of HF decoder LLMs."""
from .errors import OutOfMemory, QualityGateError, RecipeError

# The package's face loads on first use (PEP 562): ``import recipe_engine.cli`` or ``recipe_engine.errors``
# must not import torch, so that the ``recipe`` command handles Ctrl-C before the engine's imports.
_LAZY = {"FORMAT_VERSION": "records.report", "Report": "records.report", "load_report": "records.report",
         "LayerModifier": "recipe.modifier", "Modifier": "recipe.modifier", "register": "recipe.registry"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib  # deferred: the lazy face above, with what it imports

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def apply(recipe, model=None, tokenizer=None, **kwargs):
    """Run a recipe (path, dict or :class:`Recipe`); returns ``(model, report)``. See ``workflows.runner.apply``."""
    # deferred: the package's face; ``import recipe_engine.errors`` must not load the whole engine
    from .workflows.runner import apply as _apply

    return _apply(recipe, model, tokenizer, **kwargs)


def load_model(directory: str, dtype: str = "float32"):
    """Load a recipe output (or any supported model) and restore non-stock extras; returns (model, tokenizer)."""
    # deferred: as for apply, the engine loads on first use
    from .sources.models import load_model as _load

    model, tokenizer, _ = _load(directory, dtype)
    return model, tokenizer


__all__ = ["apply", "load_model", "load_report", "register", "Modifier", "LayerModifier", "Report",
           "FORMAT_VERSION", "RecipeError", "QualityGateError", "OutOfMemory"]
