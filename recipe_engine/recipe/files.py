"""Read recipes from files (or ``path@gitrev``), apply CLI overrides, and compare recipes."""
from __future__ import annotations

import copy
import hashlib
import subprocess
from dataclasses import dataclass
from pathlib import Path
from types import UnionType
from typing import Any, Union, get_args, get_origin

import yaml
from pydantic import BaseModel

from ..errors import RecipeError
from ..suggest import did_you_mean
from ..system.file_kinds import special_kind_of
from .registry import REGISTRY
from .schema import (MAX_YAML_BYTES, Recipe, load_yaml, parse_compact, recipe_from_dict, recipe_to_dict, safe_load,
                     yaml_problem)


def yaml_scalar(value: str) -> str:
    """A command-line string as a YAML scalar that loads back as that same string (for ``--set``)."""
    return yaml.safe_dump(value, default_style='"', width=2**31).strip()


@dataclass
class LoadedRecipe:
    recipe: Recipe
    path: str
    text: str

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.text.encode()).hexdigest()


def file_kind(path: Path) -> str:
    """What a path that is not a regular file or a directory is: a character device, a FIFO, ..."""
    return special_kind_of(path.stat().st_mode) or "not a regular file"


def read_recipe_text(spec: str) -> tuple[str, str]:
    """Return (display name, text) for ``path`` or ``path@gitrev``."""
    path, rev = spec, None
    if "@" in spec and not Path(spec).exists():
        path, rev = spec.rsplit("@", 1)
    if rev is None:
        file = Path(path)
        if file.is_dir():
            raise RecipeError("is a directory, not a recipe file (a recipe is a .yaml file; "
                              "`recipe eval DIR` reads an output directory)", file=path)
        if file.exists() and not file.is_file():  # /dev/null, a FIFO (read would block), a socket
            raise RecipeError(f"not a regular file ({file_kind(file)}); a recipe is a .yaml file", file=path)
        if not file.is_file():
            raise RecipeError("recipe file not found", file=path)
        try:
            size = file.stat().st_size
            if size > MAX_YAML_BYTES:
                raise RecipeError(f"{size:,} bytes; a recipe is read only up to {MAX_YAML_BYTES:,} bytes of YAML",
                                  file=path)
            data = file.read_bytes()
        except OSError as exc:
            raise RecipeError(f"cannot read recipe file: {exc.strerror}", file=path) from None
        return path, decode_text(data, path)
    file = Path(path).resolve()
    if not rev or rev.startswith("-"):  # never an option of git's, whatever follows
        raise RecipeError(f"cannot read revision '{rev}': not a commit (a revision cannot be empty or start "
                          f"with '-')", file=path)
    try:
        top = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=file.parent, check=True,
                             capture_output=True, text=True).stdout.strip()
        rel = file.relative_to(Path(top).resolve()).as_posix()
        # the revision is verified as a commit and replaced by its hash, so git reads no user text as an option
        commit = subprocess.run(["git", "rev-parse", "--verify", "--quiet", "--end-of-options", f"{rev}^{{commit}}"],
                                cwd=top, capture_output=True, text=True).stdout.strip()
        if not commit:
            raise RecipeError(f"cannot read revision '{rev}': not a commit of {top}", file=path)
        data = subprocess.run(["git", "show", f"{commit}:./{rel}"], cwd=top, check=True,
                              capture_output=True).stdout
    except (subprocess.CalledProcessError, ValueError, OSError) as exc:
        detail = getattr(exc, "stderr", "") or str(exc)
        detail = detail.decode(errors="replace") if isinstance(detail, bytes) else detail
        raise RecipeError(f"cannot read revision '{rev}': {(detail.strip().splitlines() or ['?'])[-1]}",
                          file=path) from None
    return spec, decode_text(data, spec)


def decode_text(data: bytes, name: str) -> str:
    """UTF-8 text of a recipe; binary or mis-encoded files are one located error."""
    if b"\0" in data:
        raise RecipeError("is a binary file, not a YAML recipe", file=name)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise RecipeError(f"not UTF-8 text: byte 0x{data[exc.start]:02x} at line {line} (save the recipe "
                          f"as UTF-8)", file=name) from None


def apply_override(data: dict[str, Any], assignment: str, file: str) -> None:
    """Apply ``dotted.path=value`` to the raw recipe mapping (value parsed as YAML).

    Steps are addressed by index: ``modifiers.2.lambda_scale=5`` sets a parameter of step 2, and
    ``modifiers.0.score.task=humaneval`` a field of a parameter that is itself a group of fields (BestOf's
    ``score``: its other fields keep the recipe's values, or their defaults). Outside the steps the paths are
    :func:`override_paths`. An unknown parameter or field, at any depth, is refused by validation (one line
    with a "did you mean"), as in the recipe file.
    """
    path, sep, raw = assignment.partition("=")
    if not sep or not path:
        raise RecipeError(f"override {assignment!r} must look like key.path=value", file=file)
    try:
        value = safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        raise RecipeError(f"override {assignment!r}: value is not valid YAML: {yaml_problem(exc)}",
                          file=file) from None
    keys = path.split(".")
    if keys[0] == "modifiers" and len(keys) >= 3:
        steps = data.get("modifiers")
        steps = steps if isinstance(steps, list) else []
        try:
            index = int(keys[1])
            if index < 0:
                raise IndexError(index)
            step = steps[index]
        except (ValueError, IndexError):
            raise RecipeError(f"override {assignment!r}: no step {keys[1]} "
                              f"(recipe has {len(steps)})", file=file) from None
        try:
            if isinstance(step, str):
                name, params = parse_compact(step)
            elif isinstance(step, dict) and len(step) == 1:
                name, params = next(iter(step.items()))
            else:
                raise RecipeError("a step is 'Name<key:value>' or a one-key mapping {Name: {key: value}}")
            if not isinstance(params, (dict, type(None))):
                raise RecipeError(f"parameters must be a mapping, got {type(params).__name__}")
        except RecipeError as exc:
            raise exc.located(file=file, step=index) from None
        params = dict(params or {})
        try:
            _set_parameter(params, keys[2:], value, name, f"modifiers.{index}")
        except RecipeError as exc:
            raise RecipeError(f"override {assignment!r}: {exc.detail}", file=file, step=index,
                              modifier=str(name)) from None
        steps[index] = {name: params}
        return
    known = override_paths()
    if path not in known:
        hint = did_you_mean(path, known) or "; steps are addressed as modifiers.INDEX.PARAMETER"
        raise RecipeError(f"override {assignment!r}: unknown path '{path}'{hint}", file=file)
    node = data
    for key in keys[:-1]:
        if not isinstance(node.get(key), dict):
            node[key] = {}
        node = node[key]
    node[keys[-1]] = value


def _set_parameter(params: dict[str, Any], keys: list[str], value: Any, name: Any, step: str) -> None:
    """Set ``keys`` (``["n"]``, or ``["score", "task"]`` down a group of fields) in one step's parameters.

    Only a field whose type is a pydantic model (``X`` or ``X | None``) is descended into; its mapping is
    copied (or started) so the fields not named keep their values. A name the modifier does not have is set
    as given, for validation to refuse with its suggestions."""
    try:
        model: type[BaseModel] | None = REGISTRY.get(str(name))
    except RecipeError:  # an unknown modifier: validation names it
        model = None
    node = params
    for depth, key in enumerate(keys[:-1]):
        field = model.model_fields.get(key) if model is not None else None
        inner = _nested_model(field.annotation) if field is not None else None
        where = ".".join(keys[:depth + 1])
        if field is not None and inner is None:
            raise RecipeError(f"parameter '{where}' is not a group of fields: set it whole "
                              f"({step}.{where}=VALUE)")
        child = node.get(key)
        if child is not None and not isinstance(child, dict):
            raise RecipeError(f"parameter '{where}' is {child!r} in the recipe, not a mapping of fields")
        node[key] = dict(child or {})
        node, model = node[key], inner
    node[keys[-1]] = value


def _nested_model(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model a field holds (``X`` or ``X | None``), or None for a value or a list."""
    members = get_args(annotation) if get_origin(annotation) in (Union, UnionType) else (annotation,)
    return next((m for m in members if isinstance(m, type) and issubclass(m, BaseModel)), None)


def override_paths() -> list[str]:
    """Every dotted path ``--set`` accepts outside ``modifiers.INDEX.…``: each field of the recipe and, down
    any field that is a group of fields (``calibration``, ``evaluate.perplexity``, ``export``), each of its."""
    def walk(model: type[BaseModel], prefix: str) -> list[str]:
        paths = []
        for name, field in model.model_fields.items():
            paths.append(prefix + name)
            inner = _nested_model(field.annotation)
            if inner is not None:
                paths += walk(inner, f"{prefix}{name}.")
        return paths
    return walk(Recipe, "")


def load_recipe(spec: str, overrides: list[str] | None = None) -> LoadedRecipe:
    """Load, override and validate a recipe. Errors name the file, step and field."""
    name, text = read_recipe_text(spec)
    data = load_yaml(text, file=name)
    if not isinstance(data, dict):
        raise RecipeError("a recipe is a YAML mapping (version, name, model, modifiers, output)", file=name)
    data = copy.deepcopy(data)
    applied = list(overrides or [])
    for assignment in applied:
        apply_override(data, assignment, name)
    if applied:
        data["overrides"] = list(data.get("overrides") or []) + applied
    return LoadedRecipe(recipe_from_dict(data, file=name), name, text)


def diff_recipes(old: Recipe, new: Recipe) -> list[str]:
    """Semantic difference: changed top-level fields, steps added/removed, parameters changed.

    Steps are aligned by name in order (longest common subsequence of step names).
    """
    lines: list[str] = []
    a, b = recipe_to_dict(old), recipe_to_dict(new)
    for key in a:
        if key != "modifiers":
            lines += _diff_values(key, a[key], b[key])
    old_steps, new_steps = a["modifiers"], b["modifiers"]
    names_a = [next(iter(s)) for s in old_steps]
    names_b = [next(iter(s)) for s in new_steps]
    for tag, i, j in _align(names_a, names_b):
        if tag == "removed":
            lines.append(f"- step {i} {names_a[i]} removed")
        elif tag == "added":
            lines.append(f"+ step {j} {names_b[j]} added {new_steps[j][names_b[j]]}")
        else:
            for line in _diff_values(f"step {j} {names_b[j]}", old_steps[i][names_a[i]],
                                     new_steps[j][names_b[j]]):
                lines.append(line)
    return lines


def _diff_values(path: str, old: Any, new: Any) -> list[str]:
    if isinstance(old, dict) and isinstance(new, dict):
        out: list[str] = []
        for key in list(old) + [k for k in new if k not in old]:
            out += _diff_values(f"{path}.{key}", old.get(key), new.get(key))
        return out
    return [] if old == new else [f"~ {path}: {old!r} -> {new!r}"]


def _align(a: list[str], b: list[str]) -> list[tuple[str, int, int]]:
    """LCS alignment of two name lists into (kept|removed|added, i, j) operations."""
    n, m = len(a), len(b)
    table = [[0] * (m + 1) for _ in range(n + 1)]
    for i in range(n - 1, -1, -1):
        for j in range(m - 1, -1, -1):
            table[i][j] = table[i + 1][j + 1] + 1 if a[i] == b[j] else max(table[i + 1][j], table[i][j + 1])
    ops, i, j = [], 0, 0
    while i < n or j < m:
        if i < n and j < m and a[i] == b[j]:
            ops.append(("kept", i, j))
            i, j = i + 1, j + 1
        elif j < m and (i == n or table[i][j + 1] >= table[i + 1][j]):
            ops.append(("added", i, j))
            j += 1
        else:
            ops.append(("removed", i, j))
            i += 1
    return ops
