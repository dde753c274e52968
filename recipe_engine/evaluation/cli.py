"""``recipe eval`` and ``recipe bench`` sub-commands."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from rich.console import Console
from rich.table import Table

out = Console()


def cmd_eval(args) -> int:
    from ..models import load_model, resolve_device
    from ..progress import Progress
    from ..schema import EvaluateConfig, PerplexityConfig
    from .run import evaluate_model

    config = EvaluateConfig(perplexity=PerplexityConfig(dataset=args.dataset or ["wikitext2"], seq_len=args.seq_len,
                                                        limit=args.limit),
                            tasks=args.tasks or [], limit=args.task_limit)
    model, tokenizer, source = load_model(args.model, args.dtype)
    with Progress() as bar:
        results = evaluate_model(model, tokenizer, config, resolve_device(args.device), bar)
    results["model"] = {"spec": args.model, "location": source.location}
    table = Table(title=f"evaluation of {args.model}")
    table.add_column("metric")
    table.add_column("value", justify="right")
    ppl = results.get("perplexity")
    if ppl:
        limit = f" (first {ppl['windows']} of {ppl['windows_available']} windows)" if args.limit else ""
        table.add_row(f"PPL {ppl['dataset']} seq {ppl['seq_len']}{limit}", f"{ppl['ppl']:.3f}")
    out.print(table)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


def add_commands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("eval", help="perplexity (and zero-shot tasks) of a model or output directory")
    p.add_argument("model")
    p.add_argument("--dataset", action="append", help="text source(s); first available is used")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--limit", type=int, help="evaluate only the first N perplexity windows")
    p.add_argument("--tasks", nargs="*")
    p.add_argument("--task-limit", type=int)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="auto")
    p.add_argument("--json")
    p.set_defaults(func=cmd_eval, dataset=None)
