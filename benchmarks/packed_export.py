"""The packed default against the dequantized checkpoint: SmolLM2-135M GPTQ W4 g64 (``recipes/gptq4_smollm2.yaml``,
which names no ``export``), bytes on disk and WikiText-2 perplexity of each output read back from its files.

Rows: "packed" is the recipe as shipped (compressed-tensors ``pack-quantized``, the default). "dequantized" is
the same weights as a stock checkpoint: the packed output loaded with ``load_model`` (every packed linear
dequantized, bit for bit the weights the step left: ``tests/test_exporters.py``) and written with
``save_pretrained`` — what ``export: dequantized`` writes (both round their scales to the model dtype, so the
weights are bit for bit the same; GPTQ v1 stores fp16 scales, so its grid differs). ``--separate`` adds the
recipe run again with ``export: dequantized`` and ``export: gptq`` (GPTQ v1), three GPTQ runs in all. Each output
is loaded from disk with ``recipe_engine.sources.models.load_model`` (what ``recipe eval`` does) and evaluated on the
first ``--windows`` windows × 1024 tokens of WikiText-2 test. "ratio": safetensors bytes over the dequantized
row's.

Run: OMP_NUM_THREADS=2 python -m benchmarks.packed_export   (prints a table, writes --out/results.json;
``--reuse`` keeps a packed output already in --out instead of running the recipe again)
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
from recipe_engine.sources.text import load_text
from recipe_engine.sources.sizes import checkpoint_bytes
from recipe_engine.sources.models import load_model

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "gptq4_smollm2.yaml"


def run_recipe(base: dict, directory: Path, export: str | None, dense, tokenizer) -> float:
    """Apply the recipe (``export`` set, or as shipped) into ``directory``; returns the steps' wall seconds."""
    recipe = copy.deepcopy(base) | {"output": str(directory)}
    if export is not None:
        recipe["modifiers"][0]["GPTQ"]["export"] = export
    _, report = recipe_engine.apply(recipe, model=copy.deepcopy(dense), tokenizer=tokenizer, force=True,
                                    progress=False)
    return sum(step.wall_s for step in report.steps)


def measure(name: str, directory: Path, test: str, windows: int) -> dict:
    loaded, tokenizer, _ = load_model(str(directory), "float32")
    quantization = json.loads((directory / "config.json").read_text()).get("quantization_config") or {}
    row = {"row": name, "directory": str(directory), "bytes": checkpoint_bytes(directory),
           "quant_method": quantization.get("quant_method"),
           "ppl": perplexity(loaded, tokenizer, test, seq_len=1024, limit=windows)["ppl"]}
    print(f"{name:28s} {row['bytes'] / 2**20:8.1f} MiB  PPL {row['ppl']:.4f}", flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/packed_export"))
    parser.add_argument("--windows", type=int, default=24)
    parser.add_argument("--reuse", action="store_true", help="keep --out/packed if it is there")
    parser.add_argument("--separate", action="store_true", help="also run export: dequantized and export: gptq")
    args = parser.parse_args()
    base = yaml.safe_load(RECIPE.read_text())
    base.pop("evaluate", None)
    dense, tokenizer, _ = load_model(base["model"], base["dtype"])
    test = load_text("wikitext2", "test").text
    results = {"date": datetime.date.today().isoformat(), "machine": platform.processor() or platform.machine(),
               "threads": torch.get_num_threads(), "recipe": RECIPE.name, "windows": args.windows, "rows": []}
    packed = args.out / "packed"
    if not (args.reuse and (packed / "config.json").is_file()):
        results["packed_compress_s"] = run_recipe(base, packed, None, dense, tokenizer)
    results["rows"].append(measure("packed (default)", packed, test, args.windows))
    loaded, loaded_tokenizer, _ = load_model(str(packed), "float32")
    loaded.save_pretrained(args.out / "dequantized")
    loaded_tokenizer.save_pretrained(args.out / "dequantized")
    results["rows"].append(measure("dequantized (same weights)", args.out / "dequantized", test, args.windows))
    for export in ("dequantized", "gptq") if args.separate else ():
        directory = args.out / f"run-{export}"
        run_recipe(base, directory, export, dense, tokenizer)
        results["rows"].append(measure(f"export: {export} (own run)", directory, test, args.windows))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=2))
    reference = results["rows"][1]
    print("\n| output | quant_method | safetensors MiB | bytes vs dequantized | WikiText-2 PPL | PPL vs dequantized |\n"
          "|---|---|---|---|---|---|")
    for row in results["rows"]:
        print(f"| {row['row']} | {row['quant_method']} | {row['bytes'] / 2**20:.1f} | "
              f"{row['bytes'] / reference['bytes']:.3f}x | {row['ppl']:.4f} | "
              f"{100 * (row['ppl'] / reference['ppl'] - 1):+.4f} % |")


if __name__ == "__main__":
    main()
