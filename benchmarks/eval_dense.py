"""Dense SmolLM2-135M quality baseline: WikiText-2 perplexity and the paper's five zero-shot accuracies.

    nice -n 10 python -m benchmarks.eval_dense > eval_dense.log 2>&1 &

Perplexity: the full WikiText-2 raw test set (``--ppl-limit`` windows to cut it). Zero-shot: the offline
lm-eval tasks (``recipe_engine/evaluation/tasks``), first ``--task-limit`` rows of each (full sets do not fit
a CPU run: HellaSwag alone is 10,042 rows × 4 long continuations). The JSON is rewritten after each phase,
so a run stopped during zero-shot still records the perplexity.
"""
from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from recipe_engine.evaluation import evaluate_model
from recipe_engine.evaluation.zeroshot import PAPER_TASKS
from recipe_engine.sources.models import load_model
from recipe_engine.recipe.schema import EvaluateConfig, PerplexityConfig

RESULTS = Path(__file__).resolve().parent / "results" / "raw"   # raw output (ignored by git)


def table(record: dict) -> Table:
    out = Table(title=f"dense {record['model']} ({record['threads']} CPU threads)")
    for column in ("metric", "rows", "value", "wall s"):
        out.add_column(column, justify="left" if column == "metric" else "right")
    ppl = record.get("perplexity")
    if ppl:
        out.add_row(f"PPL WikiText-2 test, seq {ppl['seq_len']}", f"{ppl['windows']}/{ppl['windows_available']} win",
                    f"{ppl['ppl']:.3f}", f"{record['wall_s']['perplexity']:.0f}")
    zero = record.get("zero_shot")
    if zero:
        for task, res in zero["tasks"].items():
            out.add_row(f"{task} {res['metric']}", f"{res['samples']}/{res['samples_available']}",
                        f"{res['value']:.4f}", "")
        out.add_row("Avg. (paper's five)", "", f"{zero['average']:.4f}", f"{record['wall_s']['zero_shot']:.0f}")
    return out


class LogProgress:
    """Plain progress lines for a log file: every ``every`` items, with elapsed seconds."""

    def __init__(self, every: int = 10):
        self.every = every

    def track(self, items, description: str):
        items, start = list(items), time.perf_counter()
        for index, item in enumerate(items):
            if index % self.every == 0:
                print(f"{description}: {index}/{len(items)} after {time.perf_counter() - start:.0f}s", flush=True)
            yield item

    def log(self, message: str) -> None:
        print(message, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--ppl-limit", type=int, help="first N windows only (default: full test set)")
    parser.add_argument("--task-limit", type=int, default=100, help="rows per zero-shot task")
    parser.add_argument("--tasks", nargs="*", default=PAPER_TASKS)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1 is fastest on a shared CPU)")
    parser.add_argument("--json", type=Path, default=RESULTS / "eval_dense.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer, source = load_model(args.model)
    record = {"model": args.model, "location": source.location, "threads": args.threads,
              "machine": platform.processor() or platform.machine(), "date": time.strftime("%Y-%m-%d %H:%M"),
              "task_limit": args.task_limit, "wall_s": {}}
    phases = [("perplexity", EvaluateConfig(perplexity=PerplexityConfig(limit=args.ppl_limit))),
              ("zero_shot", EvaluateConfig(perplexity=None, tasks=args.tasks, limit=args.task_limit))]
    args.json.parent.mkdir(parents=True, exist_ok=True)
    for name, config in phases:
        start = time.perf_counter()
        record[name] = evaluate_model(model, tokenizer, config, torch.device("cpu"), LogProgress()).to_json()[name]
        record["wall_s"][name] = time.perf_counter() - start
        args.json.write_text(json.dumps(record, indent=2))
        Console().print(table(record))


if __name__ == "__main__":
    main()
