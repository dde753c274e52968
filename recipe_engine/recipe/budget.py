"""Layer budgets given as a count or as a percentage of the model's layers, so one recipe fits any model.

A step field typed :data:`LayerBudget` accepts a count (``n: 6``) or a percentage of the decoder layers of
the model the recipe starts from (``n: 20%``). The engine resolves percentages once, against the model's
config, before any step is checked, planned or run (:func:`bind_steps`): a step only ever sees a count.

Rounding: ``n = ⌊p · L / 100 + 1/2⌋`` (half up, exact rational arithmetic), ``L`` the original layer count:
20 % of SmolLM2-135M's 30 layers is 6, of Qwen2.5-0.5B's 24 is 5 (4.8), of Gemma-3-270M's 18 is 4 (3.6).
A percentage that rounds to 0 is an error. The recipe as written keeps ``20%`` (``recipe.yaml``, its
hash); each step's record in ``report.json`` has the resolved count.
"""
from __future__ import annotations

import math
import re
from fractions import Fraction
from typing import Annotated, Any, get_args

from pydantic import AfterValidator, BaseModel, Field

from ..errors import RecipeError
from .modifier import Modifier


_PERCENT = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*%\s*$")


class BudgetMarker:
    """Marks a field as a layer budget (found by :func:`bind_step` in the field's metadata)."""

    def __repr__(self) -> str:
        return "LayerBudget"


def percentage(value: Any) -> Fraction | None:
    """``"20%"`` (or ``"12.5 %"``) as the exact number ``Fraction(20)``; None for anything else. The one reader
    of percentages in recipes: layer budgets here, BestOf's size budget, WidthPrune's ``parameters``."""
    match = _PERCENT.match(value) if isinstance(value, str) else None
    return Fraction(match.group(1)) if match else None


def share_of(value: str, total: int) -> Fraction:
    """``value`` (a percentage) of ``total``, exactly: ``p · total / 100``."""
    return percentage(value) * total / 100


_BYTE_COUNT = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(B|kB|KB|MB|GB|TB|KiB|MiB|GiB|TiB)?\s*$")
_BYTE_UNITS = {"B": 1, "kB": 10**3, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
               "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}


def byte_count(value: Any) -> int | None:
    """A positive byte count: an integer, or ``"400MB"`` / ``"381.5 MiB"`` (decimal and binary units, rounded
    down to whole bytes); None for anything else."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value if value > 0 else None
    match = _BYTE_COUNT.match(value) if isinstance(value, str) else None
    if match is None:
        return None
    count = math.floor(Fraction(match.group(1)) * _BYTE_UNITS[match.group(2) or "B"])
    return count if count > 0 else None


def percentage_field(value: Any, *, what: str, example: str, up_to_100: bool = False) -> str:
    """A validator's check that ``value`` is a percentage in (0, 100) (``up_to_100``: (0, 100]); returns it
    written plainly (``"80%"``). ``what``/``example`` name it in the error."""
    share = percentage(value)
    if share is None or not 0 < share <= 100 or (share == 100 and not up_to_100):
        bound = "(0%, 100%]" if up_to_100 else "(0%, 100%)"
        raise ValueError(f"expected {what} such as {example}, a percentage in {bound}, got {value!r}")
    return f"{_PERCENT.match(value).group(1)}%"


def _valid(value: int | str) -> int | str:
    if isinstance(value, bool):
        raise ValueError("expected a layer count or a percentage such as 20%")
    if isinstance(value, int):
        if value < 1:
            raise ValueError("a layer count must be at least 1")
        return value
    return percentage_field(value, what="a layer count or a percentage of layers", example="20%")


#: A number of layers: a count (``6``) or a percentage of the model's decoder layers (``"20%"``).
LayerBudget = Annotated[int | str, AfterValidator(_valid), BudgetMarker()]


def resolve_budget(value: int | str, num_layers: int) -> int:
    """``value`` as a count of layers of a model with ``num_layers`` decoder layers (see the module)."""
    if isinstance(value, int):
        return value
    return math.floor(share_of(value, num_layers) + Fraction(1, 2))


def _is_budget(annotation: Any) -> bool:
    """Whether a field's annotation is :data:`LayerBudget`, alone or inside a union (``LayerBudget | None``)."""
    if any(isinstance(m, BudgetMarker) for m in getattr(annotation, "__metadata__", ())):
        return True
    return any(_is_budget(arg) for arg in get_args(annotation) if arg is not type(None))


def _budget_fields(cls: type[BaseModel]) -> list[str]:
    return [name for name, info in cls.model_fields.items()
            if any(isinstance(m, BudgetMarker) for m in info.metadata) or _is_budget(info.annotation)]


def bind_step(step: "Modifier", num_layers: int) -> "Modifier":
    """``step`` with every percentage budget resolved against ``num_layers`` (the original layer count);
    steps nested in a field (a list of steps, or a list of lists) are bound too. A step without any
    percentage is returned as it is."""
    def bind_value(value: Any) -> Any:
        if isinstance(value, Modifier):
            return bind_step(value, num_layers)
        if isinstance(value, list):
            bound = [bind_value(v) for v in value]
            return value if all(a is b for a, b in zip(bound, value)) else bound
        return value

    update: dict[str, Any] = {}
    for name in _budget_fields(type(step)):
        value = getattr(step, name)
        if isinstance(value, str):
            count = resolve_budget(value, num_layers)
            if count < 1:
                raise step.fail(f"{value} of {num_layers} layers rounds to {count}; give a larger share or a count",
                                field=name)
            update[name] = count
    for name in type(step).model_fields:
        if name in update:
            continue
        value = getattr(step, name)
        bound = bind_value(value)
        if bound is not value:
            update[name] = bound
    return step.model_copy(update=update) if update else step


def bind_steps(steps: list["Modifier"], num_layers: int) -> list["Modifier"]:
    """:func:`bind_step` for every step; an error names the step's index."""
    bound = []
    for index, step in enumerate(steps):
        try:
            bound.append(bind_step(step, num_layers))
        except RecipeError as exc:
            raise exc.located(step=index, modifier=step.step_name()) from None
    return bound


def budget_field(default: int | str | None, description: str) -> Any:
    """A pydantic ``Field`` for a :data:`LayerBudget` (the description says percentages are accepted)."""
    return Field(default, description=f"{description}; a count or a percentage of the model's layers (20%)")
