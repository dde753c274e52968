"""FlattenGPT vs ShortGPT vs ShortGPT+LinearPatch vs SLEB on SmolLM2-135M at n = 2, 4, 6, 8, 10 removed layers.

The ``recipe sweep`` machinery (``recipe_engine.workflows.sweep.Sweep``) over the four shipped SmolLM2 recipes, all
calibrated on WikiText-2 validation (FlattenGPT's recipe calibrates on the Wikipedia sample by default;
overrides make every method see the same text), ``--samples`` windows (default 16, half the recipes' 32, to
fit a shared 2-core machine) of each recipe's length, seed 0: 16 × 512 tokens (SLEB: 16 × 128, its recipe's
window, since it runs ~n × layers NLL passes). Shared work is done once: the dense model load, the
calibration capture, FlattenAdjacent's similarity, ShortGPT's block influence and SLEB's greedy rounds
(n = 10's rounds contain every smaller n's). Evaluation: WikiText-2 test PPL on the first ``--eval-limit``
windows × 1024 tokens (and zero-shot on ``--tasks`` with the same row limit, if given).

Run (repository root; resumable: rerunning skips finished rows):
    nice -n 10 python -m benchmarks.sweep_smollm2 --out benchmarks/results/sweep_smollm2
It writes ``sweep.json`` and ``pareto.png`` under ``--out`` and copies the plot to docs/images/, and upserts
this run's rows into the SmolLM2 quality-against-budget table of the committed
``benchmarks/results/quality_smollm2.json`` (``--no-rows`` to skip); ``python benchmarks/report.py`` then
re-renders BENCHMARKS.md and its plots.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ["recipes/shortgpt_smollm2.yaml", "recipes/flatten20_smollm2.yaml",  # cheapest first
           "recipes/shortgpt_linearpatch_smollm2.yaml", "recipes/sleb_smollm2.yaml"]
#: recipe file → method name in BENCHMARKS.md
METHODS = {"shortgpt_smollm2.yaml": "ShortGPT", "flatten20_smollm2.yaml": "FlattenGPT (ours)",
           "shortgpt_linearpatch_smollm2.yaml": "ShortGPT + LinearPatch", "sleb_smollm2.yaml": "SLEB"}


def write_rows(rows: list[dict], recipes: list[str], samples: int, eval_limit: int) -> None:
    """This run's rows (the chosen recipes and the dense baseline) into quality_smollm2.json's ``sweep``."""
    from benchmarks import rowstore

    protocol = "in-domain, small" if (samples, eval_limit) == (16, 8) else \
        f"in-domain, {samples} calibration windows, {eval_limit} test windows"
    run = rowstore.run_record()
    dense = next(r for r in rows if r["recipe"] == "dense")
    chosen = {Path(r).name for r in recipes}
    for row in rows:
        name = Path(row["file"]).name if row["file"] else None
        if row["recipe"] != "dense" and name not in chosen:
            continue   # rows of earlier runs keep their own run
        n = 0 if row["recipe"] == "dense" else next(v for k, v in row["params"].items() if k.split(".")[-1] == "n")
        rowstore.upsert_model_row(
            ROOT / "benchmarks" / "results" / "quality_smollm2.json",
            {"protocol": protocol, "method": "dense" if n == 0 else METHODS.get(name, row["recipe"]), "n": n,
             "layers": row["layers"], "params_pct": round(100 * row["parameters"] / dense["parameters"], 1),
             "ppl": {"wikitext2": round(row["ppl"], 2)}},
            run, section="SmolLM2-135M", order=10, model="smollm2-135m")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/sweep_smollm2")
    parser.add_argument("--n", default="2,4,6,8,10")
    parser.add_argument("--eval-limit", type=int, default=8)
    parser.add_argument("--tasks", nargs="*")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--samples", type=int, default=16, help="calibration windows for every recipe")
    parser.add_argument("--recipes", nargs="*", default=RECIPES,
                        help="a subset of the four recipes (rows accumulate in --out; the plot shows all)")
    parser.add_argument("--no-rows", action="store_true", help="do not write the committed result rows")
    args = parser.parse_args()
    import torch
    from rich.console import Console

    from recipe_engine.workflows.sweep import Sweep, plot, table

    torch.set_num_threads(args.threads)
    sweep = Sweep([str(ROOT / r) for r in args.recipes], [f"n={args.n}"], args.out, args.eval_limit, args.tasks,
                  overrides=["calibration.dataset=wikitext2", "calibration.split=validation",
                             f"calibration.samples={args.samples}"])
    start = time.perf_counter()
    rows = sweep.run()
    Console(width=140).print(table(rows))
    shared = sweep.shared_work()
    print(json.dumps({"shared_work": shared, "wall_s": time.perf_counter() - start}))
    out = Path(args.out)
    (out / "shared_work.json").write_text(json.dumps(shared, indent=2))
    if not args.no_rows:
        write_rows(rows, args.recipes, args.samples, args.eval_limit)
    problem = plot(rows, out / "pareto.png")
    if problem:
        sys.exit(problem)
    (ROOT / "docs" / "images").mkdir(exist_ok=True)
    shutil.copy(out / "pareto.png", ROOT / "docs" / "images" / "sweep_smollm2.png")


if __name__ == "__main__":
    main()
