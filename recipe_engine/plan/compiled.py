"""A recipe compiled once against a model's config: what every command reads instead of replaying the steps.

:func:`compile_plan` binds the steps (layer budgets given as percentages resolved against the model's layer
count), walks them once over the symbolic shape with the recipe's validation rules
(``recipe.validate.check_steps``), and keeps what the walk learns: the shape every step receives and the
shape after the last one, each step's calibration passes on the shape it receives, and the pass groups
(consecutive layer-scope steps share one pass). ``recipe validate`` reports the final shape, ``recipe
plan`` prints the passes and the memory estimate (``estimates.plan_memory``), ``recipe apply`` checks disk
room (``estimates.plan_output_bytes``), decides streaming (``preflight.preflight_apply`` records it in
``streamed``) and runs the bound steps, and ``recipe sweep`` compiles every variant before the first load.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from ..architectures.shape import DTYPE_BYTES, ModelShape
from ..errors import RecipeError
from ..execution.steps import group_steps
from ..recipe.modifier import Modifier
from ..recipe.schema import Recipe
from ..recipe.validate import bound_steps, check_steps

#: Calibration passes as (fewest, most): equal unless a step's count depends on the data.
Passes = tuple[int, int]


@dataclass(frozen=True)
class Plan:
    """A recipe compiled against a model's config (see the module docstring)."""

    recipe: Recipe
    config: Any
    #: The recipe's steps, budgets bound to this model.
    steps: tuple[Modifier, ...]
    #: ``shapes[i]``: the symbolic shape step ``i`` receives; ``shapes[-1]``: the model the recipe leaves.
    shapes: tuple[ModelShape, ...]
    #: Calibration passes of each step on the shape it receives.
    passes: tuple[Passes, ...]
    #: Pass groups: step indices sharing one calibration pass (consecutive layer-scope steps).
    groups: tuple[tuple[int, ...], ...]
    #: Whether ``apply`` streams the weights from disk (``preflight.preflight_apply``); None: not decided.
    streamed: bool | None = None

    @property
    def final(self) -> ModelShape:
        """The symbolic shape of the model the recipe leaves."""
        return self.shapes[-1]

    def group_passes(self) -> list[Passes]:
        """Passes of each pass group: the largest of its steps' (one shared pass serves them all)."""
        return [(max(self.passes[i][0] for i in group), max(self.passes[i][1] for i in group))
                for group in self.groups]

    def total_passes(self) -> Passes:
        """Calibration passes of the whole recipe, (fewest, most)."""
        groups = self.group_passes()
        return sum(p[0] for p in groups), sum(p[1] for p in groups)


def compile_plan(recipe: Recipe, config, file: str | None = None) -> Plan:
    """Bind the recipe's steps to ``config`` and walk them once over its symbolic shape (every step's
    ``check`` and ``check_calibration`` and the recipe-wide rules of ``check_steps``); an error is one line
    naming ``file`` and the step. Each step's passes are counted on a copy of the shape it receives."""
    steps = bound_steps(recipe, config, file)
    received: list[ModelShape] = []
    shape = ModelShape.from_config(config)
    shape.stock_only, shape.dtype_bytes = recipe.export is not None, DTYPE_BYTES[recipe.dtype]
    check_steps(steps, shape, recipe.calibration, file, received=received)
    passes: list[Passes] = []
    for index, (step, shape) in enumerate(zip(steps, received)):
        try:
            count = step.passes(copy.deepcopy(shape))
        except RecipeError as exc:
            raise exc.located(file=file, step=index, modifier=step.step_name()) from None
        passes.append((count, count) if isinstance(count, int) else tuple(count))
    groups = tuple(tuple(index for index, _ in group) for group in group_steps(steps))
    return Plan(recipe, config, tuple(steps), tuple(received), tuple(passes), groups)
