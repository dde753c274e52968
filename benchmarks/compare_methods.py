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
16 × 1024; Qwen2.5-Coder is a code model); ``--windows`` changes the counts (the default is the model's
committed tables' windows: 16 8 8 for Qwen2.5-0.5B on a 2-core CPU). Each method runs through
``recipe_engine.apply(recipe, write=False)`` on a fresh copy of the dense model; "compress s" is the sum of the
steps' wall times.

Run: nice -n 10 python -m benchmarks.compare_methods --model qwen2.5-0.5b [--calibration wikipedia]
     [--n 5] [--only NAME ...] [--task-limit 200]
It prints a table and merges each finished row into the raw file
benchmarks/results/raw/compare_methods_<model>.json (keyed by method, calibration and n, so runs with --only
accumulate; --table reprints it) and into the committed rows, ``--rows`` (default
benchmarks/results/quality_<model>.json; the model's main n goes to its quality table, any other n to its
quality-against-budget table); ``python benchmarks/report.py`` then re-renders BENCHMARKS.md. A method that
validation refuses on the model's architecture (FlattenGPT on Gemma 3) is a row with the one-line reason.
"""
from __future__ import annotations

import argparse
import copy
import datetime
import json
from pathlib import Path

import torch

import recipe_engine
from benchmarks import rowstore
from recipe_engine.architectures.adapters import count_parameters
from recipe_engine.sources.text import data_dir, load_text
from recipe_engine.errors import RecipeError
from recipe_engine.evaluation.perplexity import perplexity
from recipe_engine.sources.models import load_model

MODELS = {"smollm2-135m": 6, "qwen2.5-0.5b": 5, "gemma3-270m": 4}   # default n: ~20 % of the depth (4 of 18)
CALIBRATIONS = {"wikipedia": ("wikipedia-sample", "train"), "wikitext2": ("wikitext2", "validation"),
                "c4": ("c4-sample", "train"), "wikipedia+c4": (["wikipedia-sample", "c4-sample"], "train")}
# c4 / code: the whole file (none of it is calibrated on), except the test split of a calibrated source
EVALS = {"wikitext2": ("wikitext2", "test"), "c4": ("c4-sample", "all"), "code": ("code-sample", "all")}
WINDOWS = {"wikitext2": 24, "c4": 16, "code": 16}   # default windows × 1024 tokens (--windows to change)
MAIN_WINDOWS = {"qwen2.5-0.5b": {"wikitext2": 16, "c4": 8, "code": 8}}   # the windows of its committed tables
RESULTS = Path(__file__).parent / "results"
RAW = RESULTS / "raw"
#: model → (committed result file, page section, order on the page)
ROW_FILES = {"smollm2-135m": ("quality_smollm2.json", "SmolLM2-135M", 10),
             "qwen2.5-0.5b": ("quality_qwen2_5_0_5b.json", "Qwen2.5-0.5B", 20),
             "gemma3-270m": ("quality_gemma3_270m.json", "Gemma-3-270M", 30)}
#: calibration source → protocol name in the committed rows
PROTOCOLS = {"wikitext2": "in-domain", "wikipedia": "held-out", "wikipedia+c4": "mixed", "c4": "in-domain C4"}
#: method key here → its name in BENCHMARKS.md (other keys are shown as they are)
LABELS = {"FlattenGPT": "FlattenGPT (ours)", "ShortGPT+LinearPatch": "ShortGPT + LinearPatch",
          "SLEB+LinearPatch": "SLEB + LinearPatch", "auto (depth20_auto)": "auto (`depth20_auto`)",
          "ReplaceMe hook": "ReplaceMe, map as a hook (`fold: hook`)",
          "BestOf ReplaceMe splits": "ReplaceMe then FlattenGPT, the split chosen by held-out NLL",
          "FlattenGPT+LinearPatch": "FlattenGPT + LinearPatch", "LaCo": "LaCo (C = 4)", "LaCo C=2": "LaCo (C = 2)",
          "GPTQ W4": "GPTQ W4 g64", "SLEB 2×128": "SLEB, 2 × 128 calibration",
          "FlattenGPT+LoRA alpaca": "FlattenGPT + LoRA (Alpaca)",
          "FlattenGPT+LoRA distill": "FlattenGPT + LoRA (distill)",
          "FlattenGPT +cv+fallback": "FlattenGPT, cross-validated λ_t",
          "FlattenGPT energy": "FlattenGPT, energy channels",
          "FlattenGPT nll": "FlattenGPT, merges by NLL",
          "FlattenGPT nll merged": "FlattenGPT, merges by NLL (unpruned candidates)",
          "FlattenGPT nll+drops": "FlattenGPT, merges by NLL or drops"}
CV_SCALES = [0.01, 0.1, 1.0, 10.0]
LORA = {"max_samples": 256, "seq_len": 256, "epochs": 1, "batch_size": 16, "micro_batch_size": 4, "lr": 3e-4}
ALPACA = str((data_dir() or Path(__file__).resolve().parents[2] / "shared" / "data") / "alpaca" / "alpaca_small.json")


def recipe_steps(name: str, n: int, layers: int) -> list:
    """The steps of ``recipes/<name>`` with its budgets as counts for removing ``n`` of ``layers`` layers:
    ``20%`` → ``n``, ``10%`` (the first of two moves, about half the budget) → ``n // 2``, ``13%`` (about two
    thirds) → ``round(2n / 3)``, ``80%`` (the layers kept) → ``layers − n``; at the recipes' own n = 20 % of
    SmolLM2-135M and Qwen2.5-0.5B these are what the percentages resolve to."""
    import yaml

    path = Path(__file__).resolve().parents[1] / "recipes" / name
    text = json.dumps(yaml.safe_load(path.read_text())["modifiers"])
    for percent, count in (("20%", n), ("10%", n // 2), ("13%", round(2 * n / 3)), ("80%", layers - n)):
        text = text.replace(percent, str(count))
    return json.loads(text)


def methods(n: int, layers: int) -> dict[str, tuple[list, dict]]:
    """name → (modifiers, calibration overrides)."""
    flatten = ["FuseNorm", {"FlattenAdjacent": {"n": n}}]
    plain = {"target_scales": None, "fallback": False}  # NystromMLP's own defaults, stated for the variants below
    defaults = flatten + ["HeadPrune", "NystromMLP"]
    return {
        "dense": ([], {}),
        "ShortGPT": ([{"ShortGPT": {"n": n}}], {}),
        "SLEB": ([{"SLEB": {"n": n}}], {"samples": 8, "seq_len": 128}),
        # ~n × layers NLL passes: on Gemma-3-270M (262 k vocabulary, shared 2-core CPU) 8 × 128 took too long
        "SLEB 2×128": ([{"SLEB": {"n": n}}], {"samples": 2, "seq_len": 128}),
        # SLEB's rounds scored on 128-token prefixes of the first 24 of the 32 × 512 calibration windows (3 × the
        # tokens of the 8 × 128 default)
        "SLEB 24×128 probe": ([{"SLEB": {"n": n, "search_samples": 24, "search_length": 128}}], {}),
        "ShortGPT+LinearPatch": ([{"ShortGPT": {"n": n}}, "LinearPatch"], {}),
        # the contiguous block closest in angular distance, replaced by a linear map folded into down_proj
        "ReplaceMe": ([{"ReplaceMe": {"n": n}}], {}),
        "ReplaceMe cosine": ([{"ReplaceMe": {"n": n, "objective": "cosine"}}], {}),
        # the map applied by a hook to what the layer adds to the residual stream (Gemma 3: its normalized MLP
        # output), saved as an extra: the form of ReplaceMe that architectures with an MLP output norm allow
        "ReplaceMe hook": ([{"ReplaceMe": {"n": n, "fold": "hook"}}], {}),
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
        # recovery after FlattenGPT (CPU budget: 256 examples × 256 tokens, one epoch, 16 steps)
        "FlattenGPT+LoRA alpaca": (defaults + [{"LoRARecovery": {**LORA, "dataset": ALPACA}}], {}),
        "FlattenGPT+LoRA distill": (defaults + [{"LoRARecovery": {**LORA, "dataset": "wikipedia-sample",
                                                                  "distill": True}}], {}),
        # the merges chosen by calibration NLL (SLEB-style rounds), not by input cosine
        # (score: insample: the rows recorded before held-out scoring became the default)
        "FlattenGPT nll": (["FuseNorm", {"FlattenAdjacent": {"n": n, "selection": "nll", "score": "insample"}},
                            "HeadPrune", "NystromMLP"], {}),
        "FlattenGPT nll merged": (["FuseNorm", {"FlattenAdjacent": {"n": n, "selection": "nll", "score": "insample",
                                                                    "candidates": "merged"}}, "HeadPrune",
                                   "NystromMLP"], {}),
        # each round merges a pair or drops a layer, whichever gives the lower NLL
        "FlattenGPT nll+drops": (["FuseNorm", {"FlattenAdjacent": {"n": n, "selection": "nll", "drops": True,
                                                                   "score": "insample"}},
                                 "HeadPrune", "NystromMLP"], {}),
        # merges pruned on fit windows, every move scored on held-out score windows (docs/methods/bestof.md)
        "FlattenGPT nll+drops heldout": (["FuseNorm", {"FlattenAdjacent": {"n": n, "selection": "nll", "drops": True,
                                                                           "score": "heldout"}},
                                         "HeadPrune", "NystromMLP"], {}),
        # SLEB scored on 8 × 128 tokens of the calibration, LinearPatch fitted on all of it
        "SLEB+LinearPatch": ([{"SLEB": {"n": n, "search_samples": 8, "search_length": 128}}, "LinearPatch"], {}),
        # combinations of two moves at half the budget each (the first takes n // 2 layers):
        # recipes/replaceme_flatten20.yaml, then variations of it
        "ReplaceMe+FlattenGPT": (recipe_steps("replaceme_flatten20.yaml", n, layers), {}),
        "FlattenGPT+ReplaceMe": (["FuseNorm", {"FlattenAdjacent": {"n": n // 2}}, "HeadPrune", "NystromMLP",
                                  {"ReplaceMe": {"n": n - n // 2}}], {}),
        "ReplaceMe×2": ([{"ReplaceMe": {"n": n // 2}}, {"ReplaceMe": {"n": n - n // 2}}], {}),
        "ReplaceMe+LinearPatch": ([{"ReplaceMe": {"n": n}}, "LinearPatch"], {}),
        # the split between the two moves searched: ReplaceMe on all n, or on k < n then FlattenGPT merges the
        # other n − k, each alternative fitted on the fit windows and scored on the held-out score windows
        "BestOf ReplaceMe splits": ([{"BestOf": {"alternatives": [[{"ReplaceMe": {"n": n}}]] + [
            [{"ReplaceMe": {"n": k}}, "FuseNorm", {"FlattenAdjacent": {"target_layers": layers - n}}, "HeadPrune",
             "NystromMLP"] for k in range(1, n)]}}], {}),
        # ReplaceMe alone against the auto recipe's two-thirds split, by the same held-out score
        "BestOf ReplaceMe or two-thirds split": ([{"BestOf": {"alternatives": [[{"ReplaceMe": {"n": n}}], [
            {"ReplaceMe": {"n": round(2 * n / 3)}}, "FuseNorm", {"FlattenAdjacent": {"target_layers": layers - n}},
            "HeadPrune", "NystromMLP"]]}}], {}),
        **{f"ReplaceMe<n:{k}>+FlattenGPT": ([{"ReplaceMe": {"n": k}}, "FuseNorm",
                                             {"FlattenAdjacent": {"target_layers": layers - n}}, "HeadPrune",
                                             "NystromMLP"], {}) for k in range(1, n)},
        # recipes/depth20_auto.yaml with its 20 % replaced by n: BestOf by held-out calibration NLL
        "auto (depth20_auto)": (recipe_steps("depth20_auto.yaml", n, layers), {}),
        # NystromMLP variants on top of the defaults: its target, cross-validated λ_t, the fallback to dropping
        "FlattenGPT target merged": (flatten + ["HeadPrune", {"NystromMLP": {**plain, "target": "merged"}}], {}),
        "FlattenGPT +cv": (flatten + ["HeadPrune", {"NystromMLP": {**plain, "target_scales": CV_SCALES}}], {}),
        "FlattenGPT +fallback": (flatten + ["HeadPrune", {"NystromMLP": {**plain, "fallback": True}}], {}),
        "FlattenGPT +cv+fallback": (flatten + ["HeadPrune", {"NystromMLP": {
            **plain, "target_scales": CV_SCALES, "fallback": True}}], {}),
        # MLP channels by output energy, not leverage (benchmarks/diagnosis/flatten.py)
        "FlattenGPT energy": (flatten + ["HeadPrune", {"NystromMLP": {**plain, "criterion": "energy"}}], {}),
        "FlattenGPT energy +cv": (flatten + ["HeadPrune", {"NystromMLP": {
            **plain, "criterion": "energy", "target_scales": CV_SCALES}}], {}),
    }


def zero_shot(model, tokenizer, limit: int) -> dict:
    """The paper's five zero-shot tasks (offline lm-eval configs), first ``limit`` rows of each."""
    from recipe_engine.evaluation import evaluate_model
    from recipe_engine.evaluation.zeroshot import PAPER_TASKS
    from recipe_engine.recipe.schema import EvaluateConfig

    config = EvaluateConfig(perplexity=None, tasks=PAPER_TASKS, limit=limit)
    result = evaluate_model(model, tokenizer, config, torch.device("cpu"), None).zero_shot
    return {"limit": limit, "average": result.average, "tasks": {task: r.value for task, r in result.tasks.items()}}


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
            return {"method": name, "n": args.n, "calibration": args.calibration,
                    "refused": f"{exc.modifier}: {exc.detail}",
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


def committed_row(row: dict, model: str, sweep: bool) -> dict:
    """The raw row in the committed schema (benchmarks/results/README.md): protocol, display name, rounded
    figures; with ``sweep`` (a run off the model's main n) it carries ``n`` and goes to the
    quality-against-budget table. Evaluation windows other than the model's usual ones name the protocol."""
    cal = row["calibration_config"]
    method = LABELS.get(row["method"], row["method"])
    if cal["samples"] != 32 and row["method"] != "dense" and "SLEB" not in row["method"]:
        method += f", {cal['samples']} × {cal['seq_len']} calibration"
    protocol = PROTOCOLS.get(row["calibration"], row["calibration"])
    windows = row["eval_windows"]
    usual = MAIN_WINDOWS.get(model, WINDOWS)
    if windows != {k: v for k, v in usual.items() if k in windows}:
        count = windows.get("wikitext2", max(windows.values()))
        protocol += f", {count} window" + ("s" if count != 1 else "")
    out = {"protocol": protocol, "method": method}
    if sweep and "refused" not in row:
        out["n"] = row["n"]
    if "refused" in row:
        return {**out, "status": "refused at validation", "note": f"`{row['refused']}`"}
    out.update(layers=row["layers"], params_pct=round(row["params_pct"], 1),
               ppl={k: round(v, 2) for k, v in row["ppl"].items()})
    if row["method"] == "GPTQ W4":
        out["bits"] = "W4 g64"
    if row.get("zero_shot"):
        z = row["zero_shot"]
        out["zero_shot"] = {"average": round(z["average"], 3), "tasks": {t: round(v, 3) for t, v in z["tasks"].items()}}
    if row["compress_s"]:
        out["compress_s"] = round(row["compress_s"])
    if row.get("peak_rss_mib"):
        out["peak_rss_gib"] = round(row["peak_rss_mib"] / 1024, 2)
    return out


def write_committed(path: Path, model: str, row: dict, sweep: bool, run: dict) -> None:
    _, section, order = ROW_FILES[model]
    rowstore.upsert_model_row(path, committed_row(row, model, sweep), run, section=section, order=order, model=model)


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
                        help="evaluation windows × 1024 tokens per source (default: the model's committed tables' "
                             "windows, MAIN_WINDOWS, else 24 16 16)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--task-limit", type=int, help="also the zero-shot average over the paper's five "
                                                       "tasks, first N rows of each")
    parser.add_argument("--table", action="store_true", help="only reprint the stored table")
    parser.add_argument("--rows", type=Path, help="committed result file to upsert rows into (default "
                                                   "benchmarks/results/quality_<model>.json)")
    parser.add_argument("--no-rows", action="store_true", help="write only the raw file, no committed rows")
    parser.add_argument("--conditions", help="what else ran on the machine (load), recorded with the run")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    args.n = args.n or MODELS[args.model]
    args.windows = dict(zip(WINDOWS, args.windows)) if args.windows else dict(MAIN_WINDOWS.get(args.model, WINDOWS))
    results = RAW / f"compare_methods_{args.model}.json"
    committed = args.rows or RESULTS / ROW_FILES[args.model][0]
    if not args.no_rows:
        run = rowstore.run_record(args.conditions)
        rowstore.load_file(committed, *ROW_FILES[args.model][1:])   # an unreadable file fails before the work
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
    measured = {}   # this invocation's rows: they replace stored rows of the same key, nothing else does
    for name in names:
        row = run_method(name, args, dense, tokenizer, texts)
        row["date"] = datetime.date.today().isoformat()
        measured[key(row)] = row
        with rowstore.exclusive(results):  # re-read: another invocation may have added rows since this one started
            stored = json.loads(results.read_text())["rows"] if results.exists() else []
            by_key = {**{key(r): r for r in stored}, **measured}
            rowstore.save_json(results, {"model": args.model, "rows": list(by_key.values())}, default=str)
        if not args.no_rows:
            write_committed(committed, args.model, row, args.n != MODELS[args.model], run)
        if "refused" in row:
            print(f"{name:<32} refused: {row['refused']}", flush=True)
            continue
        print(f"{name:<32} n={row['n']} {row['layers']:>3} layers {row['params_pct']:6.1f}% params PPL "
              + " ".join(f"{e} {v:.2f}" for e, v in row["ppl"].items())
              + f"  {row['compress_s']:7.1f} s  zero-shot {average(row)}", flush=True)
    print_table(list(by_key.values()))


if __name__ == "__main__":
    main()
