"""``recipe sweep``: recipes at a grid of parameter values, evaluated, tabled and plotted (Pareto front).

Every variant is the recipe with CLI-style overrides (``--vary PATH=v1,v2``; a bare field such as ``n``
means the one step of each recipe that sets it). Work that does not depend on the varied values is done
once: the dense model is loaded once per (model, dtype) and copied per variant, and each (model, dtype,
calibration) shares a ``recipe_engine.execution.memo.SharedWork`` (calibration capture, FlattenAdjacent's
similarity, ShortGPT's block influence). Rows go to ``DIR/sweep.json`` as each variant finishes (atomic
replace), so an interrupted sweep keeps its rows and a rerun skips variants whose resolved recipe sha
and evaluation settings are already there (another ``--eval-limit`` or task list evaluates again).
"""
from __future__ import annotations

import copy
import hashlib
import itertools
import json
import os
import time
from pathlib import Path
from typing import Any

import yaml
from rich.table import Table

from ..architectures.adapters import count_parameters
from ..errors import RecipeError
from ..evaluation import evaluate_model
from ..execution.memo import SharedWork
from ..records.evaluation import Evaluation, ZeroShotResult
from ..sources.models import load_model
from ..sources.devices import resolve_device
from ..paths.output import SWEEP_FILE, SWEEP_KIND
from ..paths.targets import replace_text
from ..paths.lock import output_lock
from ..plan.preflight import check_calibration, check_evaluation, check_model, check_recipe, check_sweep_output
from ..recipe.files import load_recipe, yaml_scalar
from ..recipe.schema import EvaluateConfig, PerplexityConfig, dump_recipe, safe_load, yaml_problem
from ..system.cleanup import read_marker, write_marker
from ..system.progress import Progress
from .runner import apply


def parse_vary(text: str) -> tuple[str, list[Any]]:
    """``modifiers.1.n=2,4,6`` → ``("modifiers.1.n", [2, 4, 6])`` (values are YAML scalars)."""
    path, sep, values = text.partition("=")
    if not sep or not path.strip() or not values.strip():
        raise RecipeError(f"--vary {text!r}: expected PATH=v1,v2,... (e.g. modifiers.1.n=2,4,6 or n=2,4,6)")
    try:
        return path.strip(), [safe_load(v.strip()) for v in values.split(",")]
    except yaml.YAMLError as exc:
        raise RecipeError(f"--vary {text!r}: a value is not valid YAML: {yaml_problem(exc)}") from None


def resolve_path(recipe, path: str, file: str) -> str:
    """A bare field name → ``modifiers.I.field`` of the one step that sets it (not null)."""
    if "." in path:
        return path
    owners = [i for i, step in enumerate(recipe.modifiers) if getattr(step, path, None) is not None]
    if len(owners) != 1:
        raise RecipeError(f"--vary {path}: {len(owners)} steps set '{path}' (need exactly one; give "
                          f"modifiers.I.{path})", file=file)
    return f"modifiers.{owners[0]}.{path}"


def variants(spec: str, vary: list[tuple[str, list[Any]]], overrides: list[str] = ()) -> list[tuple[dict, Any]]:
    """``(params, resolved recipe)`` for every combination of the varied values (validated now); ``overrides``
    (``--set``) apply to every variant first."""
    base = load_recipe(spec, list(overrides))
    paths = [resolve_path(base.recipe, path, base.path) for path, _ in vary]
    repeated = next((given for (given, _), path in zip(vary, paths) if paths.count(path) > 1), None)
    if repeated is not None:  # the later values would silently replace the earlier ones in every variant
        raise RecipeError(f"--vary {repeated}: '{paths[[g for g, _ in vary].index(repeated)]}' is varied twice; "
                          f"give all its values in one --vary", file=base.path)
    out = []
    for values in itertools.product(*(v for _, v in vary)):
        params = dict(zip(paths, values))
        sets = [f"{p}={yaml_scalar(v) if isinstance(v, str) else json.dumps(v)}" for p, v in params.items()]
        out.append((params, load_recipe(spec, [*overrides, *sets]).recipe))
    return out


def evaluation_config(recipe, limit: int | None, tasks: list[str] | None):
    config = recipe.evaluate or EvaluateConfig()
    ppl = config.perplexity or PerplexityConfig()
    return config.model_copy(update={
        "perplexity": ppl.model_copy(update={"limit": limit or ppl.limit}),
        "tasks": list(tasks) if tasks is not None else config.tasks,
        "limit": limit or config.limit, "min_retained": None})


def recipe_sha(recipe) -> str:
    return hashlib.sha256(dump_recipe(recipe.model_copy(update={"output": "-", "overrides": []})).encode()).hexdigest()


def summarize(model, evaluation: Evaluation) -> dict[str, Any]:
    """A row's sizes and scores (``sweep.json``: the perplexity, the zero-shot section's JSON)."""
    zero = evaluation.zero_shot
    return {"layers": model.config.num_hidden_layers, "parameters": count_parameters(model),
            "ppl": evaluation.perplexity.ppl if evaluation.perplexity else None,
            "zero_shot": zero.to_json() if zero else None}


class Sweep:
    """One sweep into ``output``; ``run`` returns every row (earlier rows of the same file included)."""

    def __init__(self, specs: list[str], vary: list[str], output: str, eval_limit: int | None = None,
                 tasks: list[str] | None = None, progress: bool = False, overrides: list[str] = ()):
        self.specs, self.vary = specs, [parse_vary(v) for v in vary]
        self.output, self.eval_limit, self.tasks, self.progress = Path(output), eval_limit, tasks, progress
        self.given = output  # as named: an empty name is refused, not read as the current directory
        self.overrides = list(overrides)
        self.models: dict[tuple, tuple] = {}
        self.memos: dict[str, Any] = {}
        self.rows: list[dict[str, Any]] = []

    def _load_rows(self) -> None:
        path = self.output / SWEEP_FILE
        self.rows = json.loads(path.read_text())["rows"] if path.is_file() else []

    def _save(self) -> None:
        self.output.mkdir(parents=True, exist_ok=True)
        if read_marker(self.output) is None:
            write_marker(self.output, SWEEP_KIND, "complete")
        replace_text(self.output / SWEEP_FILE, json.dumps({"vary": [[p, v] for p, v in self.vary],
                                                           "rows": self.rows}, indent=2))

    def _dense(self, recipe):
        key = (recipe.model, recipe.dtype)
        if key not in self.models:
            model, tokenizer, _ = load_model(recipe.model, recipe.dtype)
            self.models[key] = (model, tokenizer)
        return self.models[key]

    def memo_for(self, recipe):
        key = json.dumps([recipe.model, recipe.dtype, recipe.calibration.model_dump(mode="json")])
        return self.memos.setdefault(key, SharedWork())

    def run(self) -> list[dict[str, Any]]:
        planned = [(spec, params, recipe) for spec in self.specs
                   for params, recipe in variants(spec, self.vary, self.overrides)]
        self.check(planned)
        with output_lock(self.output):
            return self._run(planned)

    def check(self, planned: list[tuple[str, dict, Any]]) -> None:
        """``apply``'s pre-flight for every variant before the first model is loaded (``preflight``): the
        output directory, each variant's device, model config, steps on the symbolic shape, calibration text
        and evaluation (tasks, perplexity text); each distinct model, calibration and evaluation once."""
        texts = {name for _, _, recipe in planned for name in recipe.calibration.sources}
        check_sweep_output(self.given, [*self.specs, *{recipe.model for _, _, recipe in planned}, *texts])
        configs: dict[str, Any] = {}
        checked: set[str] = set()
        for spec, _, recipe in planned:
            if recipe.model not in configs:
                configs[recipe.model] = check_model(recipe.model, spec)
            check_recipe(recipe.model_copy(update={"evaluate": None}), spec, configs[recipe.model])
            calibration = json.dumps(recipe.calibration.model_dump(mode="json"), sort_keys=True)
            if calibration not in checked:
                check_calibration(recipe.calibration, spec)
                checked.add(calibration)
            evaluation = evaluation_config(recipe, self.eval_limit, self.tasks)
            key = json.dumps(evaluation.model_dump(mode="json"), sort_keys=True)
            if key not in checked:
                check_evaluation(evaluation, spec)
                checked.add(key)

    def _run(self, planned: list[tuple[str, dict, Any]]) -> list[dict[str, Any]]:
        self._load_rows()
        done = {(row["recipe_sha256"], row.get("evaluation_sha256")) for row in self.rows}
        for spec, params, recipe in planned:
            evaluation = evaluation_config(recipe, self.eval_limit, self.tasks)
            evaluated = hashlib.sha256(json.dumps(evaluation.model_dump(mode="json")).encode()).hexdigest()
            dense_key = hashlib.sha256(json.dumps([recipe.model, recipe.dtype]).encode()).hexdigest()
            device = resolve_device(recipe.device)
            if (dense_key, evaluated) not in done:
                model, tokenizer = self._dense(recipe)
                start = time.perf_counter()
                result = self._evaluate(model, tokenizer, evaluation, device, f"evaluating dense {recipe.model}")
                self._add({"recipe": "dense", "file": None, "recipe_sha256": dense_key,
                           "evaluation_sha256": evaluated, "model": recipe.model, "params": {},
                           **summarize(model, result), "compress_s": 0.0,
                           "eval_s": time.perf_counter() - start}, done)
            sha = recipe_sha(recipe)
            if (sha, evaluated) in done:
                continue
            model, tokenizer = self._dense(recipe)
            start = time.perf_counter()
            pruned, report = apply(recipe.model_copy(update={"evaluate": None}), model=copy.deepcopy(model),
                                   tokenizer=tokenizer, write=False, progress=self.progress,
                                   memo=self.memo_for(recipe))
            compress = time.perf_counter() - start
            start = time.perf_counter()
            result = self._evaluate(pruned, tokenizer, evaluation, device, f"evaluating {recipe.name} {params}")
            self._add({"recipe": recipe.name, "file": spec, "recipe_sha256": sha, "evaluation_sha256": evaluated,
                       "model": recipe.model,
                       "params": params, **summarize(pruned, result), "compress_s": compress,
                       "eval_s": time.perf_counter() - start,
                       "peak_rss_mib": report.peak_memory.rss_mib}, done)
            del pruned
        return self.rows

    def _evaluate(self, model, tokenizer, evaluation, device, label: str) -> Evaluation:
        """``evaluate_model`` with its own progress display (``apply`` holds one while it compresses)."""
        with Progress(enabled=self.progress) as bar:
            bar.phase(label, evaluating=True)
            return evaluate_model(model, tokenizer, evaluation, device, bar)

    def _add(self, row: dict[str, Any], done: set[tuple]) -> None:
        self.rows.append(row)
        done.add((row["recipe_sha256"], row["evaluation_sha256"]))
        self._save()

    def shared_work(self) -> dict[str, dict[str, int]]:
        """label → {"computed": n, "reused": m}, summed over this process's memos."""
        out: dict[str, dict[str, int]] = {}
        for memo in self.memos.values():
            for label in set(memo.computed) | set(memo.reused):
                entry = out.setdefault(label, {"computed": 0, "reused": 0})
                entry["computed"] += memo.computed[label]
                entry["reused"] += memo.reused[label]
        return out


def mean_accuracy(row: dict[str, Any]) -> float | None:
    """Mean over tasks of each task's headline metric (acc_norm when reported, else acc): the row's zero-shot
    section read back."""
    zero = row.get("zero_shot")
    return ZeroShotResult.from_json(zero).average if zero else None


def pareto_front(points: list[tuple[float, float]]) -> list[int]:
    """Indices of points no other point beats in both (fewer parameters, lower value); by parameters."""
    order = sorted(range(len(points)), key=lambda i: (points[i][0], points[i][1]))
    front, best = [], float("inf")
    for i in order:
        if points[i][1] < best:
            front.append(i)
            best = points[i][1]
    return front


def plot(rows: list[dict[str, Any]], path: Path) -> str | None:
    """``pareto.png``: PPL (and mean zero-shot accuracy when measured) vs parameters, one line per recipe,
    the Pareto front circled. Returns why not written when matplotlib is missing."""
    try:
        # deferred: matplotlib is needed only to draw a plot
        import matplotlib
    except ImportError:
        return "pareto.png not written: matplotlib is not installed (pip install matplotlib)"
    matplotlib.use("Agg")
    # deferred: as above
    import matplotlib.pyplot as plt

    accuracy = [mean_accuracy(r) for r in rows]
    panels = [("WikiText-2 PPL (lower is better)", [r["ppl"] for r in rows], 1)]
    if any(a is not None for a in accuracy):
        panels.append(("mean zero-shot accuracy (higher is better)", accuracy, -1))
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.8), squeeze=False)
    for ax, (label, values, sign) in zip(axes[0], panels):
        names = list(dict.fromkeys(r["recipe"] for r in rows))
        for name in names:
            mine = sorted((r["parameters"] / 1e6, v) for r, v in zip(rows, values) if r["recipe"] == name
                          and v is not None)
            if mine:
                ax.plot(*zip(*mine), marker="*" if name == "dense" else "o", markersize=12 if name == "dense" else 5,
                        label=name)
        points = [(r["parameters"], sign * v) for r, v in zip(rows, values) if v is not None]
        kept = [(r, v) for r, v in zip(rows, values) if v is not None]
        front = [kept[i] for i in pareto_front(points)]
        ax.scatter([r["parameters"] / 1e6 for r, _ in front], [v for _, v in front], s=120, facecolors="none",
                   edgecolors="black", label="Pareto front")
        ax.set_xlabel("parameters (M)")
        ax.set_ylabel(label)
        if sign > 0:
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:  # renamed into place, as every file we write
        fig.savefig(temporary, dpi=110, format="png")
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)
    plt.close(fig)
    return None


def table(rows: list[dict[str, Any]]):
    out = Table(title="recipe sweep", title_justify="left")
    for column in ("recipe", "params", "layers", "parameters", "PPL", "zero-shot", "compress s"):
        out.add_column(column, justify="left" if column in ("recipe", "params") else "right")
    for row in rows:
        accuracy = mean_accuracy(row)
        out.add_row(row["recipe"], ", ".join(f"{k.split('.')[-1]}={v}" for k, v in row["params"].items()),
                    str(row["layers"]), f"{row['parameters'] / 1e6:.1f}M",
                    "-" if row["ppl"] is None else f"{row['ppl']:.2f}",
                    "-" if accuracy is None else f"{accuracy:.3f}", f"{row['compress_s']:.1f}")
    return out
