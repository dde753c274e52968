"""``recipe`` command line: apply, show, validate, plan, diff, list-modifiers, export, card, sweep, eval, bench."""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path
from typing import Callable

from rich.markup import escape
from rich.table import Table

from ..errors import OutOfMemory, QualityGateError, RecipeError, one_line
from ..execution.distributed import DistributedError
from ..execution.resume import DEFAULT_CHECKPOINT_BUDGET
from ..records.card import check_card_target, write_card
from ..records.eval_record import read_evaluation
from ..formats import exporters, file_export, file_formats
from ..paths.output import SWEEP_FILE
from ..records.report import load_report
from ..plan.preflight import check_device, located, validate_recipe
from ..plan.steps import compile_for_plan, memory_plan, plan_rows, print_plan, rank_memory
from ..recipe.files import diff_recipes, load_recipe, yaml_scalar
from ..recipe.registry import REGISTRY, RegistryError
from ..recipe.schema import dump_recipe
from ..system.cleanup import Interrupted
from ..system.progress import Console, Progress
from ..workflows.runner import apply
from ..workflows.sweep import Sweep, plot, table
from .bench import add_bench_command
from .evaluate import add_commands, positive_int, quiet_libraries
from .about import version
from .stdio import after_output, say
from .summary import print_summary

out = Console()


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors (``error: recipe apply: ...``, exit 2) like every other mistake."""

    def error(self, message: str):
        raise RecipeError(f"{self.prog}: {message} (see {self.prog} --help)")


def _overrides(args) -> list[str]:
    sets = list(args.set or [])
    for name in ("model", "output", "device"):
        value = getattr(args, name, None)
        if value is not None:  # an explicit empty value is validated, not ignored
            sets.append(f"{name}={yaml_scalar(value)}")
    return sets


def budget_share(text: str) -> float:
    """argparse type: a share of the run's time in (0, 1]."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {value:g}")
    return value


def cmd_apply(args) -> int:
    with quiet_libraries(args.quiet):
        _, report = apply(args.recipe, overrides=_overrides(args), force=args.force, progress=not args.quiet,
                          resume=args.resume, checkpoints=False if args.no_checkpoints else args.checkpoint_budget,
                          timings=args.timings, profile=args.profile)
    if report.rank == 0:  # data-parallel: one summary
        with after_output(f"the output {args.output} is complete" if args.output else "the output is complete"):
            print_summary(report, out)
    return 0


def cmd_show(args) -> int:
    print(dump_recipe(load_recipe(args.recipe, _overrides(args)).recipe), end="")
    return 0


def cmd_validate(args) -> int:
    failed = 0
    for spec in args.recipes:  # every file is reported, bad or good
        try:
            loaded = load_recipe(spec, _overrides(args))
            plan, unchecked = validate_recipe(loaded)
            config, shape = plan.config, plan.final
        except (RecipeError, RegistryError) as exc:
            print(f"error: {one_line(str(exc))}", file=sys.stderr)
            failed += 1
            continue
        verdict = f"not fully checked ({'; '.join(unchecked)})" if unchecked else "ok"
        print(f"{spec}: {verdict} ({config.model_type}, {config.num_hidden_layers} → {shape.num_layers} layers)")
        for note in shape.notes:
            print(f"  note: {one_line(note)}")
    if failed and len(args.recipes) > 1:
        print(f"{failed} of {len(args.recipes)} recipes failed", file=sys.stderr)
    return RecipeError.exit_code if failed else 0


def world_size() -> int:
    """``--ranks``' default: ``$WORLD_SIZE`` (set by torchrun), else 1; a bad value names the variable."""
    value = os.environ.get("WORLD_SIZE", "1")
    try:
        return positive_int(value)
    except argparse.ArgumentTypeError as exc:
        raise RecipeError(f"environment variable WORLD_SIZE (the default of recipe plan --ranks): {exc}; "
                          f"unset it or give --ranks") from None


def cmd_plan(args) -> int:
    args.ranks = args.ranks or world_size()
    loaded = load_recipe(args.recipe, _overrides(args))
    recipe = loaded.recipe
    located(lambda: check_device(recipe.device, here=False), loaded.path, "device")  # its form, as validate
    if args.json:
        plan, problem = compile_for_plan(recipe)
        rows, total = plan_rows(recipe, plan=plan)
        memory = memory_plan(recipe, plan, problem)
        ranks = rank_memory(plan, memory, args.ranks) if args.ranks > 1 and "unavailable" not in memory else None
        print(json.dumps({"steps": rows, "calibration_passes": total, "memory": memory, "data_parallel": ranks}))
        return 0
    print_plan(recipe, out, args.ranks)
    return 0


def cmd_diff(args) -> int:
    lines = diff_recipes(load_recipe(args.old).recipe, load_recipe(args.new).recipe)
    for line in lines or ["no semantic difference"]:
        print(line)
    return 0


def cmd_list(args) -> int:
    for cls in REGISTRY.classes():
        table = Table(title=escape(f"{cls.step_name()} [{cls.scope}] — {cls.summary()}"), title_justify="left")
        for column in ("parameter", "type", "default", "description"):
            table.add_column(column)
        for name, field in cls.model_fields.items():
            annotation = getattr(field.annotation, "__name__", None) or str(field.annotation)
            default = "required" if field.is_required() else repr(field.get_default(call_default_factory=True))
            table.add_row(name, annotation.replace("typing.", ""), default, field.description or "")
        out.print(table)
    return 0


def cmd_export(args) -> int:
    exporter, kind, _ = file_export(args.format, args.type, None)
    with quiet_libraries(False), Progress() as bar:
        summary = exporter.write_file(Path(args.directory), Path(args.output), kind, force=args.force, progress=bar)
    with after_output(f"{summary['file']} is complete"):
        out.print(f"wrote {escape(summary['file'])}: {summary['architecture']}, {summary['tensors']} tensors, "
                  f"{summary['type']}, {summary['bytes'] / 2**20:.1f} MiB")
    return 0


def cmd_card(args) -> int:
    check_card_target(args.directory, args.force)
    report = load_report(args.directory)
    evaluations = [read_evaluation(path, report, args.directory) for path in args.eval or []]
    path = write_card(args.directory, report, evaluations)
    with after_output(f"{path} is complete"):
        out.print(f"wrote {escape(str(path))}")
    return 0


def cmd_sweep(args) -> int:
    sweep = Sweep([args.recipe, *(args.recipes or [])], args.vary or [], args.output, args.eval_limit,
                  args.tasks, progress=not args.quiet, overrides=list(args.set or []))
    try:
        with quiet_libraries(args.quiet):
            rows = sweep.run()
    except KeyboardInterrupt as exc:
        signum = exc.signum if isinstance(exc, Interrupted) else signal.SIGINT
        print(f"interrupted by {signal.Signals(signum).name}; {len(sweep.rows)} finished rows kept in "
              f"{args.output}/{SWEEP_FILE} (rerun to continue)", file=sys.stderr)
        return 128 + signum
    except Exception as exc:  # out of memory in one variant: the finished rows stay, as for a signal
        failed = OutOfMemory.of(exc)
        if failed is None:
            raise
        say(f"error: {failed.what()}; {len(sweep.rows)} finished rows kept in {one_line(args.output)}/{SWEEP_FILE} "
            f"(rerun to continue)")
        return OutOfMemory.exit_code
    with after_output(f"{args.output}/{SWEEP_FILE} is complete"):
        _print_sweep(sweep, rows, args.output)
    return 0


def _print_sweep(sweep: Sweep, rows, output: str) -> None:
    out.print(table(rows))
    shared = sweep.shared_work()
    if shared:
        out.print("shared work: " + "; ".join(f"{k} computed {v['computed']}, reused {v['reused']}"
                                              for k, v in sorted(shared.items())))

    problem = plot(rows, Path(output) / "pareto.png")
    out.print(problem or f"wrote {escape(output)}/{SWEEP_FILE} and pareto.png")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="recipe", description=__doc__)
    parser.add_argument("-V", "--version", action="version", version=f"recipe {version()}",
                        help="print the installed version (recipe X.Y.Z) and exit")
    sub = parser.add_subparsers(dest="command", required=True)

    def with_overrides(p: Parser) -> None:
        p.add_argument("--set", action="append", metavar="PATH=VALUE",
                       help="override a recipe field, e.g. calibration.samples=32 or modifiers.2.n=4")
        p.add_argument("--model", help="override the recipe's model")
        p.add_argument("--output", help="override the recipe's output directory (never an input, a link, a special "
                                        "file, nor the current directory or one holding it)")
        p.add_argument("--device", help="auto | cpu | cuda | cuda:i")

    p = sub.add_parser("apply", help="run a recipe and write the compressed checkpoint")
    p.add_argument("recipe")
    with_overrides(p)
    p.add_argument("--force", action="store_true",
                   help="replace an existing output directory that an earlier run wrote (its marker) or an empty one; "
                        "never anything else, nor a --timings or --profile path that is not ours")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument("--resume", action="store_true",
                   help="continue an interrupted (killed) run of the same output from its checkpoints")
    p.add_argument("--no-checkpoints", action="store_true",
                   help="keep no resume checkpoints: the run cannot be resumed, and needs disk room for the "
                        "output once instead of twice")
    p.add_argument("--checkpoint-budget", type=budget_share, default=DEFAULT_CHECKPOINT_BUDGET, metavar="SHARE",
                   help=f"the share of the run's time resume checkpoints may take (default "
                        f"{DEFAULT_CHECKPOINT_BUDGET}): a pass skips a layer's checkpoint beyond it; 1 "
                        f"checkpoints after every layer")
    p.add_argument("--timings", metavar="PATH",
                   help="write the timings log (one JSON line per layer and step: seconds by phase) here "
                        "instead of OUTPUT.timings.jsonl beside the output: a new file renamed into place (--resume "
                        "appends to it); an existing file is replaced only when it is a timings log (or empty); "
                        "never an input, a link, a device, FIFO or socket, nor inside the output or --profile")
    p.add_argument("--profile", metavar="DIR",
                   help="write a torch.profiler trace of a few layers (DIR/trace.json, the engine's phases marked "
                        "phase:NAME) and the top operations by host and device time (DIR/top_operations.txt); DIR "
                        "is new, empty or an earlier --profile directory (its marker), never an input, a link, nor "
                        "inside the output")
    p.set_defaults(func=cmd_apply)

    p = sub.add_parser("show", help="print the canonical resolved recipe")
    p.add_argument("recipe")
    with_overrides(p)
    p.set_defaults(func=cmd_show)

    p = sub.add_parser("validate", help="validate recipes against their model's config (no weights)")
    p.add_argument("recipes", nargs="+")
    with_overrides(p)
    p.set_defaults(func=cmd_validate)

    p = sub.add_parser("plan", help="print steps, statistics, calibration passes and a memory estimate")
    p.add_argument("recipe")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--ranks", type=positive_int, default=None,
                   help="data-parallel processes (torchrun --nproc-per-node × nodes): per-rank memory "
                        "(default: $WORLD_SIZE, else 1)")
    with_overrides(p)
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("diff", help="semantic difference of two recipes (path or path@gitrev)")
    p.add_argument("old")
    p.add_argument("new")
    p.set_defaults(func=cmd_diff)

    p = sub.add_parser("list-modifiers", help="every registered modifier with its parameters")
    p.set_defaults(func=cmd_list)

    formats = [exporters()[name] for name in file_formats()]
    p = sub.add_parser("export", help="convert an output directory to another format ("
                                      + ", ".join(f"{e.name} for {e.reader}" for e in formats) + ")")
    p.add_argument("directory", help="a recipe output or any HF model directory")
    p.add_argument("--format", choices=file_formats(), required=True)
    p.add_argument("--output", required=True,
                   help=f"the file to write (atomically), e.g. {', '.join(e.default_file for e in formats)}; never "
                        f"the input, a link, a device, FIFO or socket")
    p.add_argument("--type", choices=list(dict.fromkeys(t for e in exporters().values() for t in e.types)),
                   help="2-D weights' type (" + "; ".join(f"{e.name}: {e.types[0]} default, {', '.join(e.types[1:])}"
                                                           for e in formats) + "); norms and biases stay f32")
    p.add_argument("--force", action="store_true", help="replace an existing regular file (not a directory)")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("card", help="rewrite an output directory's model card (README.md) from its report.json")
    p.add_argument("directory", help="a recipe output directory")
    p.add_argument("--eval", action="append", metavar="JSON",
                   help="a `recipe eval DIR --json` record of this output to show as well (repeatable; refused "
                        "when it measured other weights)")
    p.add_argument("--force", action="store_true",
                   help="write README.md into a directory that is not a recipe output (its report.json is read)")
    p.set_defaults(func=cmd_card)

    p = sub.add_parser("sweep", help="run recipes over a grid of parameter values; table, JSON, Pareto plot")
    p.add_argument("recipe")
    p.add_argument("--vary", action="append", metavar="PATH=V1,V2",
                   help="values of one field, e.g. modifiers.1.n=2,4,6 (a bare n: the step that sets n)")
    p.add_argument("--recipes", nargs="+", metavar="RECIPE", help="more recipes, varied the same way")
    p.add_argument("--eval-limit", type=positive_int, help="first N perplexity windows and N rows per zero-shot task")
    p.add_argument("--tasks", nargs="*", help="zero-shot tasks (default: the recipe's evaluate.tasks)")
    p.add_argument("--output", required=True,
                   help="directory for sweep.json and pareto.png: new, empty or an earlier sweep's (rerun to "
                        "continue); never an input, a link or another directory")
    p.add_argument("--set", action="append", metavar="PATH=VALUE", help="override every recipe, before --vary")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=cmd_sweep)

    add_commands(sub)
    add_bench_command(sub)
    return parser


def run(argv: list[str] | None = None) -> int:
    """Parse and run one command; user errors become one line and their exit code (``main``, in this
    package's ``__init__``, adds the signal handling and the guard on stdout/stderr)."""
    try:
        args = build_parser().parse_args(argv)
        handler: Callable = args.func
        return handler(args)
    except SystemExit as exc:  # --help
        return exc.code if isinstance(exc.code, int) else 0
    except (RecipeError, RegistryError) as exc:
        say(f"error: {one_line(str(exc))}")
        return RecipeError.exit_code
    except DistributedError as exc:
        say(f"error: {one_line(str(exc))}")
        return DistributedError.exit_code
    except QualityGateError as exc:
        say(f"error: {one_line(str(exc))}")
        return QualityGateError.exit_code
    except Exception as exc:  # a failed allocation: apply's names where it was; eval, bench, export: one line too
        failed = OutOfMemory.of(exc)
        if failed is None:
            raise
        say(f"error: {failed}")
        return OutOfMemory.exit_code

