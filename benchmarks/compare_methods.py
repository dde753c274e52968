"""Depth-pruning baselines on SmolLM2-135M-Instruct (30 layers) at the same depth: 6 layers removed.

Protocol: calibration 32 × 512 tokens of WikiText-2 validation (seed 0) for every method except SLEB, whose
~n × layers calibration-NLL passes use 8 × 128 tokens (same split and seed) to keep the run on 2 CPU cores
reasonable; LaCo searches T for 24 layers on its 10 few-shot windows (the first 10 calibration windows), with
the paper's C = 4 (merge 4 layers into one) and with C = 2 (pairs, like the other methods' merges).
Perplexity: first 24 windows × 1024 tokens of WikiText-2 test. Each method runs through
``recipe_engine.apply(recipe, write=False)`` on a fresh copy of the dense model; "compress s" is the sum
of the steps' wall times. FlattenGPT rows need the FlattenAdjacent/HeadPrune/NystromMLP modifiers.

Run: nice -n 10 python benchmarks/compare_methods.py [--only NAME ...]
(prints a table; merges each finished row into benchmarks/results/compare_methods.json, so runs with
--only accumulate)
"""
from __future__ import annotations

import argparse
import copy
import datetime
import json
import platform
from pathlib import Path

import recipe_engine
from recipe_engine.adapters import count_parameters
from recipe_engine.data import load_text
from recipe_engine.evaluation.perplexity import perplexity
from recipe_engine.models import load_model
from recipe_engine.registry import REGISTRY

REMOVE = 6
CALIBRATION = {"dataset": "wikitext2", "split": "validation", "samples": 32, "seq_len": 512, "seed": 0}
SLEB_CALIBRATION = {**CALIBRATION, "samples": 8, "seq_len": 128}
FLATTEN = ["FuseNorm", {"FlattenAdjacent": {"n": REMOVE}}, "HeadPrune", "NystromMLP"]
#: name → (modifiers, calibration)
METHODS = {
    "dense": ([], CALIBRATION),
    "ShortGPT": ([{"ShortGPT": {"n": REMOVE}}], CALIBRATION),
    "LaCo": ([{"LaCo": {"target_layers": 30 - REMOVE, "search_steps": 6}}], CALIBRATION),
    "LaCo C=2": ([{"LaCo": {"C": 2, "target_layers": 30 - REMOVE, "search_steps": 8}}], CALIBRATION),
    "SLEB": ([{"SLEB": {"n": REMOVE}}], SLEB_CALIBRATION),
    "ShortGPT+LinearPatch": ([{"ShortGPT": {"n": REMOVE}}, "LinearPatch"], CALIBRATION),
    "FlattenGPT": (FLATTEN, CALIBRATION),
    "FlattenGPT+LinearPatch": (FLATTEN + ["LinearPatch"], CALIBRATION),
}
RESULTS = Path(__file__).parent / "results" / "compare_methods.json"


def zero_shot(model, tokenizer, limit: int) -> dict:
    """The paper's five zero-shot tasks (offline lm-eval configs), first ``limit`` rows of each."""
    import torch

    from recipe_engine.evaluation import evaluate_model
    from recipe_engine.evaluation.zeroshot import PAPER_TASKS
    from recipe_engine.schema import EvaluateConfig

    config = EvaluateConfig(perplexity=None, tasks=PAPER_TASKS, limit=limit)
    result = evaluate_model(model, tokenizer, config, torch.device("cpu"), None)["zero_shot"]
    return {"limit": limit, "average": result["average"],
            "tasks": {task: r["value"] for task, r in result["tasks"].items()}}


def run_method(name: str, dense, tokenizer, test_text: str, task_limit: int | None) -> dict:
    steps, calibration = METHODS[name]
    model, report = dense, {"steps": []}
    if steps:
        recipe = {"version": 1, "name": f"compare_{name}", "model": "smollm2-135m", "output": "out/unused",
                  "calibration": calibration, "modifiers": steps}
        model, report = recipe_engine.apply(recipe, model=copy.deepcopy(dense), tokenizer=tokenizer,
                                            write=False, progress=False)
    ppl = perplexity(model, tokenizer, test_text, seq_len=1024, limit=24)
    extra = {"zero_shot": zero_shot(model, tokenizer, task_limit)} if task_limit else {}
    return {**extra, "method": name, "layers": model.config.num_hidden_layers,
            "params_pct": 100.0 * count_parameters(model) / count_parameters(dense), "ppl": ppl["ppl"],
            "compress_s": sum(step["wall_s"] for step in report["steps"]),
            "calibration": calibration, "modifiers": steps,
            "steps": [{"modifier": s["modifier"], "result": s["result"]} for s in report["steps"]]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", choices=list(METHODS), help="run only these methods")
    parser.add_argument("--results", type=Path, default=RESULTS, help="JSON file the rows merge into")
    parser.add_argument("--task-limit", type=int, help="also the zero-shot average over the paper's five "
                                                       "tasks, first N rows of each")
    args = parser.parse_args()
    names = args.only or list(METHODS)
    missing = [m for m in ("FlattenAdjacent", "HeadPrune", "NystromMLP") if m not in REGISTRY.names()]
    if missing:
        print(f"skipping FlattenGPT rows: modifiers {missing} are not registered")
        names = [n for n in names if not n.startswith("FlattenGPT")]
    dense, tokenizer, _ = load_model("smollm2-135m", "float32")
    test_text = load_text("wikitext2", "test").text
    earlier = json.loads(args.results.read_text())["rows"] if args.results.exists() else []
    by_method = {row["method"]: row for row in earlier}
    for name in names:
        row = run_method(name, dense, tokenizer, test_text, args.task_limit)
        row["date"] = datetime.date.today().isoformat()
        by_method[name] = row
        rows = [by_method[m] for m in METHODS if m in by_method]
        args.results.parent.mkdir(parents=True, exist_ok=True)
        args.results.write_text(json.dumps({"machine": platform.processor() or platform.machine(), "rows": rows},
                                      indent=2, default=str))
        print(f"{row['method']:<24} {row['layers']:>3} layers {row['params_pct']:6.1f}% params "
              f"PPL {row['ppl']:9.2f}  {row['compress_s']:7.1f} s  zero-shot avg {average(row)}", flush=True)
    print("\n| method | layers | params % | WikiText-2 PPL | zero-shot avg | compress s |\n|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['method']} | {row['layers']} | {row['params_pct']:.1f} | {row['ppl']:.2f} | {average(row)} | "
              f"{row['compress_s']:.1f} |")


def average(row: dict) -> str:
    zero = row.get("zero_shot")
    return f"{zero['average']:.3f} ({zero['limit']} rows/task)" if zero else "–"


if __name__ == "__main__":
    main()
