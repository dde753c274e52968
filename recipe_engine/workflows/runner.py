"""``recipe apply``: validate, load, calibrate, run the steps, evaluate, write atomically."""
from __future__ import annotations

import contextlib
import copy
import hashlib
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from ..architectures.adapters import adapter_for, count_parameters
from ..errors import QualityGateError, RecipeError
from ..evaluation import evaluate_session, retained
from ..evaluation.self_generated import self_generated_windows
from ..execution.distributed import Parallel, launched
from ..execution.failures import discard_on_error, out_of_memory_named
from ..execution.resume import Checkpoints, has_checkpoint
from ..execution.unit_files import model_fingerprint
from ..execution.outputs import RunOutputs
from ..execution.packed_source import carry_source_grids, drop_changed_grids, output_note, plan_note
from ..execution.placement import largest_layer_bytes, offload_activations
from ..execution.context import RunContext
from ..execution.session import Session, oversized_layers
from ..execution.steps import run_steps
from ..execution.timings import PROFILE_KIND, Timings, profiled
from ..execution.streaming import open_stream
from ..sources.record import model_record
from ..records.card import write_card
from ..records.evaluation import Evaluation, Retained
from ..checkpoint.writer import write_checkpoint
from ..sources.windows import calibration_windows, fingerprint, load_calibration
from ..records.extras import save_extras
from ..formats import file_export
from ..checkpoint.reader import CheckpointReader
from ..sources.models import load_model
from ..paths.output import atomic_directory, check_output_free
from ..records.provenance import git_info, package_versions, peak_memory
from ..paths.lock import output_lock
from ..paths.targets import Target, check_targets, is_timings_log, marked
from ..records.report import Checkpoints as CheckpointsRecord
from ..records.report import (DataRecord, ExportRecord, ModelRecord, ModelSize, PeakMemory, RecipeRecord, Report,
                              RunReport, StreamRecord)
from ..records.fingerprints import WeightsFingerprint, weights_fingerprint
from ..plan.compiled import Plan
from ..plan.estimates import plan_memory, unmeasured_accelerator_runtime
from ..plan.preflight import check_device, located, preflight_apply
from ..recipe.files import LoadedRecipe, load_recipe
from ..recipe.schema import Recipe, dump_recipe, recipe_from_dict
from ..system.cleanup import track, untrack
from ..system.host_memory import PeakWatch, current_rss, own_mapped_weights
from ..system.progress import Progress


def _resolve(recipe: Recipe | str | Path | dict, overrides: list[str]) -> LoadedRecipe:
    if isinstance(recipe, (str, Path)):
        return load_recipe(str(recipe), overrides)
    if overrides:
        raise RecipeError("overrides apply to recipe files; edit the Recipe object instead")
    if isinstance(recipe, dict):
        recipe = recipe_from_dict(recipe)
    return LoadedRecipe(recipe, "<python>", dump_recipe(recipe))


def apply(recipe: Recipe | str | Path | dict, model=None, tokenizer=None, *, overrides: list[str] = (),
          force: bool = False, write: bool = True, progress: bool = True, resume: bool = False,
          memo=None, checkpoints: bool | float = True, timings: str | Path | None = None,
          profile: str | Path | None = None) -> tuple[Any, Report]:
    """Run a recipe; returns ``(model, report)`` (a ``recipe_engine.records.report.Report``, as written to
    ``report.json``). Writes the output directory unless ``write=False``.

    ``model``/``tokenizer`` may be passed in memory (then ``recipe.model`` only names it in the report).
    ``memo`` (``recipe_engine.execution.memo.SharedWork``): work shared with other runs of a sweep.
    A streamed run (``stream``) returns the model as a meta-device skeleton: its weights are the output.
    ``resume``: continue an interrupted run of the same output from its checkpoints
    (``recipe_engine.execution.resume``).
    ``checkpoints=False``: keep no resume checkpoints (a run that cannot be resumed, but needs disk room
    for the output once instead of twice); a number in (0, 1]: the share of the run's time they may take
    (``True``: ``resume.DEFAULT_CHECKPOINT_BUDGET``; a pass skips layer checkpoints beyond it; 1: every layer).
    ``timings``: where the run's timings log goes (``recipe_engine.execution.timings``; default, when the
    output is written: ``<output>.timings.jsonl`` beside it while the run goes on, in the output as
    ``timings.jsonl`` once it is written; a run that fails or is interrupted by a handled signal removes it
    with its other files, one killed outright leaves it). A log whose place was given is always kept.
    ``profile``: a directory for a ``torch.profiler`` trace of a few layers and a table of the top operations
    (``recipe_engine.execution.timings.profiled``; needs the timings log).
    """
    if not isinstance(checkpoints, bool) and not 0 < checkpoints <= 1:
        raise RecipeError(f"checkpoints: a share of the run's time in (0, 1], or True / False; got {checkpoints}")
    loaded = _resolve(recipe, list(overrides))
    device = located(lambda: check_device(loaded.recipe.device), loaded.path, "device")
    with launched(device) as parallel, contextlib.ExitStack() as stack:
        log = timings_path(loaded.recipe.output, timings, write and parallel.rank == 0)
        if profile is not None and log is None:
            raise RecipeError("--profile needs the timings log: give --timings PATH when nothing is written")
        stack.enter_context(_claim_output(loaded, write and parallel.rank == 0, force,
                                          (timings if timings is not None else log) if parallel.rank == 0 else None,
                                          timings is not None, profile if parallel.rank == 0 else None))
        # nothing stays beside the output: a finished run's log is in it, a failed or interrupted run's goes
        # with its other files (also when a signal forces the process out); a SIGKILL (or the OOM killer)
        # leaves it. A log whose place the user named stays there.
        beside = log if timings is None else None
        if beside is not None:
            track(beside)
        try:
            return _apply(loaded, parallel, model, tokenizer, force, write, progress, resume, memo, checkpoints,
                          log, Path(profile) if profile is not None and parallel.rank == 0 else None)
        finally:
            if beside is not None:
                beside.unlink(missing_ok=True)
                untrack(beside)


def timings_path(output: str, given: str | Path | None, writing: bool) -> Path | None:
    """The timings log of a run: ``given``, else ``<output>.timings.jsonl`` when this process writes."""
    if given is not None:
        return Path(given)
    return Path(f"{str(output).rstrip('/')}.timings.jsonl") if writing else None


@contextlib.contextmanager
def _claim_output(loaded: LoadedRecipe, writing: bool, force: bool, log: str | Path | None = None, named: bool = False,
                  profile: str | Path | None = None) -> Iterator[None]:
    """The pre-flight of every path the run writes: the output (``output.check_output_free``), the timings
    ``log`` (``named``: given by ``--timings``, else the default beside the output) and the ``profile``
    directory (``user_paths.check_targets``); then the output's lock (``output_lock``) for the run: a second
    run aimed at the same output is refused before it touches this run's temporary files or resume
    checkpoints."""
    if writing:
        check_output_free(loaded.recipe.output, force, loaded.path, inputs=_inputs(loaded))
    targets = [Target("--timings" if named else "the timings log", log, ours=is_timings_log, what="a timings log",
                      instead="choose another file" if named else "give --timings PATH")] if log is not None else []
    if profile is not None:
        targets.append(Target("--profile", profile, directory=True, ours=marked(PROFILE_KIND),
                              what="a profile directory"))
    others = {"the output": Path(loaded.recipe.output)} if writing else {}
    check_targets(targets, _read(loaded), others)
    if not writing:
        yield
        return
    with output_lock(loaded.recipe.output, loaded.path):
        yield


def _read(loaded: LoadedRecipe) -> list[str]:
    """Everything the run reads that it may not write: the model, the recipe file, the local calibration and
    evaluation texts."""
    recipe = loaded.recipe
    texts = list(recipe.calibration.sources)
    if recipe.evaluate is not None and recipe.evaluate.perplexity is not None:
        texts += list(recipe.evaluate.perplexity.dataset)
    return [*_inputs(loaded), loaded.path, *texts]


def _inputs(loaded: LoadedRecipe) -> list[str]:
    """What the run reads while its output is being written, which the output may not replace: the model (a
    directory or a model file; texts and the recipe are read in full before anything is written)."""
    model = loaded.recipe.model
    return [model] if model and Path(model).expanduser().exists() else []


def _apply(loaded: LoadedRecipe, parallel: Parallel, model, tokenizer, force: bool, write: bool,
           progress: bool, resume: bool = False, memo=None, keep_checkpoints: bool | float = True,
           timings: Path | None = None, profile: Path | None = None) -> tuple[Any, Report]:
    """``apply`` on this rank of a data-parallel run (one process: rank 0 of 1); rank 0 writes. Pre-flight
    (the recipe compiled into a plan, everything checked before a weight loads), execute, write."""
    recipe, file = loaded.recipe, loaded.path
    writing = write and parallel.rank == 0
    texts = located(lambda: load_calibration(recipe.calibration), file)
    plan = preflight_apply(recipe, file, model.config if model is not None else None, write=write,
                           writing=writing, keep_checkpoints=keep_checkpoints, resume=resume)
    # the report's sections, typed as the run makes them; ``Report`` when the run is done
    report = RunReport(recipe=_recipe_record(loaded), packages=package_versions(), device=str(parallel.device),
                       dtype=recipe.dtype, streamed=plan.streamed, rank=parallel.rank, ranks=parallel.world)
    owned: list = []  # this run's resume checkpoints: removed on an exception or a handled signal
    bar = Progress(enabled=progress and parallel.rank == 0)
    # a rank other than 0 of a data-parallel run keeps no checkpoints of its own: rank 0's directory says
    resumable = lambda: any(c is not None and c.resumable for c in owned) or (
        parallel.rank > 0 and bool(write and keep_checkpoints) and has_checkpoint(recipe.output))
    with discard_on_error(owned), out_of_memory_named(bar, resumable), \
            _workspace(recipe.output, writing, force) as workdir, bar:
        run = _execute(plan, texts, parallel, model, tokenizer, report, bar, workdir, owned, resume=resume,
                       keep_checkpoints=write and keep_checkpoints, memo=memo, file=file, timings=timings,
                       profile=profile)
        model, session = run.model, run.session
        with session.context.timings.phase("write"):
            final = (_write(recipe, model, run.tokenizer, session, run.outputs, report, workdir) if writing
                     else report.to_report())
        session.context.timings.record(event="output written" if writing else "done")
        session.context.timings.close()
        if writing and timings is not None and timings.is_file():
            shutil.copyfile(timings, workdir / TIMINGS)
        parallel.barrier()  # renamed into place only when every rank finished
    if run.checkpoints is not None:
        run.checkpoints.discard()  # the output is in place
    if run.gate:
        raise QualityGateError(run.gate)
    return model, final


@dataclass
class Executed:
    """What ``_execute`` hands the writer: the model as the steps left it (loaded by the run, or the one passed
    in), its tokenizer, the run's session and outputs, its resume checkpoints (None when it keeps none) and the
    quality gate's failure (None: passed or no gate)."""

    model: Any
    tokenizer: Any
    session: Session
    outputs: RunOutputs
    checkpoints: Checkpoints | None
    gate: str | None


def _execute(plan: Plan, texts, parallel: Parallel, model, tokenizer, report: RunReport, bar: Progress,
             workdir: Path, owned: list, *, resume: bool, keep_checkpoints: bool | float, memo, file: str | None,
             timings: Path | None = None, profile: Path | None = None) -> Executed:
    """Load the model (unless passed in memory), calibrate, run the plan's steps, evaluate; fills ``report``."""
    recipe, cal, streamed = plan.recipe, plan.recipe.calibration, plan.streamed
    watch = PeakWatch()
    # the runtime's floor when this run loads the model: its lazily mapped weights are not all resident yet
    before_weights = current_rss() if model is None else 0
    if model is None:
        bar.phase(f"loading {recipe.model}" + (" (streamed from disk)" if streamed else ""))
        model, tokenizer, source = load_model(recipe.model, recipe.dtype, skeleton=streamed)
        loaded = adapter_for(model.config)
        if not streamed and not parallel.active:  # ranks on one host share the files' unchanged pages instead
            own_mapped_weights(loaded.layers(model))  # a layer a step replaces is freed with it
        report.model = model_record(recipe.model, source)
        if report.model.packed:
            bar.log(f"the source's weights are packed ({report.model.packed}): read dequantized" if recipe.quantizes
                    else plan_note(report.model.packed, recipe.dtype, loaded))
    else:
        source = None
        report.model = ModelRecord(spec=recipe.model, kind="in-memory")
    windows, tokens_available = calibration_windows(tokenizer, texts, cal)
    generated = None
    if cal.generate is not None:  # the dense model writes its own calibration text, before any step runs
        bar.phase("the model writing its calibration windows")
        windows, generated = self_generated_windows(model, tokenizer, windows, cal.generate, cal.seed, bar)
    resident_weights = 0 if streamed else sum(t.numel() * t.element_size() for t in
                                              {id(t): t for t in model.state_dict().values()}.values())
    on_cuda = parallel.device.type == "cuda"  # page-locked copies, and the runtime's host share once measured
    memory = plan_memory(plan, streamed, max(current_rss() - resident_weights, before_weights), accelerator=on_cuda,
                         accelerator_runtime=unmeasured_accelerator_runtime(parallel.device))
    report.data = DataRecord(dataset=cal.dataset, origin="; ".join(text.origin for text, _ in texts),
                                tokens_available=tokens_available, samples=cal.samples, seq_len=cal.seq_len,
                                seed=cal.seed, fingerprint=fingerprint(windows), generated=generated)
    report.before = ModelSize(parameters=count_parameters(model), layers=model.config.num_hidden_layers)
    adapter = adapter_for(model.config)
    offload = offload_activations(cal.offload, parallel.device, memory, largest_layer_bytes(adapter.layers(model)))
    if cal.offload == "auto" and parallel.device.type != "cpu":
        bar.log(f"calibration activations kept on {'the host' if offload else parallel.device} (offload: auto)")
    if not offload and parallel.device.type != "cpu":  # the activations, statistics and solves on the device
        memory = plan_memory(plan, streamed, memory.runtime_bytes, on_device=True, accelerator=on_cuda,
                             accelerator_runtime=memory.accelerator_runtime_bytes)
    report.activations_on = "cpu" if offload else str(parallel.device)
    stream = open_stream(model, adapter, source.location, workdir / STAGING) if streamed else None
    outputs = RunOutputs()
    clock = None
    if timings is not None and parallel.rank == 0:  # a resumed run appends to its log; a fresh one replaces it
        clock = Timings(timings, parallel.device, append=resume)
    context = RunContext(tokenizer, adapter, cal, parallel.device, bar, parallel, timings=clock, offload=offload,
                         stock_only=recipe.export is not None)
    session = Session(context, model, windows, stream=stream, memo=memo, outputs=outputs, matches_reference=True,
                      reference_loader=_reference_loader(recipe, model, source, lambda: session))
    uncarried = None  # a packed source's linears no step changes are written packed again (``packed_source``)
    if report.model.packed and not recipe.quantizes:
        uncarried = carry_source_grids(session, stream.source if stream else CheckpointReader(source.location, model))
    checkpoints = _checkpoints(recipe, report, source, resume, keep_checkpoints, session, file)
    owned.append(checkpoints)
    if recipe.evaluate is not None and report.evaluation is None:  # a resumed run has it
        bar.phase("evaluating the model before compression", evaluating=True)
        report.evaluation = {"before": evaluate_session(session, recipe.evaluate, bar).to_json()}
        session.context.timings.record(event="evaluation before")
    with profiled(session.context.timings, profile):
        report.steps = run_steps(session, list(plan.steps), bar, watch, memory, checkpoints, report)
    _check_uniform(session)
    report.after = ModelSize(parameters=count_parameters(model), layers=model.config.num_hidden_layers,
                                layer_origin=[list(o) for o in session.layer_origin])
    # a step that may add a non-stock extra (declared) and did not (e.g. a choice that kept a stock model)
    report.stock_checkpoint = all(step.stock_output for step in recipe.modifiers) or not outputs.extras
    if uncarried is not None:
        changed, cleared = drop_changed_grids(session)
        note = output_note(report.model.packed, recipe.dtype, len(outputs.quantized), changed, left=uncarried,
                           cleared=cleared)
        report.notes += [note] if note else []
    gate = None
    if recipe.evaluate is not None:
        bar.phase("evaluating the compressed model", evaluating=True)
        after = evaluate_session(session, recipe.evaluate, bar)
        session.context.timings.record(event="evaluation after")
        kept = retained(Evaluation.from_json(report.evaluation["before"]), after)  # this run's, or a resumed one's
        gate = _quality_gate(recipe, kept)
        report.evaluation.update(after=after.to_json(), retained=kept.to_json(),
                                 quality_gate="failed" if gate else "passed")
    if checkpoints is not None:
        report.checkpoints = CheckpointsRecord(written=checkpoints.count, seconds=checkpoints.seconds,
                                                  bytes=checkpoints.bytes_written, skipped=checkpoints.skipped)
    report.calibration_passes = sum({step["group"]: step["calibration_passes"] for step in report.steps}.values())
    report.calibration_layer_runs = session.work.runs
    report.calibration_layer_batches = session.work.batches  # this rank's share under torchrun
    if stream is not None:
        report.stream = StreamRecord(bytes_read=stream.bytes_read, bytes_staged=stream.bytes_staged)
    peaks = peak_memory(watch)
    if session.context.timings.peak_device_bytes():  # the timings log resets torch's counter per record
        peaks["cuda_mib"] = max(peaks.get("cuda_mib") or 0, session.context.timings.peak_device_bytes() / 2**20)
    report.peak_memory = PeakMemory(**peaks, estimate_rss_mib=memory.host_peak_bytes / 2**20,
                                       estimate_device_mib=(memory.device_peak_bytes or 0) / 2**20 or None)
    return Executed(model, tokenizer, session, outputs, checkpoints, gate)


#: Directory inside the output's temporary directory holding changed units of a streamed model.
STAGING = ".staging"
#: The timings log's copy in a finished output.
TIMINGS = "timings.jsonl"


@contextlib.contextmanager
def _workspace(output: str, writing: bool, force: bool) -> Iterator[Path]:
    """The output's temporary sibling directory (renamed into place on success, removed on any error or
    signal), or a private temporary directory when nothing is written; staging data lives inside."""
    if writing:
        with atomic_directory(output, force) as tmp:
            yield tmp
    else:
        with tempfile.TemporaryDirectory(prefix="recipe-") as tmp:
            yield Path(tmp)


def _reference_loader(recipe: Recipe, model, source, current: Callable[[], Session]):
    """Original weights for ``session.reference``: a read-only skeleton streamed from the
    source checkpoint (one copy of the original: the files), or, for a model passed in memory, a CPU
    copy taken now (before any step changes it)."""
    if source is None:
        if not any(step.needs_reference for step in recipe.modifiers):
            return None
        snapshot = copy.deepcopy(model).to("cpu")
        return lambda: snapshot

    def load() -> Session:
        skeleton = load_model(recipe.model, recipe.dtype, skeleton=True)[0]
        # a streamed run's own stream already bounds the heap; an in-memory run keeps its speed
        return current().sibling(skeleton, open_stream(skeleton, current().context.adapter, source.location, None,
                                                       bound_heap=False))
    return load


def _checkpoints(recipe: Recipe, report: RunReport, source, resume: bool, write: bool | float, session: Session,
                 file: str):
    """The run's resume checkpoints (``recipe_engine.execution.resume``), restored into ``session`` when resuming (a
    streamed session stages its units there); None when this run keeps none (not written, model passed in
    memory). Data-parallel: rank 0 writes them; with ``resume`` every rank restores them and the ranks check
    that they adopted the same manifest (its sha256)."""
    parallel = session.context.parallel
    if not write or source is None or (parallel.rank > 0 and not resume):
        return None
    identity = {"recipe": report.recipe.resolved_sha256, "model": model_fingerprint(source.location),
                "calibration": report.data.fingerprint, "packages": report.packages}
    checkpoints = Checkpoints.open(recipe.output, identity, resume, file, writer=parallel.rank == 0)
    if write is not True:
        checkpoints.budget = float(write)
    if session.stream is not None and checkpoints.writer:
        checkpoints.keep_staging(session.stream)
    checkpoints.restore(session, report)
    if parallel.active and resume:
        checkpoints.agree(parallel)
    return checkpoints


def _check_uniform(session: Session) -> None:
    odd = oversized_layers(session)
    if odd:
        raise RecipeError(f"layers {odd} are wider than the config after the last step; "
                          f"not a stock checkpoint (add pruning steps)", field="modifiers")


def _quality_gate(recipe: Recipe, kept: Retained) -> str | None:
    floor = recipe.evaluate.min_retained if recipe.evaluate else None
    if floor is None:
        return None
    low = {k: v for k, v in kept.fractions().items() if v < floor}
    if not low:
        return None
    return (f"quality gate failed: retained {', '.join(f'{k}={v:.3f}' for k, v in low.items())} "
            f"below min_retained={floor}; output kept at {recipe.output} and marked")


def _recipe_record(loaded: LoadedRecipe) -> RecipeRecord:
    resolved = dump_recipe(loaded.recipe)
    return RecipeRecord(name=loaded.recipe.name, file=loaded.path, sha256=loaded.sha256,
                        resolved_sha256=hashlib.sha256(resolved.encode()).hexdigest(),
                        git=git_info(loaded.path), overrides=loaded.recipe.overrides)


def _write(recipe: Recipe, model, tokenizer, session: Session, outputs: RunOutputs, report: RunReport,
           tmp: Path) -> Report:
    """The output files, into the workspace that ``apply`` renames into place; staging data is removed.
    Returns the report as written."""
    written = WeightsFingerprint()  # hashed as the engine's writer writes the files
    if session.stream is not None or outputs.quantized:
        files = write_checkpoint(session, tmp, fingerprint=written)
    else:
        model.save_pretrained(tmp, safe_serialization=True)
        files = None
    shutil.rmtree(tmp / STAGING, ignore_errors=True)
    for filename, data in outputs.artifacts.items():
        (tmp / filename).parent.mkdir(exist_ok=True)
        (tmp / filename).write_bytes(data)
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    save_extras(tmp, outputs.extras)
    (tmp / "recipe.yaml").write_text(dump_recipe(recipe))
    if recipe.export is not None:  # from the finished files, so it sees exactly what was written
        exporter, kind, file = file_export(recipe.export.format, recipe.export.type, recipe.export.file)
        exported = exporter.write_file(tmp, tmp / file, kind, name=recipe.name, source=report.model)
        report.export = ExportRecord(**{**exported, "file": file, "format": recipe.export.format})
    # what `recipe card --eval` matches records against: hashed while written when those are all the weights
    hashed = files is not None and sorted(p.name for p in tmp.glob("*.safetensors")) == files
    report.weights_sha256 = written.hexdigest() if hashed else weights_fingerprint(tmp)
    final = report.to_report()
    if final.evaluation is not None and final.evaluation.quality_gate == "failed":
        (tmp / "QUALITY_GATE_FAILED").write_text("see report.json evaluation.retained\n")
    final.write(tmp)
    write_card(tmp, final)  # README.md: the model card, from the report and the files beside it
    return final
