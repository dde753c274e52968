"""The checks every command runs before it loads a model or reads a weight: one set of rules for all.

``recipe apply`` and ``recipe validate`` check a recipe with :func:`check_recipe` (``validate`` with
``here=False``: a CUDA recipe validates on a laptop); ``recipe sweep`` checks every variant with it before the
first load; ``recipe eval`` checks its device, model and evaluation with :func:`check_device`,
:func:`check_model` and :func:`check_evaluation`, ``recipe bench`` its device and models. Outputs:
:func:`output.check_output_free` (``apply``'s directory), :func:`output.check_file_output` (``export``'s file),
:func:`check_sweep_output` (``sweep``'s directory), all on the one rule of ``recipe_engine.paths.targets`` (which
also checks ``--timings``, ``--profile`` and ``--json``); each writer then holds the output's lock
(``recipe_engine.paths.lock``) until its output is in place.

A recipe's steps are checked by compiling it once (``compiled.compile_plan``, in :func:`check_plan`): the
:class:`~recipe_engine.plan.compiled.Plan` it returns is what ``validate`` reports, what ``apply`` runs
(:func:`preflight_apply` adds the disk-room check and the streaming decision) and what ``sweep`` checks.

Every refusal is one :class:`~recipe_engine.errors.RecipeError` line (exit code 2) naming the recipe file and
field where there is one; nothing is written before these checks pass.
"""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import torch

from ..architectures.adapters import adapter_for
from ..architectures.shape import ModelShape
from ..errors import RecipeError, SourceError
from ..evaluation.registry import check_tasks
from ..sources.text import check_text, is_hub_source, load_text
from ..formats import file_export, file_exporter
from ..sources.sizes import exceeds_memory
from ..sources.models import load_config, require_weights
from ..sources.devices import parse_device, resolve_device
from ..paths.output import SWEEP_FILE, SWEEP_KIND, space_problem
from ..paths.targets import name_problem
from ..paths.targets import Target, check_target, marked
from ..recipe.schema import Recipe
from .compiled import Plan, compile_plan
from .estimates import plan_output_bytes

#: Fields of a recipe that :func:`check_evaluation` names.
RECIPE_FIELDS = {"tasks": "evaluate.tasks", "dataset": "evaluate.perplexity.dataset"}


def check_export_source(recipe: Recipe, config, file: str | None) -> None:
    """What the recipe's file format needs of its model source (``Exporter.check_source``); an unknown format is
    left to :func:`check_plan`, which names the field."""
    try:
        exporter = file_exporter(recipe.export.format)
    except RecipeError:
        return
    located(lambda: exporter.check_source(recipe.model, config), file, "export")


def check_device(name: str, here: bool = True):
    """The ``torch.device`` for ``name``: supported (auto, cpu, cuda, cuda:i) and, with ``here``, present
    on this machine (``models.resolve_device``); without ``here`` only its form is checked (None for auto)."""
    if here:
        return resolve_device(name)
    return None if name == "auto" else parse_device(name)


def check_model(spec: str, file: str | None = None, weights: bool = True):
    """The model's config, read without its weights (a missing path, an unknown hub id offline: one line),
    and its checkpoint's tensors agreeing with it (``checkpoint_reader.check_checkpoint``); with ``weights`` a local
    directory must hold weights (without: a config alone validates a recipe)."""
    config = located(lambda: load_config(spec), file, "model")
    if weights:
        located(lambda: require_weights(spec), file, "model")
    return config


def check_evaluation(config, file: str | None = None, fields: dict[str, str] | None = RECIPE_FIELDS,
                     unchecked: list[str] | None = None) -> None:
    """An ``evaluate:`` block (``schema.EvaluateConfig``; None: nothing) can run: every zero-shot task has a
    config (did-you-mean for a near miss) and its rows can be read, and one of the perplexity text sources
    is available and holds at least one window. ``fields`` name the recipe fields in the message (None for
    command-line options, whose message names the value, and whose opt-in to run model-written code is
    ``recipe eval``'s ``--allow-code-execution``); ``unchecked`` collects what could not be checked here
    (``data.check_text``'s notes)."""
    if config is None:
        return

    fields = fields or {}
    option = None if fields else "--allow-code-execution"  # a recipe's opt-in is its field (or --set)
    located(lambda: check_tasks(config, option), file, fields.get("tasks"))
    if config.perplexity is not None:
        located(lambda: check_perplexity_text(config.perplexity, unchecked), file, fields.get("dataset"))


def check_perplexity_text(ppl, unchecked: list[str] | None = None) -> None:
    """The first of ``ppl.dataset`` that is available (as ``evaluation.run.first_available_text`` picks it)
    holds one window of ``ppl.seq_len`` tokens (at least as many bytes: a token covers at least one byte).
    A hub source is available when the hub answers (``data.check_text``)."""
    reasons = []
    for name in ppl.dataset:
        try:
            if is_hub_source(name, ppl.split):
                _note(check_text(name, ppl.split, "text", 0), unchecked)
                return
            text = load_text(name, ppl.split)
        except SourceError as exc:
            reasons.append(exc.detail)
            continue
        size = len(text.text.encode("utf-8"))
        if size < ppl.seq_len:
            raise SourceError(f"evaluation text {text.origin}: {size} bytes, shorter than one window of "
                              f"{ppl.seq_len} tokens (a token covers at least one byte)")
        return
    raise SourceError("no evaluation text available: " + "; ".join(reasons))


def check_calibration(cal, file: str | None = None, unchecked: list[str] | None = None) -> None:
    """``recipe validate``'s calibration check (``apply`` reads the same text in full: ``data.load_calibration``);
    ``unchecked`` collects what could not be checked here (a hub source in HF offline mode)."""
    for name, share in zip(cal.sources, cal.shares()):
        _note(located(lambda: check_text(name, cal.split, cal.text_field, share * cal.seq_len), file, None),
              unchecked)


def _note(note: str | None, unchecked: list[str] | None) -> None:
    if note and unchecked is not None and note not in unchecked:
        unchecked.append(note)


def check_recipe(recipe, file: str | None = None, config=None, here: bool = True, calibration: bool = False,
                 unchecked: list[str] | None = None) -> Plan:
    """What ``apply`` and ``validate`` check on a recipe beyond its schema, before any weight is loaded: the
    device (with ``here``: present on this machine), the model's config (``config`` when the model is
    passed in memory), with ``calibration`` the calibration text (``apply`` reads it in full instead:
    ``data.load_calibration``), the evaluation block, and every step on the symbolic shape
    (:func:`check_plan`). Returns the compiled :class:`~recipe_engine.plan.compiled.Plan`; ``unchecked``
    collects what could not be checked here (``data.check_text``'s notes: a hub source in HF offline mode)."""
    located(lambda: check_device(recipe.device, here), file, "device")
    if config is None:
        config = check_model(recipe.model, file, weights=False)
        if recipe.export is not None:
            check_export_source(recipe, config, file)
    if calibration:
        check_calibration(recipe.calibration, file, unchecked)
    check_evaluation(recipe.evaluate, file, unchecked=unchecked)
    check_step_sources(recipe, file)
    return check_plan(recipe, config, file)


def check_step_sources(recipe: Recipe, file: str | None = None) -> None:
    """Every step's own data sources can be read (``Modifier.check_sources``), named by file and step."""
    for index, step in enumerate(recipe.modifiers):
        try:
            step.check_sources()
        except RecipeError as exc:
            raise exc.located(file=file, step=index, modifier=step.step_name()) from None


def validate_recipe(loaded) -> tuple[Plan, list[str]]:
    """``recipe validate``: what ``apply`` checks before loading, except the output path (validate never
    writes) and the devices of this machine (a CUDA recipe validates on a laptop). Returns ``(plan,
    unchecked)``, ``unchecked`` naming what could not be checked here (a hub source in HF offline mode)."""
    unchecked: list[str] = []
    plan = check_recipe(loaded.recipe, loaded.path, here=False, calibration=True, unchecked=unchecked)
    problem = name_problem(Path(loaded.recipe.output).expanduser())
    if problem:
        raise RecipeError(f"output '{loaded.recipe.output}': {problem}", file=loaded.path, field="output")
    return plan, unchecked


def decide_streaming(recipe: Recipe, in_memory: bool, write: bool) -> bool:
    """``stream: on/off`` as given; ``auto`` streams when the checkpoint's weight files exceed half the
    available host memory. A streamed model's weights live only in the output, so streaming needs a
    model from disk and ``write``."""
    if recipe.stream == "off" or in_memory:
        if recipe.stream == "on" and in_memory:
            raise RecipeError("stream: on needs a model from disk, not one passed in memory", field="stream")
        return False
    if not write:
        if recipe.stream == "on":
            raise RecipeError("stream: on writes the result to the output directory; use write=True",
                              field="stream")
        return False
    if recipe.stream == "on":
        return True
    return exceeds_memory(recipe.model)


def preflight_apply(recipe: Recipe, file: str | None, config=None, *, write: bool, writing: bool,
                    keep_checkpoints: bool, resume: bool) -> Plan:
    """``recipe apply``'s pre-flight after the calibration text is read: :func:`check_recipe` (``config``
    for a model passed in memory), ``--resume``'s preconditions, with ``writing`` the disk room
    (:func:`check_free_space`), and the streaming decision, recorded in the returned plan."""
    plan = check_recipe(recipe, file, config)
    in_memory = config is not None
    if not in_memory:
        located(lambda: require_weights(recipe.model), file, "model")
    if resume and (in_memory or not write or not keep_checkpoints):
        why = "a model passed in memory" if in_memory else "write=False" if not write else "--no-checkpoints"
        raise RecipeError(f"--resume is not supported for {why} (no checkpoints are kept)", file=file)
    if writing:  # a model from disk keeps resume checkpoints unless told not to
        check_free_space(plan, file, resume_checkpoints=not in_memory and keep_checkpoints)
    streamed = located(lambda: decide_streaming(recipe, in_memory, write), file)
    if streamed and recipe.calibration.generate is not None:
        raise RecipeError("the model cannot write its calibration windows while streamed from disk (set stream: "
                          "off, or drop calibration.generate)", file=file, field="calibration.generate")
    refusing = next(((i, step) for i, step in enumerate(plan.steps) if streamed and step.refuses_streaming), None)
    if refusing is not None:
        raise RecipeError(f"cannot run streamed: {refusing[1].refuses_streaming} (set stream: off)", file=file,
                          step=refusing[0], modifier=refusing[1].step_name(), field="stream")
    return replace(plan, streamed=streamed)


def check_sweep_output(output: str | Path, inputs=()) -> Path:
    """``recipe sweep --output``: a directory (new, empty, or an earlier sweep's: our marker of
    :data:`SWEEP_KIND`, or a ``sweep.json`` that is a sweep's record) that can take ``sweep.json`` and
    ``pareto.png``, and none of the ``inputs`` (``user_paths``). Returns the path."""
    given = Path(output).expanduser()
    named = str(output).strip() and not name_problem(given)
    if named and given.is_dir() and not given.is_symlink() and (given / SWEEP_FILE).exists() \
            and not is_sweep(given, strict=True):
        raise RecipeError(f"--output {output}: {SWEEP_FILE} is not an earlier sweep's record; move it away or "
                          f"choose another --output")
    sweep = Target("--output", output, directory=True, ours=is_sweep, what="an earlier sweep's directory")
    return check_target(sweep, [i for i in inputs if Path(i).expanduser().exists()])


def is_sweep(directory: Path, strict: bool = False) -> bool:
    """An earlier sweep's directory: our marker of :data:`SWEEP_KIND` (unless ``strict``) or a ``sweep.json``
    holding a record with rows."""
    if not strict and marked(SWEEP_KIND)(directory):
        return True
    try:
        record = json.loads((directory / SWEEP_FILE).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return False
    return isinstance(record, dict) and isinstance(record.get("rows"), list)


def located(check, file: str | None, field: str | None = None):
    """Run ``check``; its one-line error names the recipe file and field (when it names none itself)."""
    try:
        return check()
    except RecipeError as exc:
        raise exc.located(file=file, field=field) from None


def check_free_space(plan: Plan, file: str | None = None, resume_checkpoints: bool = False) -> None:
    """Refuse to start when the output's file system lacks room for the checkpoint the recipe writes
    (``estimates.plan_output_bytes``: the compressed model's size, plus 5 %). A run that keeps resume checkpoints
    (``recipe_engine.execution.resume``; a streamed run's staged units are among them) holds its changed units there
    until the output is in place, at most the compressed model's size again: twice the room."""
    recipe = plan.recipe
    copies = 2 if resume_checkpoints else 1
    problem = space_problem(Path(recipe.output).expanduser(), copies * plan_output_bytes(plan))
    if problem:
        what = ("checkpoint and its resume checkpoints; --no-checkpoints needs half" if resume_checkpoints
                else "checkpoint")
        raise RecipeError(f"not enough disk space for output '{recipe.output}': {problem} "
                          f"({recipe.dtype} {what})", file=file, field="output")


#: Fewest decoder layers a recipe may leave: one layer is a bigram-like model, not a compressed LLM.
MIN_LAYERS = 2


def check_against_config(recipe: Recipe, config, file: str | None = None) -> ModelShape:
    """:func:`check_plan`'s final shape."""
    return check_plan(recipe, config, file).final


def check_plan(recipe: Recipe, config, file: str | None = None) -> Plan:
    """Compile the recipe against ``config`` (``compiled.compile_plan``: every step's ``check`` on the
    symbolic shape, ``check_calibration`` on the recipe's calibration settings, no step changing the layers
    after a step that pinned them); the final model must keep enough layers and be uniform, and an export
    must be possible. The architecture is also instantiated on the meta device to prove transformers can
    build it. Returns the plan."""
    try:
        adapter_for(config)
        if recipe.device != "auto":
            parse_device(recipe.device)  # syntax only: validating a GPU recipe on a laptop is fine
    except RecipeError as exc:
        raise exc.located(file=file) from None
    _build_on_meta(config, file)
    check_context(recipe, config, file)
    plan = compile_plan(recipe, config, file)
    shape = plan.final
    if shape.num_layers < MIN_LAYERS <= shape.original_layers:
        raise RecipeError(f"the recipe leaves {shape.num_layers} of {shape.original_layers} decoder layers; a "
                          f"model needs at least {MIN_LAYERS} to be a useful result (remove fewer layers)",
                          file=file, field="modifiers")
    odd = shape.oversized_layers()
    if odd:
        raise RecipeError(f"the recipe leaves layers {odd} wider than the config; a stock checkpoint needs "
                          f"uniform layers (add pruning steps that cover them)", file=file, field="modifiers")
    if recipe.export is not None:
        try:
            exporter, _, _ = file_export(recipe.export.format, recipe.export.type, recipe.export.file)
        except RecipeError as exc:  # the format or type field of the export block
            raise RecipeError(exc.detail, file=file, field=f"export.{exc.field}") from None
        try:
            exporter.check_recipe(plan.steps, plan.shapes, config)
        except RecipeError as exc:
            raise exc.located(file=file, field="export") from None
    return plan


def check_seq_len(seq_len: int, config, field: str | None, file: str | None = None, option: str = "") -> None:
    """A window of ``seq_len`` tokens fits the model's context (``max_position_embeddings``), or one line."""
    context = getattr(config, "max_position_embeddings", None)
    if isinstance(context, int) and seq_len > context:
        raise RecipeError(f"{option}seq_len {seq_len} exceeds the model's context of {context} tokens "
                          f"(max_position_embeddings); use at most {context}", file=file, field=field)


def check_context(recipe: Recipe, config, file: str | None = None) -> None:
    """The calibration and perplexity windows fit the model's context."""
    check_seq_len(recipe.calibration.seq_len, config, "calibration.seq_len", file)
    if recipe.evaluate is not None and recipe.evaluate.perplexity is not None:
        check_seq_len(recipe.evaluate.perplexity.seq_len, config, "evaluate.perplexity.seq_len", file)


def _build_on_meta(config, file: str | None) -> None:
    # deferred: transformers' model classes take seconds to import; only what builds a model pays it
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            AutoModelForCausalLM.from_config(config)
    except Exception as exc:  # the config itself is unusable
        raise RecipeError(f"cannot build {config.model_type} from its config: {exc}", file=file) from None
