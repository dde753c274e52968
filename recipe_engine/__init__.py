"""recipe: a declarative YAML recipe engine for composable compression of HF decoder LLMs."""
from .errors import QualityGateError, RecipeError
from .io.report import FORMAT_VERSION, Report, load_report
from .recipe.modifier import LayerModifier, Modifier
from .recipe.registry import register


def apply(recipe, model=None, tokenizer=None, **kwargs):
    """Run a recipe (path, dict or :class:`Recipe`); returns ``(model, report)``. See ``workflows.runner.apply``."""
    # deferred: the package's face; ``import recipe_engine.errors`` must not load the whole engine
    from .workflows.runner import apply as _apply

    return _apply(recipe, model, tokenizer, **kwargs)


def load_model(directory: str, dtype: str = "float32"):
    """Load a recipe output (or any supported model) and restore non-stock extras; returns (model, tokenizer)."""
    # deferred: as for apply, the engine loads on first use
    from .io.models import load_model as _load

    model, tokenizer, _ = _load(directory, dtype)
    return model, tokenizer


__all__ = ["apply", "load_model", "load_report", "register", "Modifier", "LayerModifier", "Report",
           "FORMAT_VERSION", "RecipeError", "QualityGateError"]
