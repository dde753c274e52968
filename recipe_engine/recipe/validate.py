"""Validate a recipe against a model's config without loading weights (meta device)."""
from __future__ import annotations

import copy

from ..architectures.shape import ModelShape
from ..errors import RecipeError
from .budget import bind_steps
from .schema import Recipe


def check_steps(steps: list, shape: ModelShape, calibration=None, file: str | None = None,
                received: list[ModelShape] | None = None) -> ModelShape:
    """Each step's ``check`` on ``shape`` in order (updating it), and ``check_calibration`` when
    ``calibration`` is given; no step may change weights a previous step quantized, nor the layers after
    a step that pinned them. An error names the step's index in ``steps`` (and ``file``). ``received``
    (a list) collects a copy of the shape each step receives, then the final shape (``plan.compiled``)."""
    for index, step in enumerate(steps):
        if received is not None:
            received.append(copy.deepcopy(shape))
        pinned, origins = shape.pinned, [layer.origin for layer in shape.layers]
        try:
            if shape.chosen_by:
                raise step.fail(f"comes after {shape.chosen_by}, whose alternatives leave models of different sizes "
                                f"(chosen at run time); put this step at the end of each alternative")
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
    if received is not None:
        received.append(copy.deepcopy(shape))
    return shape


def bound_steps(recipe: Recipe, config, file: str | None = None) -> list:
    """The recipe's steps with layer budgets given as percentages resolved against the model's layer count
    (``recipe_engine.recipe.budget``); an error names the file and step."""
    try:
        return bind_steps(recipe.modifiers, config.num_hidden_layers)
    except RecipeError as exc:
        raise exc.located(file=file) from None


