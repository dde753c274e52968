"""Exact numbers for every parameter model of the engine (recipe fields and every modifier's parameters).

pydantic's lax mode reads ``true`` as ``1`` for an int field and accepts ``inf``/``nan`` for a float
field; in a recipe both are mistakes (``ShortGPT<n:true>`` ran with n = 1). :class:`StrictParameters`
refuses, for every field, a boolean where a number is read, a float that is not finite and an integer outside
int64 (``seed: 1e23`` would fail in torch after the model loaded), at any depth
(lists, mappings, nested parameter models such as ``LinearPatch``'s ``tune``). Strings are still read
as numbers where pydantic reads them (``--set modifiers.0.n=4`` gives YAML's int anyway).
"""
from __future__ import annotations

import functools
import math
from typing import Any

from pydantic import BaseModel, ConfigDict, TypeAdapter, ValidationError, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError


#: pydantic error type of :class:`StrictParameters`' refusals (the message names what was given).
NUMBER_ERROR = "exact_number"
#: The integers torch takes as a seed or a count (``torch.Generator.manual_seed``, tensor sizes): int64.
INT64 = (-2**63, 2**63 - 1)


def number_problem(raw: Any, value: Any) -> str | None:
    """Why validated ``value`` is not what the user's ``raw`` input meant, or None: a boolean turned into a
    number, or a float that is not finite; the path inside nested values is named."""
    if isinstance(raw, bool) and isinstance(value, (int, float)) and not isinstance(value, bool):
        return f"expected a number, got the boolean {str(raw).lower()}"
    if isinstance(value, float) and not math.isfinite(value):
        return f"must be a finite number (got {value})"
    if isinstance(value, int) and not isinstance(value, bool) and not INT64[0] <= value <= INT64[1]:
        return f"{value:.3g} is outside the 64-bit integer range torch reads (seeds, counts: up to {INT64[1]:.3g})"
    pairs: list[tuple[str, Any, Any]] = []
    if isinstance(value, BaseModel) and isinstance(raw, dict):
        pairs = [(name, raw[name], getattr(value, name)) for name in type(value).model_fields if name in raw]
    elif isinstance(value, dict) and isinstance(raw, dict):
        pairs = [(str(key), raw[key], item) for key, item in value.items() if key in raw]
    elif isinstance(value, (list, tuple)) and isinstance(raw, (list, tuple)) and len(raw) == len(value):
        pairs = [(f"item {i}", r, v) for i, (r, v) in enumerate(zip(raw, value))]
    for where, inner_raw, inner in pairs:
        problem = number_problem(inner_raw, inner)
        if problem:
            return f"{where}: {problem}"
    return None


class StrictParameters(BaseModel):
    """Base of the engine's parameter models: a boolean is not a number, and every float is finite."""

    model_config = ConfigDict(allow_inf_nan=False)

    @field_validator("*", mode="wrap")
    @classmethod
    def _exact_numbers(cls, raw: Any, handler, info: ValidationInfo) -> Any:
        if isinstance(raw, bool) and _numeric_field(cls, info.field_name):  # before its own bounds (n: false)
            raise PydanticCustomError(NUMBER_ERROR, f"expected a number, got the boolean {str(raw).lower()}")
        value = handler(raw)
        problem = number_problem(raw, value)
        if problem:
            raise PydanticCustomError(NUMBER_ERROR, problem)
        return value


@functools.cache
def _numeric_field(cls: type[BaseModel], name: str | None) -> bool:
    """Does field ``name`` of ``cls`` take a number and not a boolean (pydantic's strict mode)?"""
    field = cls.model_fields.get(name or "")
    if field is None:
        return False
    adapter = TypeAdapter(field.annotation)

    def accepts(value) -> bool:
        try:
            adapter.validate_python(value, strict=True)
        except ValidationError:
            return False
        return True

    return accepts(1) and not accepts(True)
