"""Depth-pruning methods compared at equal depth on a builtin model, in-domain and on held-out text.

Every method removes ``n`` layers (default: SmolLM2-135M 6 of 30, Qwen2.5-0.5B 5 of 24, Gemma-3-270M 4 of 18;
"GPTQ W4" removes none: 4-bit weights, groups of 64) and is calibrated on
one source (``--calibration``): ``wikipedia`` = 32 × 512 tokens of the Wikipedia sample's train split (the
held-out protocol: no evaluation text is from it), ``wikitext2`` = 32 × 512 tokens of WikiText-2 validation
(the paper's in-domain protocol, for comparison with the literature), ``c4`` = 32 × 512 tokens of the C4
sample's train split (then the C4 column is its test split, in-domain), ``wikipedia+c4`` = 16 + 16 windows of
both (code stays held out); seed 0. SLEB's ~n × layers
calibration-NLL passes use 8 × 128 tokens of the same source. Perplexity (``--evals``): WikiText-2 test
(first 24 windows × 1024), the C4 sample (``c4.utf8``, 16 × 1024) and the code sample (``code.utf8``,
16 × 1024; Qwen2.5-Coder is a code model); ``--windows`` changes the counts (the figures in BENCHMARKS.md
used 16 8 8 on the shared 2-core CPU). Each method runs through ``recipe_engine.apply(recipe,
write=False)`` on a fresh copy of the dense model; "compress s" is the sum of the steps' wall times.

Run: nice -n 10 python benchmarks/compare_methods.py --model qwen2.5-0.5b [--calibration wikipedia]
     [--n 5] [--only NAME ...] [--task-limit 200]
(prints a table; merges each finished row into benchmarks/results/compare_methods_<model>.json keyed by
method, calibration and n, so runs with --only accumulate; --table reprints it; a method that validation
refuses on the model's architecture, e.g. FlattenGPT on Gemma 3, is a row with the one-line reason)
"""
from __future__ import annotations

import argparse
import copy
import datetime
import json
import platform
from pathlib import Path

import torch

import recipe_engine
from recipe_engine.adapters import count_parameters
from recipe_engine.data import data_dir, load_text
from recipe_engine.errors import RecipeError
from recipe_engine.evaluation.perplexity import perplexity
from recipe_engine.models import load_model

MODELS = {"smollm2-135m": 6, "qwen2.5-0.5b": 5, "gemma3-270m": 4}   # default n: ~20 % of the depth (4 of 18)
CALIBRATIONS = {"wikipedia": ("wikipedia-sample", "train"), "wikitext2": ("wikitext2", "validation"),
                "c4": ("c4-sample", "train"), "wikipedia+c4": (["wikipedia-sample", "c4-sample"], "train")}
# c4 / code: the whole file (none of it is calibrated on), except the test split of a calibrated source
EVALS = {"wikitext2": ("wikitext2", "test"), "c4": ("c4-sample", "all"), "code": ("code-sample", "all")}
WINDOWS = {"wikitext2": 24, "c4": 16, "code": 16}   # default windows × 1024 tokens (--windows to change)
RESULTS = Path(__file__).parent / "results"
CV_SCALES = [0.01, 0.1, 1.0, 10.0]
LORA = {"max_samples": 256, "seq_len": 256, "epochs": 1, "batch_size": 16, "micro_batch_size": 4, "lr": 3e-4}
ALPACA = str((data_dir() or Path(__file__).resolve().parents[2] / "shared" / "data") / "alpaca" / "alpaca_small.json")


def methods(n: int, layers: int) -> dict[str, tuple[list, dict]]:
    """name → (modifiers, calibration overrides)."""
    flatten = ["FuseNorm", {"FlattenAdjacent": {"n": n}}]
    issue3 = {"target_scales": None, "fallback": False}  # NystromMLP as in issue 3
    defaults = flatten + ["HeadPrune", "NystromMLP"]
    return {
        "dense": ([], {}),
        "ShortGPT": ([{"ShortGPT": {"n": n}}], {}),
        "SLEB": ([{"SLEB": {"n": n}}], {"samples": 8, "seq_len": 128}),
        # ~n × layers NLL passes: on Gemma-3-270M (262 k vocabulary, shared 2-core CPU) 8 × 128 took too long
        "SLEB 2×128": ([{"SLEB": {"n": n}}], {"samples": 2, "seq_len": 128}),
        "ShortGPT+LinearPatch": ([{"ShortGPT": {"n": n}}, "LinearPatch"], {}),
        # the contiguous block closest in angular distance, replaced by a linear map folded into down_proj
        "ReplaceMe": ([{"ReplaceMe": {"n": n}}], {}),
        "ReplaceMe cosine": ([{"ReplaceMe": {"n": n, "objective": "cosine"}}], {}),
        # the authors' selection: the block distance over the last token of each calibration window only
        "ReplaceMe last-token distance": ([{"ReplaceMe": {"n": n, "distance_tokens": "last"}}], {}),
        "GPTQ W4": ([{"GPTQ": {"bits": 4, "group_size": 64}}], {}),   # no layer removed; g64 divides 576 and 640
        "LaCo": ([{"LaCo": {"target_layers": layers - n, "search_steps": 6}}], {}),
        "LaCo C=2": ([{"LaCo": {"C": 2, "target_layers": layers - n, "search_steps": 8}}], {}),
        # the paper as written: Eq. 12 heads without refit, Nyström MLP (Theorem 3.1 only), one-shot statistics
        "FlattenGPT (paper)": (flatten + [{"HeadPrune": {"criterion": "eq12", "compensate": False}},
                                          {"NystromMLP": {"target": "merged"}}], {"propagate": "original"}),
        "FlattenGPT": (defaults, {}),
        "FlattenGPT+LinearPatch": (defaults + ["LinearPatch"], {}),
        # issue 17: recovery after FlattenGPT (CPU budget: 256 examples × 256 tokens, one epoch, 16 steps)
        "FlattenGPT+LoRA alpaca": (defaults + [{"LoRARecovery": {**LORA, "dataset": ALPACA}}], {}),
        "FlattenGPT+LoRA distill": (defaults + [{"LoRARecovery": {**LORA, "dataset": "wikipedia-sample",
                                                                  "distill": True}}], {}),
        # issue 11, session 8: the merges chosen by calibration NLL (SLEB-style rounds), not by input cosine
        "FlattenGPT nll": (["FuseNorm", {"FlattenAdjacent": {"n": n, "selection": "nll"}}, "HeadPrune",
                           "NystromMLP"], {}),
        "FlattenGPT nll merged": (["FuseNorm", {"FlattenAdjacent": {"n": n, "selection": "nll",
                                                                    "candidates": "merged"}}, "HeadPrune",
                                   "NystromMLP"], {}),
        # issue 11, session 9: each round merges a pair or drops a layer, whichever gives the lower NLL
        "FlattenGPT nll+drops": (["FuseNorm", {"FlattenAdjacent": {"n": n, "selection": "nll", "drops": True}},
                                 "HeadPrune", "NystromMLP"], {}),
        # issue-11 ablation: the refits and choices added on top of the issue-3 defaults
        "FlattenGPT (issue-3 defaults)": (flatten + ["HeadPrune", {"NystromMLP": issue3}], {}),
        "FlattenGPT target merged": (flatten + ["HeadPrune", {"NystromMLP": {**issue3, "target": "merged"}}], {}),
        "FlattenGPT +cv": (flatten + ["HeadPrune", {"NystromMLP": {**issue3, "target_scales": CV_SCALES}}], {}),
        "FlattenGPT +fallback": (flatten + ["HeadPrune", {"NystromMLP": {**issue3, "fallback": True}}], {}),
        "FlattenGPT +cv+fallback": (flatten + ["HeadPrune", {"NystromMLP": {
            **issue3, "target_scales": CV_SCALES, "fallback": True}}], {}),
        # issue-11 diagnosis (benchmarks/flatten_diagnosis.py): MLP channels by output energy, not leverage
        "FlattenGPT energy": (flatten + ["HeadPrune", {"NystromMLP": {**issue3, "criterion": "energy"}}], {}),
        "FlattenGPT energy +cv": (flatten + ["HeadPrune", {"NystromMLP": {
            **issue3, "criterion": "energy", "target_scales": CV_SCALES}}], {}),
    }


def zero_shot(model, tokenizer, limit: int) -> dict:
    """The paper's five zero-shot tasks (offline lm-eval configs), first ``limit`` rows of each."""
    from recipe_engine.evaluation import evaluate_model
    from recipe_engine.evaluation.zeroshot import PAPER_TASKS
    from recipe_engine.schema import EvaluateConfig

    config = EvaluateConfig(perplexity=None, tasks=PAPER_TASKS, limit=limit)
    result = evaluate_model(model, tokenizer, config, torch.device("cpu"), None)["zero_shot"]
    return {"limit": limit, "average": result["average"],
            "tasks": {task: r["value"] for task, r in result["tasks"].items()}}


def run_method(name: str, args, dense, tokenizer, texts: dict[str, str]) -> dict:
    steps, overrides = methods(args.n, dense.config.num_hidden_layers)[name]
    dataset, split = CALIBRATIONS[args.calibration]
    calibration = {"dataset": dataset, "split": split, "samples": args.samples, "seq_len": args.seq_len,
                   "seed": 0, **overrides}
    model, report = dense, None
    if steps:
        recipe = {"version": 1, "name": "compare", "model": args.model, "output": "out/unused",
                  "calibration": calibration, "modifiers": steps}
        try:
            model, report = recipe_engine.apply(recipe, model=copy.deepcopy(dense), tokenizer=tokenizer,
                                                write=False, progress=False)
        except RecipeError as exc:  # refused at validation for this architecture: a row saying why
            return {"method": name, "n": args.n, "calibration": args.calibration, "refused": f"{exc.modifier}: {exc.detail}",
                    "eval_windows": {key: args.windows[key] for key in args.evals},
                    "layers": dense.config.num_hidden_layers, "params_pct": 100.0, "ppl": {},
                    "compress_s": 0.0, "calibration_config": calibration, "modifiers": steps, "steps": []}
    ppl = {key: perplexity(model, tokenizer, texts[key], seq_len=1024, limit=args.windows[key])["ppl"]
           for key in args.evals}
    extra = {"zero_shot": zero_shot(model, tokenizer, args.task_limit)} if args.task_limit else {}
    removed = dense.config.num_hidden_layers - model.config.num_hidden_layers
    return {**extra, "method": name, "n": removed, "calibration": args.calibration,
            "eval_windows": {key: args.windows[key] for key in args.evals},
            "layers": model.config.num_hidden_layers,
            "params_pct": 100.0 * count_parameters(model) / count_parameters(dense), "ppl": ppl,
            "compress_s": sum(step.wall_s for step in report.steps) if report else 0.0,
            "peak_rss_mib": report.peak_memory.rss_mib if report else None,
            "calibration_config": calibration, "modifiers": steps,
            "steps": [{"modifier": s.modifier, "result": s.result} for s in report.steps] if report else []}


def key(row: dict) -> str:
    windows = ",".join(f"{k}{v}" for k, v in row["eval_windows"].items())
    return f"{row['method']}|{row['calibration']}|{row['calibration_config']['samples']}x" \
           f"{row['calibration_config']['seq_len']}|n={row['n']}|{windows}"


def print_table(rows: list[dict]) -> None:
    evals = [e for e in EVALS if any(e in r["ppl"] for r in rows)]
    print("\n| method | calibration | n | layers | params % | " + " | ".join(f"{e} PPL" for e in evals)
          + " | zero-shot avg | compress s |\n|" + "---|" * (7 + len(evals)))
    for row in rows:
        cal = row["calibration_config"]
        if "refused" in row:
            print(f"| {row['method']} | {row['calibration']} {cal['samples']}×{cal['seq_len']} | – | refused at "
                  f"validation: {row['refused']} |")
            continue
        ppl = " | ".join(f"{row['ppl'][e]:.2f} ({row['eval_windows'][e]})" if e in row["ppl"] else "–"
                         for e in evals)
        print(f"| {row['method']} | {row['calibration']} {cal['samples']}×{cal['seq_len']} | {row['n']} | "
              f"{row['layers']} | {row['params_pct']:.1f} | {ppl} | {average(row)} | {row['compress_s']:.0f} |")


def average(row: dict) -> str:
    zero = row.get("zero_shot")
    return f"{zero['average']:.3f} ({zero['limit']} rows/task)" if zero else "–"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=list(MODELS), default="smollm2-135m")
    parser.add_argument("--n", type=int, help="layers removed (default: 6 for SmolLM2, 5 for Qwen2.5-0.5B, "
                                              "4 for Gemma-3-270M)")
    parser.add_argument("--calibration", choices=list(CALIBRATIONS), default="wikipedia")
    parser.add_argument("--samples", type=int, default=32, help="calibration windows")
    parser.add_argument("--seq-len", type=int, default=512, help="calibration window length")
    parser.add_argument("--only", nargs="*", help="run only these methods (names from the table)")
    parser.add_argument("--evals", nargs="*", choices=list(EVALS), default=list(EVALS))
    parser.add_argument("--windows", nargs=3, type=int, metavar=("WIKITEXT2", "C4", "CODE"),
                        default=list(WINDOWS.values()), help="evaluation windows × 1024 tokens per source")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--task-limit", type=int, help="also the zero-shot average over the paper's five "
                                                       "tasks, first N rows of each")
    parser.add_argument("--table", action="store_true", help="only reprint the stored table")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    args.n = args.n or MODELS[args.model]
    args.windows = dict(zip(WINDOWS, args.windows))
    results = RESULTS / f"compare_methods_{args.model}.json"
    rows = json.loads(results.read_text())["rows"] if results.exists() else []
    if args.table:
        print_table(rows)
        return
    known = methods(args.n, 1)
    unknown = [m for m in args.only or () if m not in known]
    if unknown:
        parser.error(f"unknown methods {unknown}; known: {list(known)}")
    names = args.only or ["dense", "ShortGPT", "SLEB", "ShortGPT+LinearPatch", "ReplaceMe", "FlattenGPT (paper)",
                          "FlattenGPT"]
    dense, tokenizer, _ = load_model(args.model, "float32")
    calibrated = CALIBRATIONS[args.calibration][0]
    calibrated = [calibrated] if isinstance(calibrated, str) else calibrated
    texts = {e: load_text(EVALS[e][0], "test" if EVALS[e][0] in calibrated else EVALS[e][1]).text
             for e in args.evals}
    by_key = {key(row): row for row in rows}
    for name in names:
        row = run_method(name, args, dense, tokenizer, texts)
        row["date"] = datetime.date.today().isoformat()
        if results.exists():  # re-read: another invocation may have added rows since this one started
            by_key = {**{key(r): r for r in json.loads(results.read_text())["rows"]}, **by_key}
        by_key[key(row)] = row
        results.parent.mkdir(parents=True, exist_ok=True)
        results.write_text(json.dumps({"model": args.model, "machine": platform.processor() or platform.machine(),
                                       "rows": list(by_key.values())}, indent=2, default=str))
        if "refused" in row:
            print(f"{name:<32} refused: {row['refused']}", flush=True)
            continue
        print(f"{name:<32} n={row['n']} {row['layers']:>3} layers {row['params_pct']:6.1f}% params PPL "
              + " ".join(f"{e} {v:.2f}" for e, v in row["ppl"].items())
              + f"  {row['compress_s']:7.1f} s  zero-shot {average(row)}", flush=True)
    print_table(list(by_key.values()))


if __name__ == "__main__":
    main()
