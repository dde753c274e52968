"""The rich summary table printed at the end of ``recipe apply``."""
from __future__ import annotations

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ..records.evaluation import Evaluation
from ..records.report import EvaluationRecord, Report, StepRecord


def _ppl(results: Evaluation | None) -> str:
    return f"{results.perplexity.ppl:.2f}" if results is not None and results.perplexity else "-"


def print_summary(report: Report, console: Console) -> None:
    before, after = report.before, report.after
    table = Table(title=f"recipe {report.recipe.name}")
    table.add_column("")
    table.add_column("before", justify="right")
    table.add_column("after", justify="right")
    table.add_column("ratio", justify="right")
    table.add_row("parameters", f"{before.parameters / 1e6:.2f}M", f"{after.parameters / 1e6:.2f}M",
                  f"{after.parameters / before.parameters:.3f}")
    table.add_row("layers", str(before.layers), str(after.layers), f"{after.layers / before.layers:.3f}")
    if report.evaluation is not None:
        _evaluation_rows(table, report.evaluation)
    steps = report.steps
    for step, following in zip(steps, steps[1:] + [None]):
        peak = f" (peak {step.peak_rss_mib / 1024:.2f} GiB)" if step.peak_rss_mib else ""
        table.add_row(f"step {step.index} {step.modifier}{peak}", "", f"{step.wall_s:.1f}s", "")
        if step.pass_shared_s and not _same_pass(step, following):
            passes = "" if step.calibration_passes is None else f", {step.calibration_passes} calibration passes"
            table.add_row(f"  shared pass (loading, forwards{passes})", "", f"{step.pass_shared_s:.1f}s", "")
    memory = report.peak_memory
    if memory.rss_mib:
        planned = f" (plan {memory.estimate_rss_mib / 1024:.2f})" if memory.estimate_rss_mib else ""
        table.add_row("peak host memory", "", f"{memory.rss_mib / 1024:.2f} GiB{planned}", "")
    if memory.cuda_mib:
        planned = f" (plan {memory.estimate_device_mib / 1024:.2f})" if memory.estimate_device_mib else ""
        table.add_row("peak device memory", "", f"{memory.cuda_mib / 1024:.2f} GiB{planned}", "")
    console.print(table)
    for step in steps:  # a step's own one-line account of what it chose, under the table (too long for a cell)
        if step.result.get("headline"):
            console.print(escape(f"step {step.index} {step.modifier}: {step.result['headline']}"), soft_wrap=True)
    for note in report.notes:
        console.print(escape(f"note: {note}"), soft_wrap=True)


def _evaluation_rows(table: Table, evaluation: EvaluationRecord) -> None:
    """Perplexity, each zero-shot and generation task, before and after."""
    dense, compressed = evaluation.before, evaluation.after or Evaluation()
    ppl = dense.perplexity
    if ppl:
        note = escape(f" [{ppl.dataset}, {ppl.windows}×{ppl.seq_len} tokens]")
        ratio = evaluation.retained.perplexity if evaluation.retained else None
        table.add_row("perplexity" + note, _ppl(dense), _ppl(compressed), f"{1 / ratio:.3f}" if ratio else "-")
    nan = float("nan")
    if dense.zero_shot:
        after = compressed.zero_shot
        for task, res in dense.zero_shot.tasks.items():
            value = after.value_of(task) if after else None
            table.add_row(f"{task} {res.metric}", f"{res.value:.4f}", f"{nan if value is None else value:.4f}", "")
        table.add_row("zero-shot average", f"{dense.zero_shot.average:.4f}",
                      f"{after.average if after else nan:.4f}", "")
    if dense.generation:
        after = compressed.generation
        for task, res in dense.generation.tasks.items():
            value = after.value_of(task) if after else None
            value = nan if value is None else value
            table.add_row(f"{task} {res.metric} [{res.samples} problems]", f"{res.value:.4f}",
                          f"{value:.4f}", f"{value / res.value:.3f}" if res.value else "-")


def _same_pass(step: StepRecord, following: StepRecord | None) -> bool:
    """Whether ``following`` ran in the same pass group as ``step`` (such steps are consecutive)."""
    if following is None:
        return False
    if step.group is not None:
        return following.group == step.group
    return step.shared_pass and following.shared_pass and following.pass_shared_s == step.pass_shared_s
