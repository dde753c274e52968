"""Validate a recipe against a model's config without loading weights (meta device)."""
from __future__ import annotations

from ..architectures.adapters import adapter_for
from .budget import bind_steps
from ..errors import RecipeError
from ..io.models import parse_device
from .schema import Recipe
from ..architectures.shape import ModelShape

#: Fewest decoder layers a recipe may leave: one layer is a bigram-like model, not a compressed LLM.
MIN_LAYERS = 2


def check_against_config(recipe: Recipe, config, file: str | None = None) -> ModelShape:
    """Run every step's ``check`` on the symbolic shape (and ``check_calibration`` on the recipe's
    calibration settings); the final model must be uniform, and no step may
    change the layers after a step that pinned them (``ModelShape.pinned``).

    The architecture is also instantiated on the meta device to prove transformers can build it.
    """
    try:
        adapter_for(config)
        if recipe.device != "auto":
            parse_device(recipe.device)  # syntax only: validating a GPU recipe on a laptop is fine
    except RecipeError as exc:
        raise exc.located(file=file) from None
    _build_on_meta(config, file)
    shape = ModelShape.from_config(config)
    check_steps(bound_steps(recipe, config, file), shape, recipe.calibration, file)
    if shape.num_layers < MIN_LAYERS <= shape.original_layers:
        raise RecipeError(f"the recipe leaves {shape.num_layers} of {shape.original_layers} decoder layers; a "
                          f"model needs at least {MIN_LAYERS} to be a useful result (remove fewer layers)",
                          file=file, field="modifiers")
    odd = shape.oversized_layers()
    if odd:
        raise RecipeError(f"the recipe leaves layers {odd} wider than the config; a stock checkpoint needs "
                          f"uniform layers (add pruning steps that cover them)", file=file, field="modifiers")
    if recipe.export is not None:
        from ..io.gguf_export import check_recipe_exportable

        try:
            check_recipe_exportable(recipe, config)
        except RecipeError as exc:
            raise exc.located(file=file) from None
    return shape


def check_steps(steps: list, shape: ModelShape, calibration=None, file: str | None = None) -> ModelShape:
    """Each step's ``check`` on ``shape`` in order (updating it), and ``check_calibration`` when
    ``calibration`` is given; no step may change weights a previous step quantized, nor the layers after
    a step that pinned them. An error names the step's index in ``steps`` (and ``file``)."""
    for index, step in enumerate(steps):
        pinned, origins = shape.pinned, [layer.origin for layer in shape.layers]
        try:
            if shape.quantized_by and step.changes_weights:
                raise step.fail(f"changes weights that {shape.quantized_by} quantized (their grid would be lost); "
                                f"put it before that step")
            step.check(shape)
            if step.quantizes:
                shape.quantized_by = f"step {index} ({step.step_name()})"
            if calibration is not None:
                step.check_calibration(calibration)
            if pinned and [layer.origin for layer in shape.layers] != origins:
                raise step.fail(f"changes the decoder layers after {pinned}, whose result is tied to them; "
                                f"put {pinned} after every step that removes or merges layers")
        except RecipeError as exc:
            raise exc.located(file=file, step=index, modifier=step.step_name()) from None
    return shape


def bound_steps(recipe: Recipe, config, file: str | None = None) -> list:
    """The recipe's steps with layer budgets given as percentages resolved against the model's layer count
    (``recipe_engine.budget``); an error names the file and step."""
    try:
        return bind_steps(recipe.modifiers, config.num_hidden_layers)
    except RecipeError as exc:
        raise exc.located(file=file) from None


def _build_on_meta(config, file: str | None) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            AutoModelForCausalLM.from_config(config)
    except Exception as exc:  # the config itself is unusable
        raise RecipeError(f"cannot build {config.model_type} from its config: {exc}", file=file) from None
