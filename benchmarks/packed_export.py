"""The packed default against the dequantized export: SmolLM2-135M GPTQ W4 g64 (``recipes/gptq4_smollm2.yaml``,
which names no ``export``), bytes on disk and WikiText-2 perplexity of each output read back from its files.

Rows: the recipe as shipped (compressed-tensors ``pack-quantized``, the default), the same recipe with
``export: dequantized`` and with ``export: gptq`` (GPTQ v1). Each output is loaded from disk with
``recipe_engine.io.models.load_model`` (what ``recipe eval`` does: packed linears dequantized into fp32) and
evaluated on the first ``--windows`` windows × 1024 tokens of WikiText-2 test. "ratio" is safetensors bytes
over the dequantized output's.

Run: OMP_NUM_THREADS=2 python benchmarks/packed_export.py   (prints a table, writes --out/results.json)
"""
from __future__ import annotations

import argparse
import copy
import datetime
import json
import platform
from pathlib import Path

import torch
import yaml

import recipe_engine
from recipe_engine.evaluation.perplexity import perplexity
from recipe_engine.io.data import load_text
from recipe_engine.io.models import checkpoint_bytes, load_model

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "gptq4_smollm2.yaml"
ROWS = {"packed (default)": None, "dequantized": "dequantized", "gptq v1": "gptq"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/packed_export"))
    parser.add_argument("--windows", type=int, default=24)
    parser.add_argument("--only", nargs="*", choices=list(ROWS))
    args = parser.parse_args()
    base = yaml.safe_load(RECIPE.read_text())
    base.pop("evaluate", None)
    dense, tokenizer, _ = load_model(base["model"], base["dtype"])
    test = load_text("wikitext2", "test").text
    results = {"date": datetime.date.today().isoformat(), "machine": platform.processor() or platform.machine(),
               "threads": torch.get_num_threads(), "recipe": str(RECIPE.name), "windows": args.windows, "rows": []}
    for name, export in ROWS.items():
        if args.only and name not in args.only:
            continue
        directory = args.out / name.split()[0]
        recipe = copy.deepcopy(base) | {"output": str(directory)}
        if export is not None:
            recipe["modifiers"][0]["GPTQ"]["export"] = export
        _, report = recipe_engine.apply(recipe, model=copy.deepcopy(dense), tokenizer=tokenizer, force=True,
                                        progress=False)
        loaded, loaded_tokenizer, _ = load_model(str(directory), "float32")
        row = {"row": name, "export": export or "(none: default)", "bytes": checkpoint_bytes(directory),
               "quant_method": (json.loads((directory / "config.json").read_text()).get("quantization_config")
                                or {}).get("quant_method"),
               "compress_s": sum(step.wall_s for step in report.steps),
               "ppl": perplexity(loaded, loaded_tokenizer, test, seq_len=1024, limit=args.windows)["ppl"]}
        results["rows"].append(row)
        print(f"{name:18s} {row['bytes'] / 2**20:8.1f} MiB  PPL {row['ppl']:.4f}  ({row['compress_s']:.0f} s)",
              flush=True)
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(results, indent=2))
    reference = next((r for r in results["rows"] if r["export"] == "dequantized"), None)
    print("\n| output | quant_method | safetensors MiB | ratio | WikiText-2 PPL | vs dequantized |\n|---|---|---|---|---|---|")
    for row in results["rows"]:
        ratio = f"{row['bytes'] / reference['bytes']:.3f}" if reference else "–"
        delta = f"{100 * (row['ppl'] / reference['ppl'] - 1):+.4f} %" if reference else "–"
        print(f"| {row['row']} | {row['quant_method']} | {row['bytes'] / 2**20:.1f} | {ratio} | {row['ppl']:.4f} | "
              f"{delta} |")


if __name__ == "__main__":
    main()
