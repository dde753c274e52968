"""The model card (``README.md``) of an output directory, made from its report with ``huggingface_hub``'s own
``ModelCard`` / ``ModelCardData`` (the YAML metadata the hub reads, then a Markdown body).

The metadata: ``base_model`` (the hub id: a hub source's, a builtin alias's, or the one an output used as
the source carries; none otherwise), ``base_model_relation: quantized``
when a step reports a number ``format`` (the hub's relations are adapter, merge, quantized and finetune;
removing or merging layers is none of them, so a structural recipe states none), ``library_name:
transformers``, the tag ``recipe`` naming this tool, ``pipeline_tag: text-generation``, the source's
license and ``model-index`` results of every perplexity and zero-shot score the run measured. The body: the
steps in order, sizes before and after, the number format, the evaluation, the calibration data, how to
load it and the command that reproduces it. The card is made to be published: no absolute path of this
machine goes into it (files by their names), and every string it shows is escaped for Markdown.
"""
from __future__ import annotations

import json
import os
import shlex
from pathlib import Path
from typing import Any

from ..errors import RecipeError
from ..formats import file_exporter, source_formats
from ..paths.targets import replace_text
from ..recipe.files import load_recipe
from ..recipe.registry import RegistryError
from ..sources.record import CARD_FILE, hub_origin
from ..system.cleanup import MARKER
from ..system.file_kinds import special_kind
from .evaluation import Evaluation, GenerationResult, PerplexityResult, Retained, ZeroShotResult
from .extras import EXTRAS_JSON
from .report import ModelRecord, Report, is_recipe_output, load_report

#: The tag that names this tool on the hub.
TOOL_TAG = "recipe"


#: Characters that Markdown reads as markup inside a line (a table cell's ``|`` included).
_MARKUP = str.maketrans({**{c: "\\" + c for c in "\\`*[]|"}, "<": "&lt;", ">": "&gt;", "&": "&amp;"})


def md(value: Any) -> str:
    """``value`` as literal Markdown text on one line (a table cell): whitespace runs, newlines included,
    become one space; markup characters are escaped, a leading ``#`` too."""
    text = " ".join(str(value).split()).translate(_MARKUP)
    return "\\" + text if text.startswith("#") else text


def code(value: Any) -> str:
    """``value`` for an inline code span in a table cell: one line, no backtick, ``|`` escaped."""
    return " ".join(str(value).split()).replace("`", "").replace("|", "\\|")


def public(value: str) -> str:
    """A path as the card shows it: an absolute (or ``~``) path by its file name, anything else unchanged."""
    text = str(value)
    return Path(text).name if os.path.isabs(os.path.expanduser(text)) else text


def base_model(model: ModelRecord) -> str | None:
    """The hub id the card names as ``base_model`` (the report's, else found from its model record)."""
    return model.base_model or hub_origin(model.spec, model.kind, model.location)


def source_name(model: ModelRecord) -> str:
    """How the body names the source: its hub id, else the alias, the model file's or the directory's name."""
    known = base_model(model)
    if known or model.kind in ("builtin", "in-memory"):
        return known or model.spec
    path = Path(model.spec).expanduser()
    return path.stem if model.kind in source_formats() else path.resolve().name


def _params(params: dict[str, Any]) -> str:
    """``key=value, ...`` for a code span in a table cell (a path by its name)."""
    shown = lambda value: public(value) if isinstance(value, str) else value
    return code(", ".join(f"{key}={json.dumps(shown(value), default=str)}" for key, value in params.items()) or "-")


def _description(directory: Path) -> str:
    """The recipe's ``description`` from the output's resolved ``recipe.yaml`` ("" when it has none)."""
    try:
        return load_recipe(str(directory / "recipe.yaml")).recipe.description
    except (RecipeError, RegistryError):  # one this engine no longer reads: the card does without it
        return ""


def _steps(report: Report, directory: Path) -> list[str]:
    """The steps' table, then each step's headline and the log file it wrote."""
    lines = ["| # | step | parameters | layers after | seconds |", "|---|---|---|---|---|"]
    for step in report.steps:
        lines.append(f"| {step.index} | `{code(step.modifier)}` | `{_params(step.params)}` | {step.layers_after} | "
                     f"{step.wall_s:.1f} |")
    notes = []
    for step in report.steps:
        if step.result.get("headline"):
            notes.append(f"- step {step.index} {md(step.modifier)}: {md(step.result['headline'])}")
        if step.result.get("table"):
            notes += _result_table(step.result["table"])
        if step.result.get("log") and (directory / step.result["log"]).is_file():
            notes.append(f"- step {step.index} {step.modifier} logged each layer in [`{step.result['log']}`]"
                         f"({step.result['log']})")
    notes += [f"- note: {md(note)}" for note in report.notes]
    return lines + ([""] + notes if notes else [])


def _result_table(table: dict[str, list]) -> list[str]:
    """A step result's ``table`` (``columns``, ``rows``) as an indented Markdown table under its headline."""
    lines = ["", "  | " + " | ".join(md(c) for c in table["columns"]) + " |",
             "  |" + "---|" * len(table["columns"])]
    lines += ["  | " + " | ".join(md(cell) for cell in row) + " |" for row in table["rows"]]
    return lines + [""]


def _sizes(report: Report) -> list[str]:
    before, after = report.before, report.after
    return ["| | before | after | ratio |", "|---|---|---|---|",
            f"| decoder layers | {before.layers} | {after.layers} | {after.layers / before.layers:.3f} |",
            f"| parameters | {before.parameters:,} | {after.parameters:,} | "
            f"{after.parameters / before.parameters:.3f} |"]


def _formats(report: Report) -> list[str]:
    return [f"- step {s.index} {md(s.modifier)}: {md(s.result['format'])}" for s in report.steps
            if s.result.get("format")]


def _ppl_row(name: str, before: PerplexityResult | None, after: PerplexityResult | None, kept: float | None) -> str:
    value = lambda r: f"{r.ppl:.2f}" if r else "-"
    return f"| {name} | {value(before)} | {value(after)} | {f'{kept:.1%}' if kept is not None else '-'} |"


def _task_rows(label: str, before: ZeroShotResult | GenerationResult | None,
               after: ZeroShotResult | GenerationResult | None, retained: float | None) -> list[str]:
    """One row per task (zero-shot accuracy, generation pass@1 or exact match) and the average's row."""
    if not before:
        return []
    lines = []
    for task, result in before.tasks.items():
        value = after.value_of(task) if after else None
        lines.append(f"| {md(task)} {md(result.metric)} | {result.value:.4f} | "
                     f"{'-' if value is None else f'{value:.4f}'} | |")
    average = after.average if after else None
    lines.append(f"| {label} average | {before.average:.4f} | {'-' if average is None else f'{average:.4f}'} | "
                 f"{'-' if retained is None else f'{retained:.1%}'} |")
    return lines


def _evaluation(report: Report) -> list[str]:
    evaluation = report.evaluation
    if evaluation is None:
        return []
    before, after, kept = evaluation.before, evaluation.after or Evaluation(), evaluation.retained or Retained()
    lines = ["| metric | before | after | retained |", "|---|---|---|---|"]
    if before.perplexity:
        ppl = before.perplexity
        name = f"perplexity, {md(public(ppl.dataset))} ({ppl.windows} × {ppl.seq_len} tokens)"
        lines.append(_ppl_row(name, ppl, after.perplexity, kept.perplexity))
    lines += _task_rows("zero-shot", before.zero_shot, after.zero_shot, kept.zero_shot)
    lines += _task_rows("generation", before.generation, after.generation, kept.generation)
    retained = "retained: dense perplexity / compressed perplexity; accuracy, pass@1 or exact match after / before"
    gate = f"; quality gate {evaluation.quality_gate}" if evaluation.quality_gate else ""
    return lines + ["", f"Measured by this run ({retained}{gate}; `report.json`, `evaluation`)."]


def _later(evaluations: list[dict]) -> list[str]:
    """Rows of ``recipe eval --json`` records of this output (``recipe card --eval``)."""
    lines = ["| evaluated | perplexity | zero-shot average | generation |", "|---|---|---|---|"]
    for record in evaluations:
        measured = Evaluation.from_json(record)
        ppl, zero, generation = measured.perplexity, measured.zero_shot, measured.generation
        text = f"{ppl.ppl:.2f} ({md(public(ppl.dataset))}, {ppl.windows} × {ppl.seq_len} tokens)" if ppl else "-"
        average = f"{zero.average:.4f}" if zero else "-"
        generated = ", ".join(f"{md(task)} {md(r.metric)} {r.value:.4f}" for task, r in
                              generation.tasks.items()) if generation else "-"
        lines.append(f"| {md(record.get('date', '-'))} | {text} | {average} | {generated} |")
    return lines


def _calibration(report: Report) -> list[str]:
    data = report.data
    names = data.dataset if isinstance(data.dataset, list) else [data.dataset]
    origins = [public(path) + where + rest
               for path, where, rest in (origin.partition(" [") for origin in data.origin.split("; "))]
    return [f"- source: {md(', '.join(public(name) for name in names))} (read from `{code('; '.join(origins))}`)",
            f"- {data.samples} windows × {data.seq_len} tokens, sampled with seed {data.seed} "
            f"({data.tokens_available:,} tokens available)",
            f"- fingerprint (sha256 of the windows' int64 token ids): `{data.fingerprint}`",
            *_self_generated(data.generated)]


def _self_generated(generated: dict | None) -> list[str]:
    if not generated:
        return []
    how = "greedy" if generated["temperature"] == 0 else f"sampled at temperature {generated['temperature']}"
    return [f"- written by the dense model itself: each window's first {generated['prompt_tokens']} tokens from the "
            f"source as a prompt, the other {generated['new_tokens']} generated ({how}, seed {generated['seed']})"]


def _packed(directory: Path) -> str | None:
    """The checkpoint's ``quantization_config.quant_method`` (packed weights), else None."""
    config = directory / "config.json"
    return (json.loads(config.read_text()).get("quantization_config") or {}).get("quant_method") \
        if config.is_file() else None


def _loading(report: Report, directory: Path) -> list[str]:
    packed = _packed(directory)
    stock = ["```python", "from transformers import AutoModelForCausalLM, AutoTokenizer", "",
             'model = AutoModelForCausalLM.from_pretrained("path/to/this/directory")',
             'tokenizer = AutoTokenizer.from_pretrained("path/to/this/directory")', "```"]
    lines = ["A standard checkpoint of the source's architecture class: stock `from_pretrained` loads it.", ""]
    if packed:
        package = "gptqmodel" if packed == "gptq" else "compressed-tensors"
        lines = [f"Weights are packed ({packed}): stock `from_pretrained` loads them with `pip install "
                 f"{package}`; vLLM and SGLang serve the directory as is.", ""]
    lines += stock
    extras = directory / EXTRAS_JSON
    if extras.is_file():
        names = sorted({entry["modifier"] for entry in json.loads(extras.read_text())})
        lines += ["", f"This output also carries non-stock additions ({', '.join(names)}; `{EXTRAS_JSON}`) that "
                      f"stock `from_pretrained` ignores: load it with the recipe engine to get the model as measured:",
                  "", "```python", "import recipe_engine", "",
                  'model, tokenizer = recipe_engine.load_model("path/to/this/directory")', "```"]
    if report.export is not None:
        lines += ["", file_exporter(report.export.format).card_line(report.export)]
    return lines


def reproduce_command(report: Report) -> str:
    """The ``recipe apply`` command line that made this output (the recipe file and its overrides)."""
    recipe = report.recipe
    file = public(recipe.file) if recipe.file != "<python>" else "recipe.yaml"
    overrides = [f"{key}{sep}{public(value.strip(chr(39) + chr(34)))}" if sep else key
                 for key, sep, value in (o.partition("=") for o in recipe.overrides)]
    return " ".join(["recipe apply", shlex.quote(file), *(f"--set {shlex.quote(o)}" for o in overrides)])


def _reproduce(report: Report) -> list[str]:
    recipe, git = report.recipe, report.recipe.git
    where = f" at commit `{git['commit']}`{' (with uncommitted changes)' if git.get('dirty') else ''}" if git else ""
    versions = ", ".join(f"{name} {version}" for name, version in sorted(report.packages.items()))
    return ["```bash", reproduce_command(report), "```", "",
            f"Recipe file `{code(public(recipe.file))}`{where}, sha256 `{recipe.sha256}`. The resolved recipe (every "
            f"default and override filled in) is `recipe.yaml` here: `recipe apply recipe.yaml` runs the same recipe. "
            f"Computed on {report.device} in {report.dtype} with {versions}."]


def _eval_results(report: Report, evaluations: list[dict]):
    """``model-index`` entries: every perplexity, zero-shot and generation score measured on this output."""
    # deferred: the hub client loads only where a card is written
    from huggingface_hub import EvalResult

    measured = [report.evaluation.after] if report.evaluation is not None and report.evaluation.after else []
    results = []
    for evaluation in measured + [Evaluation.from_json(record) for record in evaluations]:
        ppl = evaluation.perplexity
        if ppl:
            dataset = " ".join(public(ppl.dataset).split())  # one line, as in the body
            results.append(EvalResult(task_type="text-generation", dataset_type=dataset,
                                      dataset_name=dataset, metric_type="perplexity",
                                      metric_value=round(ppl.ppl, 4)))
        tasks = {**(evaluation.zero_shot.tasks if evaluation.zero_shot else {}),
                 **(evaluation.generation.tasks if evaluation.generation else {})}
        for task, result in tasks.items():
            task, metric = " ".join(task.split()), " ".join(result.metric.split())
            results.append(EvalResult(task_type="text-generation", dataset_type=task, dataset_name=task,
                                      metric_type=metric, metric_value=round(result.value, 4)))
    return results


def model_card(report: Report, directory: str | Path, evaluations: list[dict] = ()):
    """The ``huggingface_hub.ModelCard`` of an output directory written from ``report`` (its files are read
    for the loading notes); ``evaluations``: ``recipe eval --json`` records of it, shown too."""
    # deferred: the hub client loads only where a card is written
    from huggingface_hub import ModelCard, ModelCardData

    directory = Path(directory)
    quantized = any(step.result.get("format") for step in report.steps)
    tags = [TOOL_TAG, "compressed"] + ([_packed(directory)] if _packed(directory) else [])
    results = _eval_results(report, list(evaluations))
    data = ModelCardData(base_model=base_model(report.model), library_name="transformers", tags=tags,
                         pipeline_tag="text-generation", license=report.model.license,
                         model_name=report.recipe.name if results else None, eval_results=results or None,
                         **({"base_model_relation": "quantized"} if quantized else {}))
    size = report.after.parameters / report.before.parameters
    description = _description(directory)
    body = [f"# {md(report.recipe.name)}", "", *([description, ""] if description else []),
            f"`{code(source_name(report.model))}` compressed by `recipe apply` (recipe-engine, the recipe "
            f"`{code(report.recipe.name)}`): {report.before.layers} → {report.after.layers} decoder layers, "
            f"{size:.1%} of the parameters.", "",
            "## What was done", "", "Steps, in order:", "", *_steps(report, directory), "", *_sizes(report)]
    formats = _formats(report)
    if formats:
        body += ["", "## Quantization format", "", *formats]
    if report.evaluation is not None or evaluations:
        body += ["", "## Evaluation", ""]
        body += _evaluation(report) + ([""] if report.evaluation is not None and evaluations else [])
        body += (["Evaluated later (`recipe eval --json`):", "", *_later(list(evaluations))] if evaluations else [])
    body += ["", "## Calibration data", "", *_calibration(report), "", "## How to load", "",
             *_loading(report, directory), "", "## Reproduce", "", *_reproduce(report), ""]
    return ModelCard(f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(body))


def check_card_target(directory: str | Path, force: bool = False) -> Path:
    """Pre-flight of ``recipe card``: the ``README.md`` it would replace is ours (the directory is a recipe
    output, or ``force``) and a regular file or absent (never a directory, a link or a device node), and the
    directory takes a new entry. Returns the card's path."""
    root = Path(directory).expanduser()
    fail = lambda message: RecipeError(f"recipe card {directory}: {message}")
    if not root.is_dir():
        raise fail("not a directory" if root.exists() else "no such directory")
    if not force and not is_recipe_output(root):
        raise fail(f"not a recipe output (no complete {MARKER}); its {CARD_FILE} is not replaced (--force writes "
                   f"the card anyway)")
    target = root / CARD_FILE
    kind = ("a symbolic link" if target.is_symlink() else special_kind(target)
            or ("a directory" if target.is_dir() else None))
    if kind:
        raise fail(f"{CARD_FILE} is {kind}; not replaced (move it away first)")
    if not os.access(root, os.W_OK | os.X_OK):
        raise fail(f"cannot write {CARD_FILE}: the directory is read-only")
    return target


def write_card(directory: str | Path, report: Report | None = None, evaluations: list[dict] = ()) -> Path:
    """Write ``README.md`` into ``directory`` atomically (a temporary file renamed into place); ``report``:
    its ``report.json`` when not given. Returns the card's path; a failed write is one line."""
    directory = Path(directory)
    report = report if report is not None else load_report(directory)
    card = model_card(report, directory, evaluations)
    target = directory / CARD_FILE
    try:
        replace_text(target, str(card))
    except OSError as exc:
        raise RecipeError(f"cannot write {target}: {exc.strerror or exc}") from None
    return target
